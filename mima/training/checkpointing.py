"""Per-process checkpoints that survive crashes, and preemption handled at step boundaries.

Processes hold different task weights, so a checkpoint is a directory with one file per rank:

    <run>/checkpoints/step=000160.ckpt/     a complete checkpoint (never modified once complete)
        rank-00000.ckpt, rank-00001.ckpt    each rank's Lightning checkpoint (weights, optimiser,
                                            scheduler, loops, callback state: average, end weights
                                            of the phase so far, RNG, ...)
        meta.json                           written last: step, world size, tasks, N, K, S
    <run>/checkpoints/last.ckpt -> step=000160.ckpt   (symlink, replaced atomically)

A save writes into `step=....ckpt.partial/`; every rank writes its file atomically (temporary
file, fsync, rename); after all ranks are done rank 0 adds meta.json and renames the folder into
place, then moves the `last` link. A crash at any point leaves the previous complete checkpoint
in place and findable: `last` resolves to it, or, if the link itself is missing, the newest
complete step folder is used.

Preemption: SIGUSR1 (SLURM's warning before the time limit) and SIGTERM only set a flag. After
every optimiser step the processes agree on the flag with one all-reduce, save together, and stop;
`mima fit` then requeues the SLURM job (`scontrol requeue`) from rank 0.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from mima.core.errors import MimaError
from mima.core.files import atomic_path, replace_symlink

LAST = "last.ckpt"
META = "meta.json"
PARTIAL = ".partial"
PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def rank_file(checkpoint_dir: Path, rank: int) -> Path:
    return Path(checkpoint_dir) / f"rank-{rank:05d}.ckpt"


def write_atomically(obj: object, path: Path) -> None:
    """torch.save through mima.core.files.atomic_path (temporary file, fsync, rename)."""
    with atomic_path(path) as temporary:
        torch.save(obj, temporary)


def read_meta(checkpoint_dir: Path) -> dict:
    file = Path(checkpoint_dir) / META
    if not file.is_file():
        raise MimaError(f"{checkpoint_dir}: not a complete mima checkpoint (no {META}; the save may have been cut off)")
    return json.loads(file.read_text())


def is_complete(checkpoint_dir: Path) -> bool:
    return (Path(checkpoint_dir) / META).is_file()


def latest_checkpoint(folder: Path) -> Path | None:
    """The checkpoint `last` in `folder` (a run's checkpoints/) points at, or the newest complete
    one if the link is missing or broken."""
    folder = Path(folder)
    link = folder / LAST
    if link.is_symlink() and is_complete(link.resolve()):
        return link.resolve()
    complete = [d for d in folder.glob("step=*.ckpt") if d.is_dir() and is_complete(d)]
    if not complete:
        return None
    return max(complete, key=lambda d: read_meta(d)["step"])


RUN_IDENTITY_KEYS = ("tasks", "steps", "iterations", "steps_per_phase", "world_size", "mode")


def run_identity(tasks: list[str], steps: int, iterations: int, world_size: int, mode: str = "mima") -> dict:
    """What a checkpoint must agree on to be resumed by a run."""
    identity = {"tasks": list(tasks), "steps": steps, "iterations": iterations,
                "steps_per_phase": steps // iterations, "world_size": world_size, "mode": mode}
    assert tuple(identity) == RUN_IDENTITY_KEYS
    return identity


def check_resumable(checkpoint_dir: Path, expected: dict) -> None:
    """Refuse a checkpoint written by a run with other tasks, S, N, K or number of processes."""
    meta = read_meta(checkpoint_dir)
    for key in RUN_IDENTITY_KEYS:
        written = meta.get(key, "mima" if key == "mode" else None)  # checkpoints of mima 0.1 have no mode
        if written != expected[key]:
            raise MimaError(
                f"--ckpt_path {checkpoint_dir}: written by a run with {key}={written}, "
                f"but this run has {key}={expected[key]}"
            )


def resolve_ckpt_path(ckpt_path: str | None, checkpoints_dir: Path, expected: dict) -> Path | None:
    """`last` -> the run's latest complete checkpoint (None: start fresh); a path must be a complete one."""
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        found = latest_checkpoint(checkpoints_dir)
    else:
        found = Path(ckpt_path)
        if not found.exists():
            raise MimaError(f"--ckpt_path {ckpt_path}: no such checkpoint")
        if not found.is_dir() or not list(found.glob("rank-*.ckpt")):
            raise MimaError(f"--ckpt_path {ckpt_path}: not a mima checkpoint folder (expected {META} and rank-*.ckpt)")
        found = found.resolve()
    if found is not None:
        check_resumable(found, expected)
    return found


# ------------------------------------------------------------------------------ preemption
_received: list[int] = []  # signals seen by this process and not yet acted on


def _remember_signal(signum, frame) -> None:
    _received.append(int(signum))


def agree_on_preemption(device: torch.device) -> int:
    """The signal any process received (0: none); every process must call this at the same step."""
    local = torch.tensor([_received[-1] if _received else 0], dtype=torch.int64, device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return int(local.item())


class MimaCheckpoint(ModelCheckpoint):
    """ModelCheckpoint every `every_n_train_steps` process steps, `last` as an atomic link, and
    a save at the first step after a preemption signal."""

    def __init__(self, dirpath: str | Path, every_n_train_steps: int) -> None:
        super().__init__(
            dirpath=str(dirpath),
            filename="step={step:06d}",
            auto_insert_metric_name=False,
            every_n_train_steps=every_n_train_steps,
            save_top_k=1,
            save_last="link",
            enable_version_counter=False,
        )
        self.preempted_by: int | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        _received.clear()
        for signum in PREEMPTION_SIGNALS:
            signal.signal(signum, _remember_signal)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not getattr(pl_module, "stepped", True):
            return  # a micro-batch that only accumulated gradients: no step boundary to save at
        signum = agree_on_preemption(trainer.strategy.root_device)
        if not signum:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        if not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        self.preempted_by = signum
        trainer.should_stop = True

    @staticmethod
    def _link_checkpoint(trainer, filepath: str, linkpath: str) -> None:
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            replace_symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), Path(linkpath))
        trainer.strategy.barrier()


def remove_checkpoint_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
