"""MimaStrategy: Lightning's DDP, made task-parallel.

What plain DDP gets wrong for MIMA, and what this strategy does instead:
  * DDP all-reduces gradients over every process, mixing tasks. Here each task's replicas form
    their own process group and only those are wrapped in DistributedDataParallel; a process
    that is alone with its tasks is not wrapped at all (it has no gradient to share).
  * Lightning saves rank 0's state only, but every process holds different task weights. Here
    every rank writes its own file into a checkpoint directory (see mima.training.checkpointing),
    and each rank loads its own file back.
  * A collective that waits for a dead process would hang; the process-group timeout
    (`timeout_s`) bounds it.
"""

from __future__ import annotations

import os
import shutil
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from mima.training.checkpointing import (
    META,
    PARTIAL,
    rank_file,
    write_atomically,
)
from mima.core.files import write_json_atomic
from mima.core.layout import TaskLayout


class MimaStrategy(DDPStrategy):
    """Task-parallel DDP for MimaModule.

    Args:
        num_tasks: T, the number of tasks of the run (set by `mima fit` from the data config).
        timeout_s: seconds a collective may wait for the other processes before the run fails.
    """

    def __init__(self, num_tasks: int = 1, timeout_s: int = 1800, **kwargs) -> None:
        super().__init__(timeout=timedelta(seconds=timeout_s), **kwargs)
        self.num_tasks = num_tasks
        self.layout: TaskLayout | None = None
        self.task_group = None

    def setup_distributed(self) -> None:
        super().setup_distributed()
        self.layout = TaskLayout(self.num_tasks, self.world_size)
        if self.layout.replicas > 1:
            self.task_group, _ = dist.new_subgroups_by_enumeration(self.layout.task_group_ranks())

    def _setup_model(self, model):
        if self.layout is None or self.layout.replicas == 1:
            return model
        return DistributedDataParallel(
            module=model, device_ids=self.determine_ddp_device_ids(), process_group=self.task_group, **self._ddp_kwargs
        )

    def _register_ddp_hooks(self) -> None:
        # Lightning asserts a DDP-wrapped model on CUDA; a process alone with its tasks is not wrapped
        # (found on an H100: one GPU, W <= T), and has no gradient communication to hook.
        if isinstance(self.model, DistributedDataParallel):
            super()._register_ddp_hooks()

    def teardown(self) -> None:
        super().teardown()
        # mima only fits: release the process group (and its port) so that a later fit in the same
        # Python process, such as the next N of `mima demo`, starts from a clean slate.
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        final = Path(self.broadcast(str(filepath)))
        staging = final.with_name(final.name + PARTIAL)
        if self.is_global_zero:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self.barrier("mima: staging folder ready")
        write_atomically(checkpoint, rank_file(staging, self.global_rank))
        self.barrier("mima: every rank has written")
        if self.is_global_zero:
            meta = {"step": int(checkpoint.get("global_step", 0)), **checkpoint.get("mima", {}).get("run", {})}
            write_json_atomic(staging / META, meta)
            if final.exists():  # the same step saved again: keep the new one
                aside = final.with_name(f"{final.name}.old.{os.getpid()}")
                os.rename(final, aside)
                os.rename(staging, final)
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.rename(staging, final)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        return self.checkpoint_io.load_checkpoint(rank_file(Path(checkpoint_path), self.global_rank), weights_only=weights_only)

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)
