"""Progress bars that say where a MIMA run is: phase i/N, the task being trained, its loss.

The loss shown is the newest one the host has read (`PhaseState.shown_loss`, set by the sync
callback at logging intervals and segment ends), not one logged with `self.log(prog_bar=True)`:
Lightning's bars convert such values to floats at every step, which makes the host wait for the
device at every step. A bar is given the process's PhaseState when it is made; without one (the
joint baseline, which has no phases) it shows no loss.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from typing_extensions import override

from mima.training.phase_state import PhaseState


def mima_metrics(items: dict[str, int | str | float], trainer: pl.Trainer, pl_module: pl.LightningModule,
                 phase_state: PhaseState | None) -> dict[str, int | str | float]:
    """A bar's items with the phase, task and last read loss of a MIMA run (the version number dropped)."""
    items.pop("v_num", None)
    plan = getattr(pl_module, "plan", None)  # MimaModule's, once set up
    if plan is not None:
        position = plan.position(min(trainer.global_step, plan.local_steps - 1))
        items["phase"] = f"{position.phase + 1}/{plan.iterations}"
        items["task"] = plan.tasks[position.task_index]
    loss = phase_state.shown_loss if phase_state is not None else None
    if loss is not None:
        items["loss"] = round(loss, 4)
    return items


class MimaProgressBar(TQDMProgressBar):
    """Lightning's default bar with MIMA's items; `phase_state`: where the loss shown is read."""

    def __init__(self, phase_state: PhaseState | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.phase_state = phase_state

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description("MIMA")  # one "epoch" is the whole run

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, int | str | float]:
        return mima_metrics(super().get_metrics(trainer, pl_module), trainer, pl_module, self.phase_state)


class MimaRichProgressBar(RichProgressBar):
    """Lightning's default bar when `rich` is installed, with MIMA's items (see MimaProgressBar)."""

    def __init__(self, phase_state: PhaseState | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.phase_state = phase_state

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, int | str | float]:
        return mima_metrics(super().get_metrics(trainer, pl_module), trainer, pl_module, self.phase_state)
