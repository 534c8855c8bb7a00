"""The joint multi-task baseline's callback: theta_0 at the start, final/joint.safetensors at the end.

In `model.mode: joint` there are no phases to synchronise: every step already trains on every task
(MimaModule._joint_step), and with several processes DDP averages the gradients of the combined
batch. What is left of the MIMA callback's work is the run folder's contract: theta_0 as
pretrained.safetensors before the first step, and the trained encoder as the run's one final model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from mima.core.run_folder import JOINT, RunFolder


class JointFinalCallback(Callback):
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            RunFolder(Path(trainer.default_root_dir)).write_pretrained(pl_module.theta_0)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any,
                           batch_idx: int) -> None:
        plan = pl_module.plan
        if trainer.global_step != plan.total_steps or not trainer.is_global_zero:
            return  # every process holds the same weights (DDP); one writes them
        tasks = pl_module.tasks
        metadata = {
            "task": JOINT,
            "mode": JOINT,
            "S": plan.total_steps,
            "seed": tasks.seed,
            "tasks": tasks.task_names,
            "world_size": pl_module.layout.world_size,
            "config": {"model": dict(pl_module.hparams), "data": tasks.settings},
        }
        weights = {key: value.detach().to("cpu") for key, value in pl_module.encoder.state_dict().items()}
        RunFolder(Path(trainer.default_root_dir)).write_final(JOINT, weights, metadata)
