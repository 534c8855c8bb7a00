"""`mima evaluate` shows process 0's progress over its share of the cells (issue 40): off a terminal one
line at each unit's end (and at most one every 30 s within a unit), counting the cells recorded
before a resume as done; the results files do not change."""

from __future__ import annotations

import io
import itertools
import re
from pathlib import Path

import pytest

from mima.services.evaluate.dealing import deal, plan_units
from mima.services.evaluate.evaluation import data_free_per_model, describe_evaluation
from mima.services.evaluate.progress import CellReporter
from tests.helpers import cli, run_command

TASKS = ["rot90", "mirror"]
MERGES = ["uniform", "task_arithmetic"]
LINE = re.compile(r"^mima evaluate: (\d+)/(\d+) cells of process 0 \((\d+) %\), \d+ s(?:; (next|now): (.+))?$",
                  re.MULTILINE)


def _share(runs: list[Path], world: int, rank: int = 0):
    """Process RANK's units, as dealing plans them (the costs: cells each unit records)."""
    evaluation = describe_evaluation(runs, data_free_per_model(MERGES), True, None, "32-true")
    return deal(plan_units(evaluation), world)[rank]


def _unit_end_lines(err: str) -> list[tuple[int, int, str | None]]:
    """(done, total, next unit) of each line written at a unit's end (not those within a unit)."""
    return [(int(done), int(total), label or None) for done, total, _, kind, label in LINE.findall(err) if kind != "now"]


def _cell_lines(out: Path) -> list[str]:
    return [line for path in sorted((out / "cells").glob("*.jsonl")) for line in path.read_text().splitlines()]


def test_one_line_per_unit_counting_up_to_the_shares_cells_and_a_resume_counts_the_cells_found(two_runs, tmp_path,
                                                                                                 capfd):
    units = _share(two_runs, world=1)
    costs = [unit.cost for unit in units]
    ends = list(itertools.accumulate(costs))  # the cells done after each unit
    names = {"zero_shot": "zero_shot", "fine_tuned": "fine_tuned", "geometry": "pairwise_cos_tau"}
    labels = [f"{unit.method or names[unit.kind]} on {two_runs[unit.run].name}" for unit in units]

    out = tmp_path / "table"
    argv = ["evaluate", *map(str, two_runs), "--out", str(out), "--merges", *MERGES]
    first = cli(argv, capfd)
    assert first.code == 0, first.err[-3000:]
    lines = _unit_end_lines(first.err)
    assert lines == [(end, ends[-1], label) for end, label in zip(ends, [*labels[1:], None])]
    # each unit's cost is the number of cells it records: the total is every cell written
    assert ends[-1] == len(_cell_lines(out)) == 2 + 2 * (2 + 1 + 2 + 2 * (len(_grid_of("task_arithmetic")) + 1))
    counts = [int(done) for done, *_ in LINE.findall(first.err)]
    assert counts == sorted(counts) and counts[-1] == ends[-1]
    results = (out / "results.json").read_bytes()

    # a resumed evaluation: the first 3 cells kept (zero_shot's two and one of N1's fine-tuned models)
    kept = 3
    cell_file, = (out / "cells").glob("*.jsonl")
    cell_file.write_text("".join(line + "\n" for line in cell_file.read_text().splitlines()[:kept]))
    (out / "results.json").unlink()
    again = cli(argv, capfd)
    assert again.code == 0 and f"{kept} cells already done" in again.out, again.err[-3000:]
    # cells are recorded in plan order, so the kept ones are the first units' first cells
    assert _unit_end_lines(again.err) == [(max(end, kept), ends[-1], label) for end, label in zip(ends, [*labels[1:], None])]
    assert (out / "results.json").read_bytes() == results  # the progress changes no results file


def _grid_of(method: str) -> list:
    from mima.services.evaluate.grid_search import grid_points
    from mima.merging import get_method

    return grid_points(get_method(method))


@pytest.mark.slow
def test_with_two_processes_process_0_counts_its_own_share(two_runs, tmp_path):
    share = [unit.cost for unit in _share(two_runs, world=2, rank=0)]
    other = [unit.cost for unit in _share(two_runs, world=2, rank=1)]
    out = tmp_path / "table"
    result = run_command(["evaluate", *map(str, two_runs), "--out", str(out), "--merges", *MERGES, "--devices", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    done = [(count, total) for count, total, _ in _unit_end_lines(result.stderr)]
    assert done == [(end, sum(share)) for end in itertools.accumulate(share)]
    assert sum(share) + sum(other) == len(_cell_lines(out)) and sum(other) > 0


def test_off_a_terminal_a_line_at_each_units_end_and_at_most_one_every_30_s_within_one():
    now = [100.0]
    stream = io.StringIO()
    reporter = CellReporter(total=120, done=5, title="mima evaluate", stream=stream, terminal=False, clock=lambda: now[0])
    reporter.unit("ties on N4")
    for second, done in ((110, 6), (129.9, 7), (130, 8), (140, 9), (159.9, 10)):
        now[0] = second
        reporter.update(done)
    now[0] = 161
    reporter.unit_finished(45, "cart on N4")
    reporter.unit("cart on N4")
    for second, done in ((190, 46), (191, 47), (220, 48)):
        now[0] = second
        reporter.update(done)
    now[0] = 230
    reporter.unit_finished(120, None)
    assert stream.getvalue().splitlines() == [
        "mima evaluate: 8/120 cells of process 0 (6 %), 30 s; now: ties on N4",  # 30 s after the start
        "mima evaluate: 45/120 cells of process 0 (37 %), 61 s; next: cart on N4",  # a unit's end: always
        "mima evaluate: 47/120 cells of process 0 (39 %), 91 s; now: cart on N4",  # 30 s after the last line
        "mima evaluate: 120/120 cells of process 0 (100 %), 130 s",
    ]


def test_on_a_terminal_a_bar_with_the_unit_being_evaluated():
    stream = io.StringIO()
    reporter = CellReporter(total=120, done=5, title="mima evaluate", stream=stream, terminal=True)
    reporter.unit("ties on N4")
    reporter.unit_finished(45, "cart on N4")
    reporter.close()
    shown = stream.getvalue().replace("\r", "\n").splitlines()
    assert any(line.startswith("mima evaluate: 45/120 cells") and "ties on N4" in line for line in shown), shown
    assert not any("of process 0" in line for line in shown)  # no plain lines beside the bar
