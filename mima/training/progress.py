"""Progress bars that say where a MIMA run is: phase i/N, the task being trained, its loss.

The loss shown is the newest one the host has read (`PhaseView.shown_loss`, set by the sync
callback at logging intervals and segment ends), not one logged with `self.log(prog_bar=True)`:
Lightning's bars convert such values to floats at every step, which makes the host wait for the
device at every step. A bar is given the sync callback's view of the phase state when it is made
(MimaSyncCallback.phase_view, mima.training.phase_view) and comes after that callback, so that a
line shows the loss the sync's same hook has just read (checked in `setup`); without a view (the
joint baseline, which has no phases) it shows no loss.

When the output is not a terminal (a SLURM log file, a pipe), a bar's redrawing leaves fragments and
control characters; `MimaLogLines` writes plain lines instead: one at every task segment's end and at
most one per `interval_s` in between.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from typing_extensions import override

from mima.training.phase_view import PhaseView


def mima_metrics(items: dict[str, int | str | float], trainer: pl.Trainer, pl_module: pl.LightningModule,
                 phases: PhaseView | None) -> dict[str, int | str | float]:
    """A bar's items with the phase, task and last read loss of a MIMA run (the version number dropped)."""
    items.pop("v_num", None)
    plan = getattr(pl_module, "plan", None)  # MimaModule's, once set up
    if plan is not None:
        positions = plan.positions(min(trainer.global_step, plan.local_steps - 1))
        items["phase"] = f"{positions[0].phase + 1}/{plan.iterations}"
        items["task"] = _task_names(plan, positions)
    loss = phases.shown_loss if phases is not None else None
    if loss is not None:
        items["loss"] = round(loss, 4)
    return items


class MimaProgressBar(TQDMProgressBar):
    """Lightning's default bar with MIMA's items; `phases`: where the loss shown is read."""

    def __init__(self, phases: PhaseView | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.phases = phases

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        check_after_sync(self.phases, trainer, self)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description("MIMA")  # one "epoch" is the whole run

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, int | str | float]:
        return mima_metrics(super().get_metrics(trainer, pl_module), trainer, pl_module, self.phases)


class MimaRichProgressBar(RichProgressBar):
    """Lightning's default bar when `rich` is installed, with MIMA's items (see MimaProgressBar)."""

    def __init__(self, phases: PhaseView | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.phases = phases

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        check_after_sync(self.phases, trainer, self)

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, int | str | float]:
        return mima_metrics(super().get_metrics(trainer, pl_module), trainer, pl_module, self.phases)


class MimaLogLines(ProgressBar):
    """Progress as plain lines, for output that is not a terminal: process 0 writes one line at each
    of its task segments' end and at most one per `interval_s` seconds in between, e.g.
    `mima fit: phase 2/4, rot90 80/80 steps; process step 160/320 (50 %), loss 0.412, 41.3 steps/s`.
    `phases`: where the loss shown is read (None: no loss, the joint baseline); `clock` and
    `stream` are replaceable for tests."""

    def __init__(self, phases: PhaseView | None = None, interval_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, stream: TextIO | None = None) -> None:
        super().__init__()
        self.phases, self.interval_s, self.clock, self.stream = phases, interval_s, clock, stream
        self.enabled = True
        self.started_at = self.last_line_at = 0.0
        self.started_step = self.shown_step = 0

    @override
    def disable(self) -> None:
        self.enabled = False

    @override
    def enable(self) -> None:
        self.enabled = True

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        check_after_sync(self.phases, trainer, self)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started_at = self.last_line_at = self.clock()
        self.started_step = self.shown_step = trainer.global_step  # a resumed run starts past 0

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step  # optimiser steps done (a batch of an accumulation does not count)
        plan = getattr(pl_module, "plan", None)
        if not self.enabled or step == self.shown_step or step <= 0:
            return
        now = self.clock()
        segment_end = plan is not None and (step >= plan.local_steps or _segment(plan, step) != _segment(plan, step - 1))
        if segment_end or now - self.last_line_at >= self.interval_s:
            self.shown_step, self.last_line_at = step, now
            print(self.line(trainer, pl_module, step, now), file=self.stream or sys.stdout, flush=True)

    def line(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, now: float) -> str:
        """Where the process is after `step` optimiser steps, its newest loss and its rate since the start."""
        plan = getattr(pl_module, "plan", None)
        total = plan.local_steps if plan is not None else trainer.estimated_stepping_batches
        where = ""
        if plan is not None:
            positions = plan.positions(min(step, plan.local_steps) - 1)
            position = positions[0]
            where = (f"phase {position.phase + 1}/{plan.iterations}, {_task_names(plan, positions)} "
                     f"{position.step_in_phase + 1}/{position.phase_length} steps; ")
        facts = [f"process step {step}/{total} ({100 * step / total:.0f} %)"]
        loss = self.phases.shown_loss if self.phases is not None else None
        if loss is not None:
            facts.append(f"loss {loss:.4g}")
        elapsed = now - self.started_at
        if elapsed > 0:
            facts.append(f"{(step - self.started_step) / elapsed:.1f} steps/s")
        return f"mima fit: {where}{', '.join(facts)}"


def check_after_sync(phases: PhaseView | None, trainer: pl.Trainer, bar: ProgressBar) -> None:
    """Refuse a bar that comes before the sync callback whose loss it shows (PhaseView.check_order)."""
    if phases is not None:
        phases.check_order(trainer.callbacks, bar)


def _segment(plan, step: int) -> tuple[int, int]:
    position = plan.positions(step)[0]  # batched: one segment per phase
    return position.phase, position.slot


def _task_names(plan, positions) -> str:
    """The task (or, batched, the tasks) a step trains."""
    return "+".join(plan.tasks[position.task_index] for position in positions)
