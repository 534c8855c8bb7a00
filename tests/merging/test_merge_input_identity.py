"""A merge's inputs are told apart by their bytes (issue 41, item 5): the same model under two names
(a symlink, a hard link, a copy) or a --base equal to a model is refused in one line before any work;
models that differ in a single byte are merged."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from mima.core.file_identity import BLOCK_BYTES, SAMPLED_BLOCKS, first_duplicate, same_bytes
from tests.helpers import assert_one_line, cli


def _alias(kind: str, source: Path, target: Path) -> Path:
    {"symlink": lambda: target.symlink_to(source), "hardlink": lambda: os.link(source, target),
     "copy": lambda: shutil.copyfile(source, target)}[kind]()
    return target


@pytest.mark.parametrize("kind", ["same path", "symlink", "hardlink", "copy"])
def test_a_model_given_twice_is_refused(encoders, tmp_path, capfd, kind):
    twice = encoders["m1"] if kind == "same path" else _alias(kind, encoders["m1"], tmp_path / "again.safetensors")
    out = tmp_path / "merged.safetensors"
    result = cli(["merge", "--method", "task_arithmetic", "--base", encoders["base"], "--models", encoders["m1"],
                  encoders["m2"], twice, "--output", out], capfd)
    assert_one_line(result.code, result.err, f"--models {twice}: holds the same bytes as --models {encoders['m1']}")
    assert not out.exists()


@pytest.mark.parametrize("kind", ["hardlink", "copy"])
def test_a_base_equal_to_a_model_is_refused(encoders, tmp_path, capfd, kind):
    base = _alias(kind, encoders["m2"], tmp_path / "base.safetensors")
    out = tmp_path / "merged.safetensors"
    result = cli(["merge", "--method", "ties", "--base", base, "--models", encoders["m1"], encoders["m2"], "--output", out],
                 capfd)
    assert_one_line(result.code, result.err, f"--models {encoders['m2']}: holds the same bytes as --base {base}")
    assert not out.exists()


def test_distinct_models_still_merge(encoders, tmp_path, capfd):
    out = tmp_path / "merged.safetensors"
    result = cli(["merge", "--method", "uniform", "--models", encoders["m1"], encoders["m2"], "--output", out], capfd)
    assert result.code == 0, result.err
    assert out.is_file()


def test_files_that_differ_between_the_sampled_blocks_are_compared_in_full(tmp_path):
    """The sampled blocks agree, the byte that differs lies between them: only the full comparison sees it."""
    size = SAMPLED_BLOCKS * 4 * BLOCK_BYTES  # samples every 4 blocks: three in four bytes are not sampled
    data = bytes(os.urandom(size))
    step = size // SAMPLED_BLOCKS
    changed_at = 3 * step + BLOCK_BYTES + 17  # after the fourth sample's block, before the fifth
    first, second, copy = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    first.write_bytes(data)
    second.write_bytes(data[:changed_at] + bytes([data[changed_at] ^ 1]) + data[changed_at + 1:])
    copy.write_bytes(data)
    stats = {path: os.stat(path) for path in (first, second, copy)}
    assert not same_bytes(first, second, stats[first], stats[second])
    assert same_bytes(first, copy, stats[first], stats[copy])
    assert first_duplicate([first, second]) is None
    assert first_duplicate([second, first, copy]) == (1, 2)
