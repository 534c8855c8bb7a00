"""The joint multi-task baseline's callback: theta_0 at the start, final/joint.safetensors at the end.

In `model.mode: joint` there are no phases to synchronise: every step already trains on every task
(MimaModule._joint_step), and with several processes DDP averages the gradients of the combined
batch. What is left of the MIMA callback's work is the run folder's contract: theta_0 as
pretrained.safetensors before the first step, and the trained encoder as the run's one final model
(checked first: weights holding a NaN or inf stop the run instead, mima.training.divergence).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from mima.core.errors import MimaError
from mima.core.names import JOINT
from mima.core.run_folder import RunFolder
from mima.training.divergence import divergence_report, nonfinite_key


class JointFinalCallback(Callback):
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            RunFolder(Path(trainer.default_root_dir)).write_pretrained(pl_module.theta_0)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any,
                           batch_idx: int) -> None:
        plan = pl_module.plan
        if trainer.global_step != plan.total_steps:
            return
        key = nonfinite_key(pl_module.encoder.state_dict())
        if key is not None:  # checked before writing (by every process: DDP gave each the same weights)
            report = divergence_report(JOINT, f"non-finite weights ({key})", trainer.global_step - 1,
                                       trainer.global_rank, trainer.world_size)
            stop = getattr(trainer.strategy, "stop", None)
            if stop is None:  # a plain Trainer: no `mima fit` to report it
                raise MimaError(report)
            stop.diverge(plan.position(trainer.global_step - 1).phase, report)
            trainer.should_stop = True
            return
        if not trainer.is_global_zero:
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
