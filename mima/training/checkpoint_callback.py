"""MimaCheckpoint: every process saves its own state, in the background, with no collective.

What must survive a crash is small at most moments: a task's end weights of a phase, the phase
average and (with `optimizer_state: keep`) each task's AdamW moments are immutable once made, so
each is written once, as its own file, and a process's state refers to them by name (the files and
the references: mima.training.checkpoint_format). Files are written only when a state first refers
to them, by a background thread (mima.training.background_writer: FIFO, temporary file, fsync,
rename), so training goes on while bytes reach the disk and a kill mid-write leaves every earlier
file intact.

When to save (`--checkpoint_every`, mima.training.save_schedule.SaveSchedule; `mima fit`'s default
"auto" is settled by the plan, mima.training.plan_choices: "30min" on a GPU, "segment" on the CPU): "segment" (every task
segment end, so a crash loses at most K steps), "phase" or "k phases" (at every k-th sync: fewer, smaller files,
up to k phases of a process lost), a number n (every n process steps and at every sync; inside a
segment a save holds the encoder and its moments: 1-3 encoder sizes per process), a time such as
"30min" (at the first sync after that much time since the last save, by process 0's clock, which it
shares at the sync, so every process saves at the same syncs), or 0 (never). A stop request (signal
or RUN/STOP, see mima.training.preemption) saves at the next step boundary whatever the choice.
The choice changes only when states are saved, never the weights. Before a state is queued, what
it holds is checked to be finite (step losses, weights, optimiser state): a process that diverged
saves nothing more, so the states on disk stay the last good ones (mima.training.divergence).

A state is built here from Lightning's public accessors (loop, optimiser, scheduler and callback
states, in the layout `trainer.fit(ckpt_path=...)` restores), plus mima's own section: the run's
identity, the random states (mima.training.rng_state) and the phase state, which MimaSyncCallback
owns, changes and restores: this callback reads what a save holds through the sync callback's view
(mima.training.phase_view), given when it is made, and runs after that callback (checked in
`setup`: a save at a segment end or sync holds what the sync callback's same hook has just kept).
Which states a resume starts from: mima.training.resume.

Nobody waits for the disk at a sync: files no resume can need any more are removed once the
processes' newer states are known to be on disk (mima.training.checkpoint_retention: the committed
cut, shared through the stop store), so only the newest generation of kept AdamW moments stays.
A process waits for its writer only before queueing a checkpoint while the previous one is still
being written (at most one checkpoint in flight, so host memory stays bounded); the time the
training threads spent on checkpoints is printed at the end (the slowest process's). After a
successful run the whole checkpoints folder is removed unless `--keep_checkpoints` is given.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from mima.config.defaults import CHECKPOINT_EVERY_ON_CPU
from mima.core.run_folder import JOINT, RunFolder
from mima.training.background_writer import BackgroundWriter
from mima.training.checkpoint_format import (STATE_NAME, CheckpointFiles, cpu_snapshot, flatten_moments, reference,
                                             references, state_writer)
from mima.training.checkpoint_retention import Commitments, Retention, StateRecord
from mima.training.divergence import divergence_report, nonfinite_key
from mima.training.phase_state import BufferName, StepWatch
from mima.training.phase_view import PhaseView
from mima.training.preemption import StopAgreement
from mima.training.resume import RunStart
from mima.training.rng_state import capture_rng, restore_rng
from mima.training.save_schedule import SaveSchedule


TIDY_EVERY_S = 0.5  # how often a process reads the shared record of durable states (store round trips)


class MimaCheckpoint(Checkpoint):
    """Saves each process's state as described in the module docstring; acts on stop requests.

    Args:
        phases: the sync callback's view of the process's phase state (MimaSyncCallback.phase_view;
            the joint baseline, which has no phases: PhaseView.without_phases()).
        stop: the process's side of the stop protocol (its store also carries the durable states).
        run_start: the run's identity, which every state records, and the cut this attempt resumes
            (mima.training.resume.RunStart: filled by `mima fit` before training starts).
        every: when to save: a SaveSchedule or a --checkpoint_every value (see the module docstring).
        keep: keep the checkpoints folder after the run has finished.
        writer: the process's background writer (`mima fit` passes the one that also writes the
            final task models, mima.training.sync); default: one of this callback's own. Closed at
            the end of training either way: this callback's on_train_end runs after the sync's
            (`setup` refuses another order).
    """

    def __init__(self, phases: PhaseView, stop: StopAgreement, run_start: RunStart,
                 every: SaveSchedule | str | int = CHECKPOINT_EVERY_ON_CPU, keep: bool = False,
                 writer: BackgroundWriter | None = None) -> None:
        self.phases = phases
        self.stop = stop
        self.run_start = run_start
        self.every = every if isinstance(every, SaveSchedule) else SaveSchedule.parse(every)
        self.keep = keep
        self.given_writer = writer
        self.writer: BackgroundWriter | None = None
        self.files: CheckpointFiles | None = None
        self.queued: set[Path] = set()  # files this process has written or queued
        self.stopped_by: int | None = None
        self.inline_states: list[Path] = []  # this attempt's saves that hold an encoder themselves
        self.queued_first = False
        self.bytes_written = 0
        self.stall_s = 0.0  # time the training thread spent saving, waiting for the writer and tidying
        self.watch = StepWatch()
        self.states: list[StateRecord] = []  # this process's states of this attempt (and the one it resumed)
        self.commits: Commitments | None = None
        self.retention: Retention | None = None
        self.in_flight = 0  # the writer's job count when the previous checkpoint was queued
        self.last_save = 0.0  # time.monotonic() of the previous save (or the start)
        self.next_tidy = 0.0
        self.last_tidied: tuple[int, StateRecord | None] | None = None  # (committed phase, cut) last tidied for
        self.healthy_at: int | None = None  # the step after which what this process holds was last found finite

    # ------------------------------------------------------------------------- lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.phases.check_order(trainer.callbacks, self)

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        restore_rng(checkpoint["mima"]["rng"])  # the phase state: MimaSyncCallback restores its own

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.files = CheckpointFiles(Path(trainer.default_root_dir))
        self.writer = self.given_writer if self.given_writer is not None else BackgroundWriter()
        self.stop.install()
        if trainer.ckpt_path is None:  # a fresh start: whatever an earlier attempt left is stale
            trainer.strategy.barrier("mima: fresh start")
            if trainer.is_global_zero:
                shutil.rmtree(self.files.root, ignore_errors=True)
            trainer.strategy.barrier("mima: stale checkpoints removed")
        self.last_save = time.monotonic()
        rank, layout = trainer.global_rank, pl_module.layout
        partners = next((group for group in layout.task_group_ranks() if rank in group), [rank])
        self.commits = Commitments(self.stop.store, trainer.world_size, rank, partners)
        self.retention = Retention(self.files, rank, leader=layout.is_leader(rank), removes_shared=trainer.is_global_zero)
        resumed = self.run_start.state_of(rank)
        if resumed is not None and Path(resumed).parent == self.files.rank_dir(rank):
            name = STATE_NAME.match(Path(resumed).name)
            record = StateRecord(Path(resumed), int(name.group(1)), int(name.group(2)), durable=True)
            self.states.append(record)  # on disk and chosen by every process: durable and committed
            self.commits.publish(record.phase, record.step)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.watch.batch_starts(trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any,
                           batch_idx: int) -> None:
        if not self.watch.stepped(trainer.global_step):
            return  # a micro-batch that only accumulated gradients: no step boundary
        step, plan = trainer.global_step, pl_module.plan
        if step >= plan.local_steps:
            return  # finished: final/ holds the result
        # asked before the stop check: a wall-clock decision is a broadcast every process makes here
        scheduled = self._scheduled(trainer, pl_module, step)
        if scheduled:  # before the stop check, so that a divergence found here stops the replicas too
            self._healthy(trainer, pl_module)
        # stopped at the sync that just ran (by a request or another process's divergence): the replicas
        # saw the same decision there; a divergence of this process's own goes to them in at_step
        stopped_at_sync = self.stop.stopped_by is not None or (self.stop.divergence is not None and not self.stop.diverged_here)
        stopping = stopped_at_sync or self.stop.at_step(plan.phase_of(step))
        if (stopping or scheduled) and not self.stop.diverged_here:
            self.save(trainer, pl_module)
        self.tidy(trainer)
        if stopping and self.stop.divergence is None:
            self.stopped_by = self.stop.stopped_by if self.stop.stopped_by is not None else 0
        if stopping or self.stop.diverged_here:
            trainer.should_stop = True

    def flush(self) -> None:
        """Wait until this process's queued files are on disk (for tests and for a failing run)."""
        if self.writer is not None:
            self.writer.flush()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.writer.close()
        self.bytes_written = self.writer.bytes_written
        finished = trainer.global_step >= pl_module.plan.local_steps and self.stopped_by is None and self.stop.divergence is None
        self._publish_durable()
        trainer.strategy.barrier("mima: every process has finished writing")
        if not finished or self.keep:
            # every state is on disk: what the last cut no longer needs goes now (one generation of moments)
            started = time.monotonic()
            for path in self._removable():
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            self.stall_s += time.monotonic() - started
            trainer.strategy.barrier("mima: tidied")  # the store's host stays up until every process has read it
        if finished and trainer.is_global_zero:
            for path in RunFolder(self.files.run_dir).replaced_runs() + ([] if self.keep else [self.files.root]):
                shutil.rmtree(path, ignore_errors=True)
        stall = trainer.strategy.reduce(torch.tensor(self.stall_s, device=trainer.strategy.root_device), reduce_op="max")
        if trainer.is_global_zero:
            print(f"mima fit: checkpoints held up training for {float(stall):.2f} s (the slowest process: saving, "
                  "waiting for the writer, tidying up)", flush=True)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.writer is not None:
            try:
                self.writer.flush()  # what was queued is still a valid, older state
            except Exception:
                pass

    def _scheduled(self, trainer, pl_module, step: int) -> bool:
        """Whether the step that just ended is a save point of the schedule."""
        plan, every = pl_module.plan, self.every
        if pl_module.hparams.mode == JOINT:
            if every.kind == "steps":
                return step % int(every.amount) == 0
            period = plan.total_steps // pl_module.hparams.iterations  # the joint run's "phases"
            ends_segment = at_sync = step % period == 0
            ended_phase = step // period - 1
        else:
            ended_phase = plan.phase_of(step - 1)
            ends_segment = plan.ends_segment(step - 1)
            # the sync ran (not left pending by a stop): then every process has just run it and is here
            at_sync = plan.ends_phase(step - 1) and self.phases.avg_phase == ended_phase
        if every.kind == "segment":
            return ends_segment
        if every.kind == "steps":
            return at_sync or step % int(every.amount) == 0
        if every.kind == "phases":
            return at_sync and (ended_phase + 1) % int(every.amount) == 0
        if every.kind == "seconds":
            return at_sync and self._interval_passed(trainer)
        return False

    def _interval_passed(self, trainer) -> bool:
        """Process 0's clock decides, and tells the others: called by every process right after the
        same sync that ran (a stop leaves it pending on every process: then nobody asks), so the
        broadcast pairs up."""
        due = time.monotonic() - self.last_save >= self.every.amount
        if trainer.world_size > 1:
            due = bool(trainer.strategy.broadcast(due, src=0))
        return due

    # ------------------------------------------------------------------------------ save
    def _healthy(self, trainer, pl_module) -> bool:
        """Whether what this process would save now is finite: its step losses read so far, its working
        weights and optimiser state (the tensors of PhaseState were checked where the sync callback
        made them). If not, the process diverged (mima.training.divergence): it saves nothing more."""
        if self.stop.diverged_here:
            return False
        if self.healthy_at == trainer.global_step:
            return True  # checked before this step's stop check
        self.phases.settle_losses()
        plan, step = pl_module.plan, trainer.global_step - 1  # the step that just ended
        bad = self.phases.nonfinite
        if bad is not None:
            task = JOINT if pl_module.hparams.mode == JOINT else plan.tasks[plan.local_tasks[bad.slot]]
            what, step = bad.nonfinite_part(), bad.step
        else:
            key = nonfinite_key(pl_module.state_dict())
            key = f"weights ({key})" if key is not None else None
            if key is None and (moments := nonfinite_key([o.state_dict()["state"] for o in trainer.optimizers])) is not None:
                key = f"optimiser moments ({moments})"
            if key is None:
                self.healthy_at = trainer.global_step
                return True
            task = JOINT if pl_module.hparams.mode == JOINT else "+".join(plan.tasks[position.task_index]
                                                                          for position in plan.positions(step))
            what = f"non-finite {key}"
        phase = plan.phase_of(min(trainer.global_step, plan.local_steps - 1))
        self.stop.diverge(phase, divergence_report(task, what, step, trainer.global_rank, trainer.world_size))
        return False

    def save(self, trainer, pl_module) -> None:
        # Lightning's trainer.save_checkpoint ends with a barrier over all processes; MIMA's processes
        # save at different steps, so each builds its state itself (process_state).
        if not self._healthy(trainer, pl_module):
            return  # checked before anything is written: the states on disk stay the last good ones
        started = time.monotonic()
        self.writer.wait_for_job(self.in_flight)  # at most one checkpoint in flight: bounded host memory
        checkpoint = process_state(trainer, pl_module)
        plan = pl_module.plan
        step = trainer.global_step
        phase = plan.phase_of(step)
        checkpoint["mima"] = {"run": self.run_start.identity, "rank": trainer.global_rank, "phase": phase, "rng": capture_rng(),
                              "phase_state": self.phases.state_dict()}
        if plan.batched:  # model.batch_tasks: the state holds the stacked models (MimaModule checks a resume's)
            checkpoint["mima"]["batch_tasks"] = True
        inline = pl_module.hparams.mode == JOINT or not self._compact(trainer, pl_module, checkpoint)
        path = self.files.state(trainer.global_rank, phase, step)
        record = StateRecord(path, phase, step, frozenset(references(checkpoint)))
        self.states = [r for r in self.states if r.path != path] + [record]
        self._write(path, lambda tmp, state=cpu_snapshot(checkpoint): torch.save(state, tmp), record.mark_durable)
        if trainer.is_global_zero and not self.queued_first:
            # the run that --overwrite replaced goes once this run can be resumed on its own
            self.writer.submit_removal(RunFolder(self.files.run_dir).replaced_runs())
            self.queued_first = True
        if inline:
            # Two are kept, not one: a replica's newest may be the one a killed partner did not finish.
            self.inline_states.append(path)
            if len(self.inline_states) > 2:
                self.writer.submit_removal([self.inline_states.pop(0)])
        if self._commits_once_written(phase):
            # what this state replaces goes right after it is on disk (FIFO), not at the next tidy
            self.writer.submit_removal(self._removable(phase, record))
        self.in_flight = self.writer.submitted
        self.last_save = time.monotonic()
        self.stall_s += self.last_save - started

    def _compact(self, trainer, pl_module, checkpoint: dict) -> bool:
        """Replace the tensors that live in immutable files by references (writing those files once);
        True if the working encoder and optimiser state were among them (a segment boundary)."""
        state = checkpoint["mima"]["phase_state"]  # the sync callback's state, as its view gave it
        average_keys = set(state["avg"])
        self._reference_phase_files(trainer, pl_module, state)
        boundary = self.phases.boundary(pl_module.plan, trainer.global_step)
        if boundary is None:
            return False  # inside a segment: the working encoder and its moments are saved inline
        weights_ref, moments_ref = boundary
        source = state["avg"] if weights_ref == "avg" else state["segment_ends"][weights_ref]
        encoder = {k[len("encoder."):]: v for k, v in checkpoint["state_dict"].items() if k.startswith("encoder.")}
        referenced = average_keys if weights_ref == "avg" else set(encoder)
        others = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("encoder.")}
        extra = {f"encoder.{k}": v for k, v in encoder.items() if k not in referenced} | others
        checkpoint["state_dict"] = {**source, "prefix": "encoder.", "extra": extra}
        optimizer = checkpoint["optimizer_states"][0]
        optimizer["state"] = state["task_moments"][moments_ref] if moments_ref is not None else {}
        return True

    def _reference_phase_files(self, trainer, pl_module, state: dict) -> None:
        """In `state` (a phase state's state_dict), replace the average, the outer momentum, each
        slot's end weights and kept moments by a reference to the immutable file holding them,
        queueing each file once, on the process responsible for it."""
        plan, files = pl_module.plan, self.files
        leader, last = pl_module.layout.is_leader(trainer.global_rank), plan.iterations - 1
        avg_file = files.average(state["avg_phase"])
        self._ensure(avg_file, trainer.is_global_zero, ("average", 0), state["avg"])
        state["avg"] = reference(files, avg_file, "state")
        if state["outer_momentum"]:  # the same on every process, like the average: written once, by process 0
            momentum_file = files.outer_momentum(state["avg_phase"])
            self._ensure(momentum_file, trainer.is_global_zero, ("outer_momentum", 0), state["outer_momentum"])
            state["outer_momentum"] = reference(files, momentum_file, "state")
        segment_phase = state["segment_phase"]
        for slot, weights in list(state["segment_ends"].items()):
            task = plan.tasks[plan.local_tasks[slot]]
            file = files.segment(segment_phase, task, segment_phase == last)
            self._ensure(file, leader, ("segment", slot), weights)
            state["segment_ends"][slot] = reference(files, file, "state")
        for slot, moments in list(state["task_moments"].items()):
            task = plan.tasks[plan.local_tasks[slot]]
            file = files.moments(state["moments_phase"][slot], task)
            self._ensure(file, leader, ("moments", slot), flatten_moments(moments))
            state["task_moments"][slot] = reference(files, file, "moments")

    def _ensure(self, path: Path, responsible: bool, buffer: BufferName, tensors: Mapping[str, torch.Tensor]) -> None:
        """Queue a file of PhaseState tensors once, on the process responsible for it; the others only
        refer to it. The writer writes host tensors as they are (device ones go through host buffer
        `buffer` first: pinned, a non-blocking copy), after their copies from the device have arrived;
        `buffer` is not refilled before the file is written."""
        if not responsible or path in self.queued or self.writer.pending(path) or path.is_file():
            return  # (pending: a final task model the sync callback queued on the same writer)
        host = self.phases.host
        if any(value.device.type != "cpu" for value in tensors.values()):
            tensors = host.fill(buffer, tensors)
        self._write(path, state_writer(tensors, ready=host.ready()))
        writer, written = self.writer, self.writer.submitted  # its jobs are done in order: this one is number `written`
        host.hold(buffer, lambda: writer.wait_for_job(written))
        self.queued.add(path)

    def _write(self, path: Path, write, done=None) -> None:
        self.writer.submit(path, write, done)

    # ----------------------------------------------------------------------------- tidy up
    def tidy(self, trainer, force: bool = False) -> None:
        """Remove what no resume can need any more (mima.training.checkpoint_retention); reads the
        shared record at most every TIDY_EVERY_S unless forced, and only while this process has a
        state on disk that is not committed yet (no store traffic between saves)."""
        started = time.monotonic()
        if (started < self.next_tidy and not force) or self.commits is None:
            return
        self.next_tidy = started + TIDY_EVERY_S
        newest = self._newest_durable()
        last_cut = self.last_tidied[1] if self.last_tidied is not None else None
        if newest is None or (not force and last_cut is not None and newest.step <= last_cut.step):
            return  # no state on disk newer than the one this process last tidied for: nothing to ask
        self.commits.publish(newest.phase, newest.step)
        removable = self._removable()
        if removable:
            self.writer.submit_removal(removable)
        self.stall_s += time.monotonic() - started

    def _newest_durable(self) -> StateRecord | None:
        return max((record for record in self.states if record.durable), key=lambda record: record.step, default=None)

    def _publish_durable(self) -> None:
        newest = self._newest_durable()
        if newest is not None:
            self.commits.publish(newest.phase, newest.step)

    def _commits_once_written(self, phase: int) -> bool:
        """Whether a state of `phase` becomes this process's committed state as soon as it is on disk:
        every process already has a durable state of this phase (or there is one process), and no
        replica must write the same step first."""
        return not self.commits.partners and (self.commits.store is None or self.commits.committed >= phase)

    def _removable(self, committed: int | None = None, cut: StateRecord | None = None) -> list[Path]:
        """What no resume can need once `cut` (default: the newest committed state) is on disk."""
        if committed is None:
            committed = self.commits.committed_phase()
            cut = max((r for r in self.states if r.durable and r.phase == committed and self.commits.partners_reached(r.step)),
                      key=lambda record: record.step, default=None)
        if (committed, cut) == self.last_tidied:
            return []  # nothing new is committed: spare the file system the listings
        self.last_tidied = (committed, cut)
        removable = self.retention.removable(self.states, committed, cut)
        self.states = [record for record in self.states if record.path not in removable]
        self.inline_states = [path for path in self.inline_states if path not in removable]
        return removable


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
