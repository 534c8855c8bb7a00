"""Fault injection for the distributed tests, loaded into `mima fit` subprocesses by class path.

The test starts each job in its own process group, so killing the group kills every process of
the job at once, as a node failure or `scancel` would.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback


class KillAtStep(Callback):
    """SIGKILL at the end of optimiser step `step` (before MIMA's sync and the checkpoint of that step
    run): the whole job (`group=True`) or only this rank's process.

    Checkpoints are written in the background, so a kill one step after a save would race the
    writer. With `group=True` every rank therefore first waits, at its own step `step`, until its
    earlier saves are on disk and says so with a file; the killing rank waits for all of them. (Ranks
    are not in lockstep between syncs, but each reaches step `step` before the next sync.)"""

    def __init__(self, step: int, rank: int = 0, group: bool = True) -> None:
        self.step, self.rank, self.group = step, rank, group

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        if self.group:
            checkpoint = trainer.checkpoint_callback
            if checkpoint is not None and getattr(checkpoint, "writer", None) is not None:
                checkpoint.writer.flush()
            settled = Path(trainer.default_root_dir) / f".settled-{trainer.global_rank}"
            settled.touch()
        if trainer.global_rank != self.rank:
            return
        if self.group:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not all(
                (Path(trainer.default_root_dir) / f".settled-{rank}").exists() for rank in range(trainer.world_size)
            ):
                time.sleep(0.05)
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


class SignalAtStep(Callback):
    """Send `signum` to this rank's own process at step `step`, as SLURM's warning signal would."""

    def __init__(self, step: int, rank: int = 0, signum: int = int(signal.SIGUSR1)) -> None:
        self.step, self.rank, self.signum = step, rank, signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)


class KillDuringStateWrite(Callback):
    """Kills the whole job while the background writer is in the middle of this rank's `save`-th state
    file: half of its bytes are in the temporary file, the rename has not happened."""

    def __init__(self, save: int = 2, rank: int = 0) -> None:
        self.save, self.rank = save, rank

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.global_rank != self.rank:
            return
        checkpoint = trainer.checkpoint_callback
        original, count = checkpoint._write, [0]

        def write(path, job):
            if path.suffix == ".ckpt":
                count[0] += 1
                if count[0] == self.save:
                    def half_then_die(temporary, job=job):
                        job(temporary)
                        data = temporary.read_bytes()
                        temporary.write_bytes(data[: len(data) // 2])
                        os.killpg(os.getpgrp(), signal.SIGKILL)
                    return original(path, half_then_die)
            return original(path, job)

        checkpoint._write = write


class TouchStopAtStep(Callback):
    """`touch RUN/STOP` at step `step` of rank `rank`, as a user asking a job to stop would."""

    def __init__(self, step: int, rank: int = 0) -> None:
        self.step, self.rank = step, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            (Path(trainer.default_root_dir) / "STOP").touch()


class RaiseAtStep(Callback):
    """A Python error at the end of step `step` (a bug or a bad batch found mid-run)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"raised by tests.helpers.RaiseAtStep at step {self.step}")


class WaitForFileAtStep(Callback):
    """Wait at the end of step `step` until `path` exists (a job held mid-run while a test does something
    beside it), at most `timeout` seconds."""

    def __init__(self, step: int, path: str, timeout: float = 300.0) -> None:
        self.step, self.path, self.timeout = step, Path(path), timeout

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        deadline = time.monotonic() + self.timeout
        while not self.path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)


class SleepEachStep(Callback):
    """A slow step: sleep `seconds` at the end of every optimiser step of this process (a public hook,
    trainer.callbacks, so the step time mima measures includes it). With `sync_timeout`, the syncs'
    base timeout (--collective_timeout's part in StopAgreement) becomes that many seconds once training
    starts; the process group's rendezvous keeps --collective_timeout, since on a loaded machine a few
    seconds are not enough for the processes to meet."""

    def __init__(self, seconds: float, sync_timeout: float | None = None) -> None:
        self.seconds, self.sync_timeout = seconds, sync_timeout

    def on_train_start(self, trainer, pl_module) -> None:
        if self.sync_timeout is not None:
            trainer.strategy.stop.timeout_s = self.sync_timeout

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(self.seconds)
