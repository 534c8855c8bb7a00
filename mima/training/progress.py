"""A progress bar that says where a MIMA run is: phase i/N, the task being trained, its loss."""

from __future__ import annotations

from lightning.pytorch.callbacks import TQDMProgressBar


class MimaProgressBar(TQDMProgressBar):
    def on_train_epoch_start(self, trainer, *args) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description("MIMA")  # one "epoch" is the whole run

    def get_metrics(self, trainer, pl_module) -> dict[str, int | str | float]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        plan = pl_module.plan
        if plan is not None:
            position = plan.position(min(trainer.global_step, plan.local_steps - 1))
            items["phase"] = f"{position.phase + 1}/{plan.iterations}"
            items["task"] = plan.tasks[position.task_index]
        return items
