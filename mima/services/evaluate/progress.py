"""Process 0's progress over its share of the cells: on a terminal a bar ("mima evaluate: 45/120 cells",
the unit being evaluated beside it); elsewhere (a SLURM log) one line at each unit's end and at most one
every 30 s in between:

    mima evaluate: 45/120 cells of process 0 (37 %), 83 s; next: ties on N4

The share is the process's units (dealing); a unit's cost is the number of cells it records. Cells
recorded before (a resumed evaluation) count as done from the start. The other processes report
nothing: their shares are about as large (dealt by cost) and process 0 prints for the team.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from mima.services.evaluate.dealing import Unit
from mima.services.evaluate.evaluation import Evaluation
from mima.core.names import JOINT
from mima.evaluation.cells import GEOMETRY, Cell, CellStore

LINE_INTERVAL = 30.0  # seconds: at most one line this often within a unit (off a terminal)


class ObservedCellStore(CellStore):
    """A CellStore that calls `on_record` after each cell it records (the worker records them; the
    progress counts them)."""

    on_record: Callable[[], None] | None = None

    def record(self, cell: Cell, value: object) -> None:
        super().record(cell, value)
        if self.on_record is not None:
            self.on_record()


class CellReporter:
    """Shows DONE of TOTAL cells of process RANK: a tqdm bar when `terminal`, otherwise plain lines on
    STREAM (`unit_finished` always writes one, `update` only when `interval` seconds of `clock` have
    passed since the last line)."""

    def __init__(self, total: int, done: int, title: str, rank: int = 0, stream: TextIO | None = None,
                 terminal: bool | None = None, clock: Callable[[], float] = time.monotonic,
                 interval: float = LINE_INTERVAL) -> None:
        self.total, self.done, self.title, self.rank = total, done, title, rank
        self.stream = stream if stream is not None else sys.stderr
        self.clock, self.interval = clock, interval
        self.started = self.last_line = clock()
        self.label = ""  # the unit being evaluated
        self.bar = None
        if self.stream.isatty() if terminal is None else terminal:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=done, desc=title, file=self.stream, mininterval=1.0, dynamic_ncols=True,
                            bar_format="{desc}: {n_fmt}/{total_fmt} cells |{bar}| {percentage:3.0f}% "
                                       "[{elapsed}<{remaining}]{postfix}")

    def unit(self, label: str) -> None:
        """LABEL (a unit's model and run) is evaluated now."""
        self.label = label
        if self.bar is not None:
            self.bar.set_postfix_str(label)

    def update(self, done: int) -> None:
        self.move_to(done)
        if self.bar is None and self.clock() - self.last_line >= self.interval:
            self.write_line(f"now: {self.label}")

    def unit_finished(self, done: int, next_label: str | None) -> None:
        self.move_to(done)
        if self.bar is None:
            self.write_line(f"next: {next_label}" if next_label else None)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def move_to(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(done - self.done)
        self.done = done

    def write_line(self, then: str | None) -> None:
        now = self.clock()
        percent = 100 * self.done // self.total if self.total else 100
        line = (f"{self.title}: {self.done}/{self.total} cells of process {self.rank} ({percent} %), "
                f"{now - self.started:.0f} s" + (f"; {then}" if then else ""))
        print(line, file=self.stream, flush=True)
        self.last_line = now


class ShareProgress:
    """The count of done cells of a process's UNITS, evaluated in order, told to REPORTER (None: this
    process reports nothing). `start(i)` and `finish(i)` frame unit i; `recorded` counts one cell."""

    def __init__(self, units: Sequence[Unit], labels: Sequence[str], done_before: Sequence[int],
                 reporter: CellReporter | None) -> None:
        self.units, self.labels, self.reporter = list(units), list(labels), reporter
        self.done_before = [min(unit.cost, done) for unit, done in zip(units, done_before)]  # per unit
        self.current, self.recorded_in_unit = -1, 0

    @property
    def total(self) -> int:
        return sum(unit.cost for unit in self.units)

    @property
    def done(self) -> int:
        """The finished units' cells, the current one's recorded or found, the later ones' found."""
        index = self.current
        finished = sum(unit.cost for unit in self.units[:max(index, 0)])
        current = min(self.units[index].cost, self.done_before[index] + self.recorded_in_unit) if index >= 0 else 0
        return finished + current + sum(self.done_before[index + 1:])

    def start(self, index: int) -> None:
        self.current, self.recorded_in_unit = index, 0
        if self.reporter is not None:
            self.reporter.unit(self.labels[index])

    def recorded(self) -> None:
        self.recorded_in_unit += 1
        if self.reporter is not None:
            self.reporter.update(self.done)

    def finish(self, index: int) -> None:
        """Unit INDEX has every cell (the worker records each missing one before it returns)."""
        self.current, self.recorded_in_unit = index, self.units[index].cost
        if self.reporter is not None:
            self.reporter.unit_finished(self.done, self.labels[index + 1] if index + 1 < len(self.labels) else None)

    def close(self) -> None:
        if self.reporter is not None:
            self.reporter.close()


def share_progress(evaluation: Evaluation, units: Sequence[Unit], store: CellStore, title: str,
                   rank: int) -> ShareProgress:
    """The progress of UNITS, process RANK's share; the cells in STORE (loaded) count as done. Only
    process 0 reports."""
    found = Counter((cell.run, cell.model) for cell in store.values)
    done_before = [found[unit_cells(evaluation, unit)] for unit in units]
    labels = [unit_label(evaluation, unit) for unit in units]
    progress = ShareProgress(units, labels, done_before, None)
    if rank == 0:
        progress.reporter = CellReporter(progress.total, progress.done, title, rank)
    return progress


def unit_cells(evaluation: Evaluation, unit: Unit) -> tuple[str, str]:
    """(run, model) of every cell the unit records, as mima.services.evaluate.worker names them (one
    unit per run and model: no other unit records cells of that pair)."""
    if unit.kind == JOINT:
        return evaluation.run_id(evaluation.joint), JOINT
    model = {"geometry": GEOMETRY, "merge": unit.method}.get(unit.kind, unit.kind)  # zero_shot, fine_tuned
    return evaluation.run_id(evaluation.runs[unit.run]), model


def unit_label(evaluation: Evaluation, unit: Unit) -> str:
    """The unit's model and run folder, e.g. "ties on N4"."""
    run, model = unit_cells(evaluation, unit)
    return f"{model} on {Path(run).name}"
