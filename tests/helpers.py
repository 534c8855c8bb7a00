"""Fault injection for the distributed tests, loaded into `mima fit` subprocesses by class path.

The test starts each job in its own process group, so killing the group kills every process of
the job at once, as a node failure or `scancel` would.
"""

from __future__ import annotations

import os
import signal

from lightning.pytorch.callbacks import Callback

from mima.training.strategy import MimaStrategy


class KillAtStep(Callback):
    """SIGKILL at the end of optimiser step `step` (before MIMA's sync and the checkpoint of that step
    run): the whole job (`group=True`) or only this rank's process."""

    def __init__(self, step: int, rank: int = 0, group: bool = True) -> None:
        self.step, self.rank, self.group = step, rank, group

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            if self.group:
                os.killpg(os.getpgrp(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


class SignalAtStep(Callback):
    """Send `signum` to this rank's own process at step `step`, as SLURM's warning signal would."""

    def __init__(self, step: int, rank: int = 0, signum: int = int(signal.SIGUSR1)) -> None:
        self.step, self.rank, self.signum = step, rank, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)


class CrashingStrategy(MimaStrategy):
    """Kills the whole job in the middle of its `crash_on_save`-th checkpoint save, after the rank
    files are written and before the checkpoint is made complete."""

    def __init__(self, crash_on_save: int = 2, **kwargs) -> None:
        super().__init__(**kwargs)
        self.crash_on_save, self.saves = crash_on_save, 0

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        self.saves += 1
        if self.saves == self.crash_on_save:
            from mima.training.checkpointing import PARTIAL, rank_file, write_atomically

            staging = str(filepath) + PARTIAL
            os.makedirs(staging, exist_ok=True)
            write_atomically(checkpoint, rank_file(staging, self.global_rank))
            self.barrier()
            os.killpg(os.getpgrp(), signal.SIGKILL)
        super().save_checkpoint(checkpoint, filepath, storage_options)
