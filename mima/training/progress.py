"""Progress bars that say where a MIMA run is: phase i/N, the task being trained, its loss.

The loss shown is the last one the host has read (`MimaModule.shown_loss`, set at logging
intervals and segment ends by the sync callback), not one logged with `self.log(prog_bar=True)`:
Lightning's bars convert such values to floats at every step, which makes the host wait for the
device at every step.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar


def mima_metrics(items: dict, trainer, pl_module) -> dict[str, int | str | float]:
    """A bar's items with the phase, task and last read loss of a MIMA run (the version number dropped)."""
    items.pop("v_num", None)
    plan = getattr(pl_module, "plan", None)
    if plan is not None:
        position = plan.position(min(trainer.global_step, plan.local_steps - 1))
        items["phase"] = f"{position.phase + 1}/{plan.iterations}"
        items["task"] = plan.tasks[position.task_index]
    loss = getattr(pl_module, "shown_loss", None)
    if loss is not None:
        items["loss"] = round(loss, 4)
    return items


class MimaProgressBar(TQDMProgressBar):
    def on_train_epoch_start(self, trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description("MIMA")  # one "epoch" is the whole run

    def get_metrics(self, trainer, pl_module) -> dict[str, int | str | float]:
        return mima_metrics(super().get_metrics(trainer, pl_module), trainer, pl_module)


class MimaRichProgressBar(RichProgressBar):
    """Lightning's default bar when `rich` is installed, with MIMA's items."""

    def get_metrics(self, trainer, pl_module) -> dict[str, int | str | float]:
        return mima_metrics(super().get_metrics(trainer, pl_module), trainer, pl_module)
