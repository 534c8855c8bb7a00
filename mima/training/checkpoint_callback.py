"""MimaCheckpoint: every process saves its own state, in the background, with no collective.

What must survive a crash is small at most moments: a task's end weights of a phase, the phase
average and (with `optimizer_state: keep`) each task's AdamW moments are immutable once made, so
each is written once, as its own file, and a process's state refers to them by name (the files and
the references: mima.training.checkpoint_format). Files are written only when a state first refers
to them, by a background thread (mima.training.background_writer: FIFO, temporary file, fsync,
rename), so training goes on while bytes reach the disk and a kill mid-write leaves every earlier
file intact.

When to save (`--checkpoint_every`): "segment" (default: every task segment end, so a crash loses
at most K steps), "phase" (only at syncs: fewer, smaller files, up to one phase of a process lost),
a number n (every n process steps and at every sync; inside a segment a save holds the encoder and
its moments: 1-3 encoder sizes per process), or 0 (never). A stop request (signal or RUN/STOP, see
mima.training.preemption) saves at the next step boundary whatever the choice.

A state is built here from Lightning's public accessors (loop, optimiser, scheduler and callback
states, in the layout `trainer.fit(ckpt_path=...)` restores), plus mima's own section: the run's
identity, the random states and the PhaseState, which this callback serialises and restores but
never changes (MimaSyncCallback does). Which states a resume starts from: mima.training.resume.

Before each sync every process waits for its own writes (`flush`, handed to the sync callback by
`mima fit`), so after the sync ending phase P the states of phases < P are never needed again and
are removed, with the files only they referred to. After a successful run the whole checkpoints
folder is removed unless `--keep_checkpoints` is given.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import lightning
import numpy as np
import torch
from lightning.pytorch.callbacks import Checkpoint

from mima.core.run_folder import RunFolder
from mima.training.background_writer import BackgroundWriter
from mima.training.checkpoint_format import (CheckpointFiles, cpu_snapshot, flatten_moments, phase_of, reference,
                                             saved_states, state_writer)
from mima.training.phase_state import PhaseState, StepWatch
from mima.training.preemption import StopAgreement


class MimaCheckpoint(Checkpoint):
    """Saves each process's state as described in the module docstring; acts on stop requests.

    Args:
        phase_state: the process's PhaseState (shared with the sync callback, which changes it).
        stop: the process's side of the stop protocol.
        identity: what a state must agree on to be resumed (mima.training.resume.run_identity).
        every: "segment", "phase" or a number of process steps (see the module docstring).
        keep: keep the checkpoints folder after the run has finished.
    """

    def __init__(self, phase_state: PhaseState, stop: StopAgreement, identity: dict,
                 every: str | int = "segment", keep: bool = False) -> None:
        self.phase_state = phase_state
        self.stop = stop
        self.identity = identity
        self.every = every
        self.keep = keep
        self.writer: BackgroundWriter | None = None
        self.files: CheckpointFiles | None = None
        self.queued: set[Path] = set()  # files this process has written or queued
        self.stopped_by: int | None = None
        self.completed_syncs = 0
        self.inline_states: list[Path] = []  # this attempt's saves that hold an encoder themselves
        self.queued_first = False
        self.bytes_written = 0
        self.watch = StepWatch()

    # ------------------------------------------------------------------------- lifecycle
    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        saved = checkpoint["mima"]
        self.phase_state.load_state_dict(saved["phase_state"])
        restore_rng(saved["rng"])

    def on_train_start(self, trainer, pl_module) -> None:
        self.files = CheckpointFiles(Path(trainer.default_root_dir))
        self.writer = BackgroundWriter()
        self.stop.install()
        if trainer.ckpt_path is None:  # a fresh start: whatever an earlier attempt left is stale
            trainer.strategy.barrier("mima: fresh start")
            if trainer.is_global_zero:
                shutil.rmtree(self.files.root, ignore_errors=True)
            trainer.strategy.barrier("mima: stale checkpoints removed")
        self.completed_syncs = self.phase_state.completed_syncs

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.watch.batch_starts(trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.watch.stepped(trainer.global_step):
            return  # a micro-batch that only accumulated gradients: no step boundary
        step, plan = trainer.global_step, pl_module.plan
        if step >= plan.local_steps:
            return  # finished: final/ holds the result
        synced = self.phase_state.completed_syncs
        stopping = self.stop.stopped_by is not None or self.stop.at_step(plan.position(step).phase)
        if stopping or self._scheduled(step, pl_module):
            self.save(trainer, pl_module)
        if synced > self.completed_syncs:
            self._forget_before(trainer, synced - 1)
            self.completed_syncs = synced
        if stopping:
            self.stopped_by = self.stop.stopped_by if self.stop.stopped_by is not None else 0
            trainer.should_stop = True

    def flush(self) -> None:
        """Wait until this process's queued files are on disk. The sync callback calls it before
        it waits for the others: this process's states of the phase must be on disk before any
        process moves past it (see `_forget_before`)."""
        if self.writer is not None:
            self.writer.flush()

    def on_train_end(self, trainer, pl_module) -> None:
        self.writer.close()
        self.bytes_written = self.writer.bytes_written
        finished = trainer.global_step >= pl_module.plan.local_steps and self.stopped_by is None
        trainer.strategy.barrier("mima: every process has finished writing")
        if finished and trainer.is_global_zero:
            for path in RunFolder(self.files.run_dir).replaced_runs() + ([] if self.keep else [self.files.root]):
                shutil.rmtree(path, ignore_errors=True)

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self.writer is not None:
            try:
                self.writer.flush()  # what was queued is still a valid, older state
            except Exception:
                pass

    def _scheduled(self, step: int, pl_module) -> bool:
        plan = pl_module.plan
        if pl_module.hparams.mode == "joint":
            every = plan.total_steps // pl_module.hparams.iterations if self.every in ("segment", "phase") else self.every
            return step % every == 0
        at_sync = plan.ends_phase(step - 1)
        if self.every == "segment":
            return plan.ends_segment(step - 1)
        if self.every == "phase":
            return at_sync
        return at_sync or step % int(self.every) == 0

    # ------------------------------------------------------------------------------ save
    def save(self, trainer, pl_module) -> None:
        # Lightning's trainer.save_checkpoint ends with a barrier over all processes; MIMA's processes
        # save at different steps, so each builds its state itself (process_state).
        checkpoint = process_state(trainer, pl_module)
        plan = pl_module.plan
        step = trainer.global_step
        phase = plan.position(step).phase
        checkpoint["mima"] = {"run": self.identity, "rank": trainer.global_rank, "phase": phase, "rng": capture_rng(),
                              "phase_state": self.phase_state.state_dict()}
        inline = pl_module.hparams.mode == "joint" or not self._compact(trainer, pl_module, checkpoint)
        path = self.files.state(trainer.global_rank, phase, step)
        self._write(path, lambda tmp, state=cpu_snapshot(checkpoint): torch.save(state, tmp))
        if trainer.is_global_zero and not self.queued_first:
            # the run that --overwrite replaced goes once this run can be resumed on its own
            self.writer.submit_removal(RunFolder(self.files.run_dir).replaced_runs())
            self.queued_first = True
        if inline:
            # Two are kept, not one: a replica's newest may be the one a killed partner did not finish.
            self.inline_states.append(path)
            if len(self.inline_states) > 2:
                self.writer.submit_removal([self.inline_states.pop(0)])

    def _compact(self, trainer, pl_module, checkpoint: dict) -> bool:
        """Replace the tensors that live in immutable files by references (writing those files once);
        True if the working encoder and optimiser state were among them (a segment boundary)."""
        plan, layout, rank, phases = pl_module.plan, pl_module.layout, trainer.global_rank, self.phase_state
        leader, last = layout.is_leader(rank), plan.iterations - 1
        state = checkpoint["mima"]["phase_state"]
        avg_file = self.files.average(phases.avg_phase)
        self._ensure(avg_file, trainer.is_global_zero, lambda: state_writer(phases.avg))
        state["avg"] = reference(self.files, avg_file, "state")
        for slot, weights in phases.segment_ends.items():
            task = plan.tasks[plan.local_tasks[slot]]
            file = self.files.segment(phases.segment_phase, task, phases.segment_phase == last)
            self._ensure(file, leader, lambda w=weights: state_writer(w))
            state["segment_ends"][slot] = reference(self.files, file, "state")
        for slot, moments in phases.task_moments.items():
            task = plan.tasks[plan.local_tasks[slot]]
            file = self.files.moments(phases.moments_phase[slot], task)
            self._ensure(file, leader, lambda m=moments: state_writer(flatten_moments(m)))
            state["task_moments"][slot] = reference(self.files, file, "moments")
        boundary = phases.boundary(plan, trainer.global_step)
        if boundary is None:
            return False  # inside a segment: the working encoder and its moments are saved inline
        weights_ref, moments_ref = boundary
        source = state["avg"] if weights_ref == "avg" else state["segment_ends"][weights_ref]
        encoder = {k[len("encoder."):]: v for k, v in checkpoint["state_dict"].items() if k.startswith("encoder.")}
        referenced = set(phases.avg) if weights_ref == "avg" else set(encoder)
        others = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("encoder.")}
        extra = {f"encoder.{k}": v for k, v in encoder.items() if k not in referenced} | others
        checkpoint["state_dict"] = {**source, "prefix": "encoder.", "extra": extra}
        optimizer = checkpoint["optimizer_states"][0]
        optimizer["state"] = state["task_moments"][moments_ref] if moments_ref is not None else {}
        return True

    def _ensure(self, path: Path, responsible: bool, make) -> None:
        """Queue a file once, on the process responsible for it; the others only refer to it."""
        if not responsible or path in self.queued or path.is_file():
            return
        self._write(path, make())
        self.queued.add(path)

    def _write(self, path: Path, write) -> None:
        self.writer.submit(path, write)

    # ----------------------------------------------------------------------------- tidy up
    def _forget_before(self, trainer, synced_phase: int) -> None:
        """After the sync ending `synced_phase` every process's states of that phase are on disk,
        so states of earlier phases (and the files only they refer to) are never needed again."""
        rank, files = trainer.global_rank, self.files
        obsolete = [p for p in saved_states(files.run_dir, rank) if phase_of(p) < synced_phase]
        self.inline_states = [p for p in self.inline_states if p not in obsolete]
        shared: list[Path] = []
        if trainer.is_global_zero:  # the shared files, by one process
            shared += _older(files.root / "averages", synced_phase - 1)
            shared += _older(files.root / "segments", synced_phase)
            shared += _older(files.root / "moments", synced_phase - 1)
        self.writer.submit_removal(obsolete + shared)


def _older(folder: Path, phase: int) -> list[Path]:
    """Entries phase-PPPP(.safetensors) of `folder` with PPPP < phase."""
    found = []
    for entry in folder.glob("phase-*"):
        number = re.match(r"phase-(\d+)", entry.name)
        if number and int(number.group(1)) < phase:
            found.append(entry)
    return found


# ------------------------------------------------------------------------- a process's state
def process_state(trainer, pl_module) -> dict:
    """This process's resumable state, from Lightning's public accessors, in the layout that
    `trainer.fit(ckpt_path=...)` restores (Lightning's documented checkpoint keys)."""
    strategy = trainer.strategy
    checkpoint = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "pytorch-lightning_version": lightning.__version__,
        "state_dict": strategy.lightning_module_state_dict(),
        "loops": {"fit_loop": trainer.fit_loop.state_dict()},
        "callbacks": {callback.state_key: state for callback in trainer.callbacks if (state := callback.state_dict())},
        "optimizer_states": [strategy.optimizer_state(optimizer) for optimizer in trainer.optimizers],
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
    }
    precision = trainer.precision_plugin.state_dict()
    if precision:  # e.g. the gradient scaler of 16-mixed
        checkpoint[type(trainer.precision_plugin).__qualname__] = precision
    for callback in trainer.callbacks:
        callback.on_save_checkpoint(trainer, pl_module, checkpoint)
    pl_module.on_save_checkpoint(checkpoint)
    return checkpoint


def capture_rng() -> dict:
    """Every random state a step could touch, as tensors and plain values (loadable with weights_only)."""
    numpy_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [numpy_state[0], torch.from_numpy(numpy_state[1].astype(np.int64)), *numpy_state[2:]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
