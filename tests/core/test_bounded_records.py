"""Records read with bounds (issue 41, item 7): JSON nested 100,000 deep, in any file mima reads back
(final/*.json, metrics.jsonl, a run lock, an open_clip folder's config), is one line naming the file,
never a RecursionError; a lock file of megabytes is read as an unknown holder from its first bytes."""

from __future__ import annotations

import os

import pytest

from mima.core.errors import MimaError
from mima.core.bounded_json import read_json, read_json_lines
from mima.core.run_lock import LOCK_READ_BYTES, RunLock
from mima.evaluation.cells import read_checked_cells
from mima.models.footprint import model_config
from tests.helpers import reads_at_most

DEEP = "[" * 100_000 + "]" * 100_000


def test_deep_json_in_a_record_file_is_one_line(tmp_path):
    (tmp_path / "rot90.json").write_text(DEEP)
    with pytest.raises(MimaError, match=r"rot90.json: not valid JSON \(nested too deeply"):
        read_json(tmp_path / "rot90.json")
    (tmp_path / "metrics.jsonl").write_text('{"phase": 1}\n' + DEEP + "\n")
    with pytest.raises(MimaError, match=r"metrics.jsonl: line 2 is not valid JSON \(nested too deeply"):
        read_json_lines(tmp_path / "metrics.jsonl")


def test_a_deep_open_clip_config_is_one_line(tmp_path):
    (tmp_path / "open_clip_config.json").write_text('{"model_cfg": ' + DEEP + "}")
    with pytest.raises(MimaError, match="open_clip_config.json: not valid JSON"):
        model_config(f"local-dir:{tmp_path}")


def test_a_lock_of_deep_json_or_megabytes_reads_as_an_unknown_holder(tmp_path):
    lock = RunLock(tmp_path, "test")
    lock.path.write_text(DEEP)
    assert lock.holder()["unreadable"] is True
    lock.path.write_bytes(b"{" + b" " * (8 * LOCK_READ_BYTES))
    with reads_at_most(2 * LOCK_READ_BYTES):  # its first bytes, not the 8 x LOCK_READ_BYTES of the file
        assert lock.holder()["unreadable"] is True
    assert os.path.getsize(lock.path) > LOCK_READ_BYTES


def test_a_deep_cell_line_is_a_rejected_line_not_a_crash(tmp_path):
    path = tmp_path / "cells.jsonl"
    path.write_text('{"a": 1}\n' + DEEP + "\n")
    cells, problems = read_checked_cells(path, "0" * 16)
    assert cells == {} and [number for number, _ in problems] == [1, 2]


def test_a_fer2013_csv_with_a_huge_field_is_one_line(tmp_path):
    """A csv field beyond the csv module's limit (131,072 bytes), or any damage torchvision's reader
    finds, is one line naming the folder, not a csv or torchvision traceback."""
    from mima.data.clip_tasks import _read_fer

    (tmp_path / "fer2013").mkdir()
    (tmp_path / "fer2013" / "fer2013.csv").write_text("emotion,pixels,Usage\n0," + "7" * 200_000 + ",Training\n")
    with pytest.raises(MimaError, match=f"FER2013: the csv files under {tmp_path / 'fer2013'} cannot be read"):
        _read_fer(tmp_path, None, False)
