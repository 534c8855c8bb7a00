"""Issue 40, item 4: every record mima reads back is checked before it is used.

- Evaluation cells (mima.evaluation.cells): a cell of a real small evaluation edited on disk (a count
  larger than its images, a negative or non-numeric count, a cosine outside [-1, 1], a plausible count
  that no longer matches the cell's check digest, or a forged digest with a split size the other cells
  contradict) is left out with one line naming its file and why, evaluated again, and the results
  equal those of the untampered evaluation: never an accuracy outside [0, 1]. On the old code these
  were published (accuracy 10.0, -0.1, mean cos 5.0) or ended in a TypeError traceback.
- A run lock (mima.core.run_lock) whose pid is no process id (2^70 gave an OverflowError traceback;
  0, -1 and true named live process groups, so the lock was never taken over) is stale: taken over
  with one line naming the file.
- metrics.jsonl: a line that is JSON but not a phase record is refused in one line naming the file
  and the line, by every command that reads it, before any work (`mima evaluate` plotted strings).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

from mima.core.errors import MimaError
from mima.core.run_lock import RunLock
from mima.core.safetensors_io import load_state_dict, save_state_dict
from mima.evaluation.cells import Cell, CellStore, cell_check, manifest_fingerprint
from tests.helpers import assert_one_line, cli, copy_run

TASKS = ["rot90", "mirror"]


@pytest.fixture(scope="module")
def run(two_runs) -> Path:
    """The shared N = 1 run (tests/conftest.py)."""
    return two_runs[0]


def _evaluate_argv(run: Path, out: Path) -> list[str]:
    return ["evaluate", str(run), "--out", str(out), "--merges", "uniform"]


@pytest.fixture(scope="module")
def untampered(run, tmp_path_factory) -> dict:
    """An untampered evaluation: its folder (cells and results) and its results rows."""
    from mima.cli import main

    out = tmp_path_factory.mktemp("untampered") / "table"
    assert main(_evaluate_argv(run, out)) == 0
    return {"out": out, "rows": json.loads((out / "results.json").read_text())}


def _accuracies(rows: list[dict]) -> list[float]:
    return [row["accuracy"] for row in rows]


def _tamper(out: Path, model: str, task: str, edit) -> Path:
    """Replace the line of the cell (model, "test" or "-", task) by edit(entry, its manifest);
    returns its file."""
    manifest = json.loads((out / "cells.json").read_text())
    for path in sorted((out / "cells").glob("*.jsonl")):
        lines = path.read_text().splitlines(keepends=True)
        for index, line in enumerate(lines):
            entry = json.loads(line)
            _, cell_model, _, split, cell_task = entry["cell"]
            if cell_model == model and cell_task == task and split in ("test", "-"):
                lines[index] = json.dumps(edit(entry, manifest)) + "\n"
                path.write_text("".join(lines))
                return path
    raise AssertionError(f"no cell of {model} on {task}")


def _value(value):
    """An edit that puts `value` in place of the recorded one, the check digest left as it was."""
    return lambda entry, manifest: {**entry, "value": value}


def _no_correct_image(entry: dict, manifest: dict) -> dict:
    """A plausible edit: none correct of the same images (the check digest left as it was)."""
    return {**entry, "value": [0, entry["value"][1]]}


def _no_correct_image_nor_digest(entry: dict, manifest: dict) -> dict:
    return {"cell": entry["cell"], "value": [0, entry["value"][1]]}


def _forged_one_more_image(entry: dict, manifest: dict) -> dict:
    """One image more, with the check digest recomputed as mima computes it."""
    value = [entry["value"][0], entry["value"][1] + 1]
    return {"cell": entry["cell"], "value": value, "check": cell_check(manifest_fingerprint(manifest), entry["cell"], value)}


CELL_CASES = {
    # (model, task, edit, what the line says)
    "more-correct-than-images": ("uniform", "rot90", _value([5390, 539]), "5390 correct of 539 images"),
    "negative-count": ("zero_shot", "mirror", _value([-54, 539]), "-54 correct of 539 images"),
    "non-numeric-count": ("fine_tuned", "rot90", _value(["many", 539]),
                          'its value ["many", 539] is not two whole numbers (correct, total)'),
    "fractional-count": ("uniform", "mirror", _value([1.5, 539]),
                         "its value [1.5, 539] is not two whole numbers (correct, total)"),
    "cosine-above-one": ("pairwise_cos_tau", "-", _value({"pairs": [5.0], "mean": 5.0}),
                         "its pairwise cosines [5.0] are not all numbers in [-1, 1]"),
    "plausible-edit": ("uniform", "rot90", _no_correct_image,
                       "its check digest does not match its content (edited, or from another evaluation)"),
    "digest-removed": ("fine_tuned", "mirror", _no_correct_image_nor_digest, "no check digest (written by an earlier mima)"),
    "forged-digest-other-split-size": ("zero_shot", "rot90", _forged_one_more_image, "where the other cells count"),
}


@pytest.mark.parametrize("case", list(CELL_CASES))
def test_a_tampered_cell_is_named_evaluated_again_and_never_published(run, untampered, tmp_path, capfd, case):
    model, task, edit, says = CELL_CASES[case]
    out = tmp_path / "table"
    shutil.copytree(untampered["out"], out)
    tampered = _tamper(out, model, task, edit)
    again = cli(_evaluate_argv(run, out), capfd)
    assert again.code == 0 and "Traceback" not in again.err, again.err[-3000:]
    rows = json.loads((out / "results.json").read_text())
    assert all(0.0 <= accuracy <= 1.0 for accuracy in _accuracies(rows))
    assert rows == untampered["rows"]  # the cell evaluated again: the untampered results exactly
    named = [line for line in again.out.splitlines() if "is not a valid cell" in line]
    assert len(named) == 1, again.out
    assert str(tampered) in named[0] and says in named[0] and "evaluated again" in named[0], named[0]


def test_untampered_cells_are_all_used_and_nothing_is_named(run, untampered, tmp_path, capfd):
    out = tmp_path / "table"
    shutil.copytree(untampered["out"], out)
    cells = sum(path.read_text().count("\n") for path in (out / "cells").glob("*.jsonl"))
    again = cli(_evaluate_argv(run, out), capfd)
    assert again.code == 0, again.err[-3000:]
    assert f"{cells} cells already done" in again.out and "not a valid cell" not in again.out
    assert sum(path.read_text().count("\n") for path in (out / "cells").glob("*.jsonl")) == cells  # none evaluated again
    assert json.loads((out / "results.json").read_text()) == untampered["rows"]
    assert (out / "results.md").read_text() == (untampered["out"] / "results.md").read_text()


def test_a_cell_file_from_another_evaluation_is_left_out(tmp_path):
    """The check digest binds a cell to the manifest it was recorded under: a file copied from an
    evaluation of the same runs in another precision does not count here."""
    cell = Cell("runs/N1", "uniform", "{}", "test", "rot90")
    other = CellStore(tmp_path / "bf16", "s1", 0)
    other.prepare({"runs": {"runs/N1": {}}, "precision": "bf16-mixed", "session": "s1"}, overwrite=False)
    other.record(cell, [40, 50])
    here = CellStore(tmp_path / "fp32", "s2", 0)
    here.prepare({"runs": {"runs/N1": {}}, "precision": "32-true", "session": "s2"}, overwrite=False)
    shutil.copy(other.own_file, here.cells_dir / other.own_file.name)
    assert here.load() == 0 and cell not in here
    assert here.rejected == [f"{here.cells_dir / other.own_file.name}: line 1 is not a valid cell: its check digest does "
                             "not match its content (edited, or from another evaluation); left out, its cell is evaluated again"]
    assert other.load() == 1 and other.get(cell) == [40, 50]  # where it was recorded, it counts


def test_a_cell_that_stays_bad_is_refused_in_one_line_never_published(tmp_path):
    """Cells of one (split, task) count one set of images: one with another size is left out, and
    asking for it (building the results) is one line, not a KeyError."""
    store = CellStore(tmp_path, "s1", 0)
    store.prepare({"runs": {"r": {}}, "session": "s1"}, overwrite=False)
    for model in ("zero_shot", "fine_tuned"):
        store.record(Cell("r", model, "{}", "test", "rot90"), [7, 539])
    odd = Cell("r", "uniform", "{}", "test", "rot90")
    store.record(odd, [7, 540])
    assert store.load() == 2 and odd not in store
    assert store.rejected == [f"{store.own_file}: line 3 is not a valid cell: 540 images of (test, rot90), where the "
                              "other cells count 539; left out, its cell is evaluated again"]
    with pytest.raises(MimaError) as refused:
        store.get(odd)
    assert "\n" not in str(refused.value) and "no valid result for ['r', 'uniform', '{}', 'test', 'rot90']" in str(refused.value)


# ------------------------------------------------------------------------------------------ run locks
@pytest.mark.parametrize("pid", [2**70, 0, -1, True], ids=["2^70", "zero", "minus-one", "true"])
def test_a_lock_whose_pid_is_no_process_id_is_stale_and_named(tmp_path, capfd, pid):
    folder = tmp_path / "run"
    folder.mkdir()
    lock = folder / "LOCK"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "process_start": "1",
                                "command": "mima fit", "started": "2026-01-01T00:00:00", "token": "edited"}))
    capfd.readouterr()
    with RunLock(folder, "mima report"):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"took over the lock {lock}" in err[0] and f"its pid {json.dumps(pid)} is not a process id" in err[0], err


def test_mima_evaluate_takes_over_a_lock_with_an_absurd_pid(run, untampered, tmp_path, capfd):
    out = tmp_path / "table"
    shutil.copytree(untampered["out"], out)
    (out / "LOCK").write_text(json.dumps({"host": socket.gethostname(), "pid": 2**70, "token": "x"}))
    again = cli(_evaluate_argv(run, out), capfd)
    assert again.code == 0 and "Traceback" not in again.err, again.err[-3000:]
    lines = [line for line in again.err.strip().splitlines() if " cells of process 0 " not in line]  # not progress
    assert len(lines) == 1 and f"took over the lock {out / 'LOCK'}" in lines[0], lines
    assert json.loads((out / "results.json").read_text()) == untampered["rows"] and not (out / "LOCK").exists()


# ------------------------------------------------------------------------------------------ metrics.jsonl
def _damage_metrics(run: Path, target: Path, change) -> Path:
    copy = copy_run(run, target)
    records = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    change(records[-1])
    (copy / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return copy


METRICS_CASES = {
    "text-step": (lambda record: record.update(step="late"), "has no whole-number 'step' (found \"late\")"),
    "missing-mean-cos-tau": (lambda record: record.pop("mean_cos_tau"), "has no number 'mean_cos_tau' (found null)"),
    "cos-tau-not-a-matrix": (lambda record: record.update(cos_tau="[[1]]"), "has no 2 x 2 matrix of numbers 'cos_tau'"),
    "loss-not-numbers": (lambda record: record.update(loss={"rot90": "low"}), "has no numbers per task in 'loss'"),
}
METRICS_COMMANDS = {
    "evaluate": lambda run, out: _evaluate_argv(run, out),
    "report": lambda run, out: ["report", str(run), "--out", str(out)],
    "analyze-cosine": lambda run, out: ["analyze", "cosine", str(run), "--out", str(out)],
}


@pytest.mark.parametrize("command", list(METRICS_COMMANDS))
@pytest.mark.parametrize("case", list(METRICS_CASES))
def test_a_malformed_metrics_line_is_refused_naming_file_and_line(run, tmp_path, capfd, case, command):
    change, says = METRICS_CASES[case]
    damaged = _damage_metrics(run, tmp_path / "run", change)
    out = tmp_path / "out"
    refused = cli(METRICS_COMMANDS[command](damaged, out), capfd)
    assert_one_line(refused.code, refused.err, f"{damaged / 'metrics.jsonl'}: line 1 ", says)
    assert not (out / "results.json").exists()  # refused before any work


@pytest.mark.parametrize("damage", ["truncated", "binary", "deep"])
def test_a_damaged_manifest_keeps_the_finished_cells_and_names_the_file(run, untampered, tmp_path, capfd, damage):
    """A damaged cells.json is not "the evaluation of other runs" (whose fix, --overwrite, would discard
    every finished cell): it is written again, and the cells whose digests match it are all used."""
    out = tmp_path / "table"
    shutil.copytree(untampered["out"], out)
    manifest = out / "cells.json"
    manifest.write_bytes({"truncated": manifest.read_bytes()[:40], "binary": bytes(range(256)),
                          "deep": b"[" * 100_000 + b"]" * 100_000}[damage])
    cells = sum(path.read_text().count("\n") for path in (out / "cells").glob("*.jsonl"))
    again = cli(_evaluate_argv(run, out), capfd)
    assert again.code == 0, again.err[-3000:]
    assert f"{manifest} was damaged; written again for this evaluation" in again.err
    assert f"{cells} cells already done" in again.out  # none evaluated again
    assert sum(path.read_text().count("\n") for path in (out / "cells").glob("*.jsonl")) == cells
    assert json.loads((out / "results.json").read_text()) == untampered["rows"]


def test_evaluating_a_run_with_nan_weights_is_one_line_naming_the_file(run, tmp_path, capfd):
    """A run's model holding NaN (mima fit never writes one: the file was edited) is refused when it is first
    read, naming the file, and nothing is published; the line suggests no flag `mima evaluate` lacks."""
    copy = tmp_path / "N1"
    shutil.copytree(run, copy)
    damaged = copy / "final" / "mirror.safetensors"
    weights = load_state_dict(damaged)
    key = next(iter(weights))
    weights[key] = torch.full_like(weights[key], float("nan"))
    save_state_dict(damaged, weights)
    out = tmp_path / "table"
    result = cli(_evaluate_argv(copy, out), capfd)
    errors = "\n".join(line for line in result.err.splitlines() if " cells of process 0 " not in line)  # not progress
    assert_one_line(result.code, errors, f"{damaged}: tensor '{key}' holds NaN or Inf values, which mima fit never writes")
    assert "--allow-non-finite" not in result.err
    assert not (out / "results.json").exists()
