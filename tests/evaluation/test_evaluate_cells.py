"""`mima evaluate` as cells: a kill or a stop loses no finished cell and the next run goes on to the
same results; several processes give one process's results exactly; the accuracy from the counts is
torchmetrics'; a validation subset; bad options are one line before any work."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torchmetrics.classification import MulticlassAccuracy

from mima.cli import main
from mima.services.evaluate.dealing import Unit, deal
from mima.evaluation.accuracy import accuracy_of
from mima.evaluation.cells import Cell, CellStore, read_checked_cells
from tests.helpers import cli, run_command

TASKS = ["rot90", "mirror"]
MERGES = ["uniform", "task_arithmetic", "ties"]  # 1 + 21 + 21 merged models per run: long enough to stop


def test_accuracy_from_counts_is_torchmetrics_micro_accuracy():
    generator = torch.Generator().manual_seed(0)
    for total in (1, 7, 1000, 4097):
        logits = torch.randn(total, 10, generator=generator)
        labels = torch.randint(0, 10, (total,), generator=generator)
        metric = MulticlassAccuracy(num_classes=10, average="micro")
        metric.update(logits, labels)
        correct = int((logits.argmax(dim=1) == labels).sum())
        assert accuracy_of(correct, total) == float(metric.compute())


def test_a_cell_line_cut_by_a_kill_is_ignored_and_a_foreign_folder_refused(tmp_path):
    store = CellStore(tmp_path, "s1", 0)
    store.prepare({"runs": {"a": {}}, "merges": ["uniform"], "session": "s1"}, overwrite=False)
    cell = Cell("a", "uniform", "{}", "test", "t")
    store.record(cell, [3, 4])
    with open(store.own_file, "a") as handle:
        handle.write('{"cell": ["a", "uniform", "{}", "test", "u"], "val')  # a write cut short
    assert read_checked_cells(store.own_file, store.fingerprint) == ({cell: (1, [3, 4])}, [])  # the cut line: neither
    again = CellStore(tmp_path, "s2", 0)
    again.prepare({"runs": {"a": {}}, "merges": ["uniform"], "session": "s2"}, overwrite=False)  # the same evaluation
    assert again.load() == 1 and cell in again
    with pytest.raises(Exception, match=r"holds the evaluation of another configuration \(merges: \['uniform'\] vs \['ties'\]\)"):
        again.prepare({"runs": {"a": {}}, "merges": ["ties"]}, overwrite=False)
    again.prepare({"runs": {"a": {}}, "merges": ["ties"]}, overwrite=True)
    assert again.load() == 0


def test_dealing_gives_every_unit_once_largest_first():
    units = [Unit("merge", index, "m", cost=cost) for index, cost in enumerate([5, 1, 9, 3, 3, 7, 2])]
    for world in (1, 2, 3, 7):
        dealt = deal(units, world)
        assert sorted((u for share in dealt for u in share), key=units.index) == units
        loads = [sum(u.cost for u in share) for share in dealt]
        # largest-first greedy: no process exceeds the mean load by more than the largest unit
        assert max(loads) <= sum(loads) / world + max(u.cost for u in units)
        assert all(share == sorted(share, key=units.index) for share in dealt)  # plan order within a process


@pytest.fixture(scope="module")
def reference(two_runs, tmp_path_factory) -> dict:
    """The uninterrupted one-process evaluation."""
    out = tmp_path_factory.mktemp("reference") / "table"
    assert main(["evaluate", *map(str, two_runs), "--out", str(out), "--merges", *MERGES]) == 0
    return {"rows": json.loads((out / "results.json").read_text()), "out": out}


def _command(runs, out, *extra) -> list[str]:
    return [sys.executable, "-m", "mima", "evaluate", *map(str, runs), "--out", str(out), "--merges", *MERGES, *extra]


def _cell_lines(out: Path) -> int:
    return sum(path.read_text().count("\n") for path in (out / "cells").glob("*.jsonl")) if (out / "cells").is_dir() else 0


def _start_and_wait_for_cells(command, out: Path, cells: int) -> subprocess.Popen:
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while _cell_lines(out) < cells:
        assert job.poll() is None, job.communicate()[0][-3000:]
        time.sleep(0.01)
    return job


@pytest.mark.slow
def test_sigkill_then_the_same_command_gives_the_uninterrupted_results(two_runs, reference, tmp_path, capfd):
    out = tmp_path / "table"
    job = _start_and_wait_for_cells(_command(two_runs, out), out, cells=5)
    job.kill()
    job.wait()
    kept = _cell_lines(out)
    total = _cell_lines(reference["out"])
    assert 5 <= kept < total and not (out / "results.json").exists()
    again = cli(_command(two_runs, out)[3:], capfd)  # the same command again, in this process
    assert again.code == 0, again.err[-3000:]
    assert f"{kept} cells already done" in again.out
    assert json.loads((out / "results.json").read_text()) == reference["rows"]
    assert (out / "selection.json").read_text().split('"seconds_total"')[0] == \
        (reference["out"] / "selection.json").read_text().split('"seconds_total"')[0]


@pytest.mark.slow
def test_sigterm_stops_after_the_batch_keeps_the_cells_and_the_rerun_finishes(two_runs, reference, tmp_path, capfd):
    out = tmp_path / "table"
    job = _start_and_wait_for_cells(_command(two_runs, out), out, cells=3)
    job.send_signal(signal.SIGTERM)
    printed, _ = job.communicate(timeout=300)
    assert job.returncode == 128 + signal.SIGTERM, printed[-3000:]
    kept = _cell_lines(out)
    assert f"stopped by signal {int(signal.SIGTERM)}; {kept} finished cells kept" in printed
    again = cli(_command(two_runs, out)[3:], capfd)  # the same command again, in this process
    assert again.code == 0 and f"{kept} cells already done" in again.out, again.err[-3000:]
    assert json.loads((out / "results.json").read_text()) == reference["rows"]


@pytest.mark.slow
def test_two_processes_give_one_process_results_exactly(two_runs, reference, tmp_path):
    out = tmp_path / "table"
    result = run_command(_command(two_runs, out, "--devices", "2")[3:])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es)" in result.stdout
    written = sorted(path.name.rsplit("-p", 1)[1] for path in (out / "cells").glob("*.jsonl"))
    assert written == ["0.jsonl", "1.jsonl"]  # both processes evaluated cells
    assert json.loads((out / "results.json").read_text()) == reference["rows"]


def test_a_validation_subset_is_fixed_and_recorded(two_runs, tmp_path):
    out = tmp_path / "table"
    assert main(["evaluate", str(two_runs[0]), "--out", str(out), "--merges", "task_arithmetic", "--val-examples", "7"]) == 0
    store = CellStore(out, "read", 0)
    store.load()
    val = {cell: value for cell, value in store.values.items() if cell.split == "val"}
    test = {cell: value for cell, value in store.values.items() if cell.split == "test"}
    assert len(val) == 21 * len(TASKS) and all(total == 7 for _, total in val.values())
    assert all(total > 7 for _, total in test.values())  # the test split stays whole
    assert json.loads((out / "selection.json").read_text())["val_examples"] == 7


@pytest.mark.parametrize("argv, fragment", [
    (["--devices", "100000"], "--devices 100000: this machine has"),
    (["--devices", "0"], "--devices 0: expected at least 1 (see mima evaluate --help)"),
    (["--val-examples", "0"], "--val-examples 0: expected a positive number"),
    (["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
])
def test_bad_options_are_one_line_before_any_work(tmp_path, capsys, argv, fragment):
    out = tmp_path / "table"
    assert main(["evaluate", str(tmp_path / "no-run"), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
    assert not out.exists()


def test_runs_that_did_not_finish_are_left_out_and_named(two_runs, tmp_path, capsys):
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.yaml").write_text((two_runs[0] / "config.yaml").read_text())
    out = tmp_path / "table"
    argv = ["evaluate", str(two_runs[0]), str(unfinished), str(tmp_path / "never-started"), "--out", str(out),
            "--merges", "uniform"]
    assert main(argv) == 2  # without the option: refused, naming the first
    assert "not a finished run" in capsys.readouterr().err
    assert main([*argv, "--skip-unfinished"]) == 0
    printed = capsys.readouterr().out
    assert f"left out 2 run(s) that have not finished: {unfinished}: not a finished run; " \
           f"{tmp_path / 'never-started'}: no such run folder" in printed
    rows = json.loads((out / "results.json").read_text())
    assert {row["N"] for row in rows} == {1} and {row["model"] for row in rows} == {"zero_shot", "fine_tuned", "uniform"}
