"""Issue 26, item 7: a write the system refuses is one line naming the path, for every command.

Each command runs in a subprocess that may write no file beyond a few KB (RLIMIT_FSIZE: the write
fails with EFBIG, as a full disk's fails with ENOSPC). Each must exit 2 with exactly one error line
on stderr naming the output it could not write and what to do (`ulimit -f`), no traceback, and leave
no partial output: no output file, no temporary file. (`mima merge`: tests/refusals/test_outputs_and_inputs.py.)
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import open_clip
import pytest
import torch
import yaml

from mima.cli import main
from tests.helpers import fit_config, run_command

LIMIT = 4096  # bytes: above a config.yaml or a cell file, below any model or results file


def limited(*argv, limit: int = LIMIT) -> subprocess.CompletedProcess:
    return run_command(list(argv), file_size_limit=limit)


def the_error_line(result: subprocess.CompletedProcess, command: str, path: Path) -> str:
    """Exit 2, no traceback, exactly one error line (fit's stderr also holds Lightning's notes), and
    that line names `path` (or a file under it) and the limit."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"mima {command}: error: "), result.stderr[-3000:]
    assert str(path) in errors[0] and "File too large" in errors[0] and "ulimit -f" in errors[0], errors[0]
    return errors[0]


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def temporaries(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.name.endswith(".tmp") or ".tmp." in p.name)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, small_clip) -> Path:
    """A finished run of the small CLIP on two digits tasks (S = 4, N = 2)."""
    folder = tmp_path_factory.mktemp("disk")
    config = fit_config(folder / "run", small_clip, ["rot90", "mirror"], steps=4, iterations=2)
    (folder / "fit.yaml").write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(folder / "fit.yaml")]) == 0
    return folder / "run"


def test_fit(finished_run, tmp_path):
    out = tmp_path / "run"
    result = limited("fit", "--config", finished_run / "config.yaml", "--out", out, limit=20_000)
    the_error_line(result, "fit", out / "pretrained.safetensors")
    assert not (out / "final").exists() and not temporaries(out)
    assert files_under(out) == ["config.yaml"]  # the run's record, from which `--ckpt_path last` starts again


def test_evaluate(finished_run, tmp_path):
    out = tmp_path / "evaluation"
    result = limited("evaluate", finished_run, "--out", out, "--no-select", "--merges", "uniform")
    the_error_line(result, "evaluate", out)
    # the cells are the evaluation's record (a rerun skips them); no results file, plot or temporary file
    assert [name for name in files_under(out) if not name.startswith("cells")] == [] and not temporaries(out)


def test_report(finished_run, tmp_path):
    out = tmp_path / "report"
    the_error_line(limited("report", finished_run, "--out", out), "report", out)
    assert not out.exists() and not temporaries(tmp_path)


def test_analyze(finished_run, tmp_path):
    out = tmp_path / "cosine"
    the_error_line(limited("analyze", "cosine", finished_run, "--out", out), "analyze", out)
    assert not out.exists() and not temporaries(tmp_path)


def test_convert(small_clip, tmp_path):
    source = tmp_path / "visual.pt"
    torch.save(open_clip.create_model(small_clip).visual.state_dict(), source)  # about 100 KB
    output = tmp_path / "out" / "visual.safetensors"
    the_error_line(limited("convert", source, output, "--prefix", ""), "convert", output)
    assert files_under(tmp_path / "out") == []


def test_data_splits(finished_run, tmp_path):
    out = tmp_path / "splits"
    the_error_line(limited("data", "splits", "--config", finished_run / "config.yaml", "--out", out), "data", out)
    assert not out.exists() and not temporaries(tmp_path)


def test_data_cache(finished_run, tmp_path):
    config = yaml.safe_load((finished_run / "config.yaml").read_text())
    cache = tmp_path / "cache"
    config["data"] = {"suite": "offline", "tasks": ["digits"], "batch_size": 8, "seed": 1, "cache": True,
                      "cache_dir": str(cache)}
    (tmp_path / "cache.yaml").write_text(yaml.safe_dump(config))
    the_error_line(limited("data", "cache", "--config", tmp_path / "cache.yaml"), "data", cache)
    assert files_under(cache) == []  # no half-built cache entry a later run could read
