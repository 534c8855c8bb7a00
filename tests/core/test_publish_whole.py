"""A set of result files is replaced as a whole (issue 41, item 2; mima.core.publish.publish_folder): a
failure or a SIGKILL at any rename leaves the earlier set (put back at once, or by the next publish
into the folder after a kill), never new files beside old ones."""

from __future__ import annotations

import os
import signal

import pytest

from mima.core.publish import publish_folder, roll_back_interrupted_publishes, stage_folder
from tests.helpers import FailingReplace

OLD = {"results.json": "old json", "results.md": "old md", "results.csv": "old csv", "plots/a.png": "old png"}
NEW = {"results.json": "new json", "results.md": "new md", "results.csv": "new csv", "plots/a.png": "new png",
       "selection.json": "new only"}
RENAMES = 2 * len(OLD) + (len(NEW) - len(OLD))  # each old file moved aside, each new one placed


def _write(folder, contents) -> None:
    for name, text in contents.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def _contents(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def _staged(target):
    staging, _ = stage_folder(target)
    _write(staging, NEW)
    return staging


@pytest.mark.parametrize("call", range(1, RENAMES + 1))
def test_a_rename_that_fails_leaves_the_earlier_set(tmp_path, monkeypatch, call):
    target = tmp_path / "table"
    _write(target, OLD)
    staging = _staged(target)
    monkeypatch.setattr(os, "replace", FailingReplace(call))
    with pytest.raises(OSError):
        publish_folder(staging, target, overwrite=True)
    monkeypatch.undo()
    assert _contents(target) == OLD  # no journal left, no new file beside the old ones


def test_without_a_fault_the_new_set_is_placed_whole(tmp_path):
    target = tmp_path / "table"
    _write(target, OLD)
    staging = _staged(target)
    publish_folder(staging, target, overwrite=True)
    assert _contents(target) == NEW


@pytest.mark.parametrize("call", range(1, RENAMES + 1))
def test_a_sigkill_at_any_rename_is_rolled_back_by_the_next_publish(tmp_path, capfd, call):
    target = tmp_path / "table"
    _write(target, OLD)
    child = os.fork()
    if child == 0:  # the command (it stages the new set, then publishes), killed at its call-th rename
        staging = _staged(target)
        real, count = os.replace, [0]

        def replace(source, destination):
            count[0] += 1
            if count[0] == call:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(source, destination)
        os.replace = replace
        try:
            publish_folder(staging, target, overwrite=True)
        finally:
            os._exit(0)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    roll_back_interrupted_publishes(target)
    assert _contents(target) == OLD
    assert not list(tmp_path.glob(".table.*.tmp"))  # the killed command's staging folder removed with its journal
    assert "put back the files an interrupted earlier command was replacing" in capfd.readouterr().err
    again = _staged(target)
    publish_folder(again, target, overwrite=True)
    assert _contents(target) == NEW
