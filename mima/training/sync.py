"""The MIMA synchronisation callback: ends task segments and phases.

At the end of each task segment (K steps of one task) the callback keeps the task's end weights
(in host memory) and restarts the working encoder from the phase's start point `avg` for the next
task of the process. At the end of each phase all processes average their tasks' end weights
(every floating tensor: parameters and buffers such as BatchNorm statistics; see
mima.training.averaging), turn the average into the next phase's start with the phase-end operator
(mima.training.sync_merge: the average itself, a merge, or DiLoCo's outer step), load that, reset
the optimiser moments as configured, and log the alignment diagnostics of paper 001: pairwise
cosines of the task vectors tau_t = theta_t - theta_0 and of the phase updates delta_t = theta_t -
avg_previous, over all tasks. In the last phase each task's end weights are the run's final task
checkpoint.

Device memory: the working encoder and `avg`; the end weights of the process's own tasks wait in
host memory until the phase ends, and so do the kept AdamW moments of its tasks (`optimizer_state:
keep`; 2 encoder sizes per task of the process). Both go into host buffers reserved before the
first step and refilled at every segment end, pinned on a GPU, with non-blocking copies that the
host waits for only where it reads them (mima.training.phase_state.HostBuffers). The last phase's
end weights are the final task models, which the process's background writer writes (the one its
checkpoints use), not the training thread. A process with one
task keeps its moments in the optimiser from one segment to the next: the copy is for the
checkpoint, nothing is loaded back. All of this is the process's PhaseState
(mima.training.phase_state), which this callback makes, changes and restores from a saved state
(on_load_checkpoint); nobody else holds it. The others read it through the view it hands out
(`phase_view`, mima.training.phase_view): the checkpoint callback stores what it holds (each part
tagged with the phase it belongs to, as immutable per-(task, phase) files), the progress bars show
its loss, the tracker forwarding sends a phase's rows once its sync ran. They read in a hook what
this callback's same hook has just changed, so they come after it in trainer.callbacks, which each
checks in its `setup`.

Processes reach a sync after different numbers of steps when they own different numbers of tasks;
before entering it they agree through the stop store whether to sync or to stop
(mima.training.preemption), and a process waits there for the others as long as the plan says the
slowest may still train (mima.training.sync_deadline). A stop there leaves the sync pending: the
state saved then resumes by running it first. How long each process waited for the others is logged per sync (`sync/wait_s`
in its CSV log, `wait_s` per process in metrics.jsonl).

A step loss (or, under gradient clipping, gradient norm) read as NaN or inf, or a segment's end
weights or kept moments holding one, stop the run before anything of it is kept, averaged or
written to final/ (mima.training.divergence).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from mima.core.errors import MimaError
from mima.core.run_folder import RunFolder
from mima.core.state_dicts import cosine_from_gram, is_mergeable, mean_off_diagonal
from mima.models.stacked import per_task_norms
from mima.training.averaging import average_phase, gather_task_values
from mima.training.background_writer import BackgroundWriter
from mima.training.divergence import divergence_report, nonfinite_key
from mima.training.phase_state import PhaseState, StepWatch, adamw_moment_specs
from mima.training.phase_view import PhaseView
from mima.training.preemption import StopAgreement
from mima.training.sync_deadline import StepClock, lag_steps, sync_allowance_s
from mima.training.sync_merge import SyncMerge

StateDict = dict[str, torch.Tensor]


def _moments_for_optimizer(kept: dict, device: torch.device) -> dict:
    """The optimiser's own copy of a task's kept moments, for `Optimizer.load_state_dict`, which keeps
    a tensor already on the parameters' device (the CPU) and AdamW then updates it in place; the kept
    ones must stay as they were (the checkpoint writer writes them in the background, uncopied). On
    a GPU the copy is the transfer to the device that loading makes anyway."""
    return {
        param: {name: (value.clone() if name == "step" else value.to(device, copy=True)) if torch.is_tensor(value)
                else copy.deepcopy(value) for name, value in moments.items()}
        for param, moments in kept.items()
    }


def _load_moments_in_place(optimizer: torch.optim.Optimizer, kept: dict) -> bool:
    """Copy a task's kept moments into the optimiser's own state tensors, as `load_state_dict` would
    load them but with no new tensor (non-blocking: from pinned memory the copies queue behind the
    work that last used those tensors). False, with nothing changed, when the optimiser does not hold
    state of the same parameters, names, shapes and dtypes (fresh moments, or restored at a sync)."""
    params = list(dict.fromkeys(p for group in optimizer.param_groups for p in group["params"]))  # state_dict's indices
    if len(optimizer.state) != len(kept):
        return False
    targets = []
    for index, moments in kept.items():
        own = optimizer.state.get(params[index]) if 0 <= index < len(params) else None
        if not own or own.keys() != moments.keys():
            return False
        for name, value in moments.items():
            target = own[name]
            if not (torch.is_tensor(value) and torch.is_tensor(target) and target.shape == value.shape
                    and target.dtype == value.dtype):
                return False
            targets.append((target, value))
    with torch.no_grad():
        for target, value in targets:
            target.copy_(value, non_blocking=True)
    return True


def _logging_due(every: int, step: int) -> bool:
    """Whether process step `step` (0-based) ends a logging interval (Trainer.log_every_n_steps;
    0: never, only segment ends)."""
    return every > 0 and (step + 1) % every == 0


class MimaSyncCallback(Callback):
    """Averaging phases, optimiser resets, diagnostics and final checkpoints for MimaModule.

    Owns the process's PhaseState (`phases`): made here, changed here, restored here; the other
    callbacks read it through `phase_view()`.

    Args:
        stop: the process's side of the stop protocol (default: one that never stops, for a plain
            Trainer that saves no state).
        before_sync: called before the process waits for the others at a sync (`mima fit` passes
            none: checkpoint writes go on through the sync, see mima.training.checkpoint_retention).
        sync_merge: the phase-end operator (default: the uniform average, MIMA itself).
        writer: the process's background writer, which writes the final task models off the training
            thread (`mima fit` passes the one its checkpoints use, so a state that refers to a final
            file is never on disk before it; default: one of this callback's own). The run ends once
            they are on disk (on_train_end waits for them).
    """

    def __init__(self, stop: StopAgreement | None = None, before_sync: Callable[[], None] | None = None,
                 sync_merge: SyncMerge | None = None, writer: BackgroundWriter | None = None) -> None:
        self.phases = PhaseState()
        self.view = PhaseView(self.phases, owner=self)
        self.writer = writer if writer is not None else BackgroundWriter()
        self.owns_writer = writer is None  # closed here at the end; a given one, by whoever gave it
        self.stop = stop
        self.before_sync = before_sync
        self.sync_merge = sync_merge if sync_merge is not None else SyncMerge()
        self.watch = StepWatch()
        self.clock = StepClock()  # this process's step time, for how long a sync waits (sync_deadline)
        self.resumed_phase: int | None = None  # the phase a resumed process started in (its sync waits longer)
        # the slot whose kept moments the optimiser holds as they were kept (at that slot's segment end)
        self.optimizer_holds: int | None = None

    def phase_view(self) -> PhaseView:
        """What the other callbacks read of the phase state (mima.training.phase_view); each checks in
        its `setup` that it comes after this callback."""
        return self.view

    # ----------------------------------------------------------------------------- start
    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        """The phase state of the saved state resumed (the part of mima's section MimaCheckpoint writes)."""
        saved = checkpoint.get("mima")
        if saved is not None:
            self.phases.load_state_dict(saved["phase_state"])

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stop is None:
            self.stop = StopAgreement(Path(trainer.default_root_dir), enabled=False)
        encoder_state = pl_module.working_state(0)  # batched: every slot holds the same start
        device = pl_module.trained_parameters()[0].device
        phases = self.phases
        if phases.restored:
            phases.avg = {key: value.to(device) for key, value in phases.avg.items()}
            phases.outer_momentum = {key: value.to(device) for key, value in phases.outer_momentum.items()}
        else:
            phases.avg = {key: value.detach().clone() for key, value in encoder_state.items() if is_mergeable(value)}
        pl_module.phase_start = phases.avg  # the proximal term's anchor (model.proximal_mu)
        if trainer.is_global_zero:
            RunFolder(Path(trainer.default_root_dir)).write_pretrained(pl_module.theta_0)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.stop is not None:
            self.stop.report_failure(trainer.global_rank)
        try:  # the losses of the steps before the failure, as the loggers had them when read per step
            self._log_step_losses(trainer, pl_module)
        except Exception:  # a failed device cannot hand them over; the original error is the one to report
            pass
        try:  # a final task model queued before the failure is a finished task's: it reaches the disk
            self._finals_written()
        except Exception:
            pass

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Here, unlike in on_fit_start, Lightning has already restored the step counter and optimiser.
        if trainer.is_global_zero:
            RunFolder(Path(trainer.default_root_dir)).trim_phase_records(self.phases.avg_phase + 1)
        plan = pl_module.plan
        # batched (model.batch_tasks): the kept moments stay in the stacked optimiser, no host copy
        keeps_moments = pl_module.hparams.optimizer_state == "keep" and plan.iterations > 1 and not plan.batched
        self.phases.reserve(len(plan.local_tasks), pl_module.working_state(0),
                            adamw_moment_specs(trainer.optimizers[0]) if keeps_moments else None)
        if self.phases.restored:
            self.clock.saved = self.phases.step_seconds
            self.resumed_phase = plan.phase_of(min(trainer.global_step, plan.local_steps - 1))
        if self.phases.pending_sync:
            step = trainer.global_step - 1
            self.resumed_phase = plan.phase_of(step)
            if not self._sync(trainer, pl_module, plan.phase_of(step), step + 1, resumed=True):
                if self.stop.divergence is None:
                    raise MimaError("a stop was requested again before the resumed run's first sync; resume with --ckpt_path last")
                # a process that resumed mid-phase diverged: this one stops with the others, as it resumed

    # ------------------------------------------------------------------------ each step
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.watch.batch_starts(trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any,
                           batch_idx: int) -> None:
        plan = pl_module.plan
        stepped = self.watch.stepped(trainer.global_step)
        # the step this (micro-)batch belongs to; global_step counts it only once the optimiser stepped
        step = trainer.global_step - 1 if stepped else trainer.global_step
        positions = plan.positions(step)  # batched: one per local slot, all at the same task step
        # divided by the micro-batch count; with a proximal term (model.proximal_mu) the task's loss without it
        loss = outputs.get("task_loss", outputs["loss"]) if isinstance(outputs, dict) else outputs
        # kept on the device: the host reads losses only where it waits for the device anyway
        self.phases.step_losses.add_micro_batch(loss)
        if not stepped:
            return
        self.clock.step_ended(time.monotonic())
        if plan.batched:
            self.phases.step_losses.end_batched_step(step, len(positions))
        else:
            self.phases.step_losses.end_step(step, positions[0].slot)
        ends_segment = plan.ends_segment(step)
        if ends_segment or _logging_due(trainer.log_every_n_steps, step):
            self._log_step_losses(trainer, pl_module)
        if self._stop_if_diverged(trainer, pl_module) or not ends_segment:
            return
        if self._segment_end_diverged(trainer, pl_module, step, positions):
            return  # nothing of it is kept, averaged or written
        self.phases.step_seconds = self.clock.median()  # saved with the state (a resumed sync's wait)
        for position in positions:
            self._end_segment(trainer, pl_module, position)
        if plan.ends_phase(step):
            self._sync(trainer, pl_module, positions[-1].phase, step + 1)
        else:
            self._load_into_encoder(pl_module, self.phases.avg)
            self._prepare_optimizer(trainer, pl_module, next_slot=positions[-1].slot + 1)
        self.clock.restart(time.monotonic())

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        # Under clipping, a step whose gradient norm is NaN or inf diverges (the clipped gradients
        # are NaN). Not with a gradient scaler (16-mixed): it skips such steps itself.
        if not trainer.gradient_clip_val or getattr(trainer.precision_plugin, "scaler", None) is not None:
            return
        if pl_module.plan.batched:  # each task's own norm, as clip_per_task computes it: [L]
            self.phases.step_losses.add_grad_norm(per_task_norms(pl_module.trained_parameters()))
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads:  # the norm clipping computes too, kept on the device with the step's loss
            self.phases.step_losses.add_grad_norm(torch.nn.utils.get_total_norm(grads))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_step_losses(trainer, pl_module)  # a run stopped inside a segment: its last steps' losses
        self._finals_written()

    def _finals_written(self) -> None:
        """Wait until the final task models queued so far are on disk (the run ends with them)."""
        if self.owns_writer:
            self.writer.close()
        else:
            self.writer.flush()

    def _sync(self, trainer, pl_module, phase: int, global_step: int, resumed: bool = False) -> bool:
        """Agree with the other processes, then average; False (sync left pending) on a stop.
        `resumed`: the pending sync of a resumed run, run from on_train_start."""
        if self.before_sync is not None:
            self.before_sync()
        plan = pl_module.plan
        lag = lag_steps(pl_module.layout, plan.task_lengths, phase, resumed_in_phase=phase == self.resumed_phase)
        if not self.stop.at_sync(phase, sync_allowance_s(lag, self.clock.median())):
            self.phases.pending_sync = True
            if self.stop.divergence is not None:  # another process diverged: stop here (the checkpoint saves)
                trainer.should_stop = True
            return False
        self.phases.pending_sync = False
        if self.stop.waits:
            for logger in trainer.loggers:
                logger.log_metrics({"sync/wait_s": self.stop.waits[-1]}, step=global_step - 1)
        self._end_phase(trainer, pl_module, phase, global_step, resumed)
        self._load_into_encoder(pl_module, self.phases.avg)
        self._prepare_optimizer(trainer, pl_module, next_slot=0)
        return True

    def _stop_if_diverged(self, trainer, pl_module) -> bool:
        """True once this process has diverged: a step loss (or gradient norm) read so far is NaN or
        inf. The first such step is reported (mima.training.divergence) and the run stops after
        this step."""
        if self.stop is not None and self.stop.diverged_here:
            return True
        bad = self.phases.nonfinite
        if bad is None:
            return False
        plan = pl_module.plan
        self._diverge(trainer, pl_module, plan.tasks[plan.local_tasks[bad.slot]], bad.nonfinite_part(), bad.step)
        return True

    def _segment_end_diverged(self, trainer, pl_module, step: int, positions) -> bool:
        """Whether the weights (or the kept moments) the task segments ending here end with hold a NaN
        or inf, checked before they are kept, averaged or written to final/; if so the run stops."""
        plan = pl_module.plan
        for position in positions:
            key = nonfinite_key(pl_module.working_state(position.slot))
            if key is not None:
                self._diverge(trainer, pl_module, plan.tasks[position.task_index], f"non-finite weights ({key})", step)
                return True
        key = None
        if pl_module.hparams.optimizer_state == "keep":
            key = nonfinite_key(trainer.optimizers[0].state_dict()["state"])
        if key is None:
            return False
        tasks = "+".join(plan.tasks[position.task_index] for position in positions)  # batched: one optimiser for all
        self._diverge(trainer, pl_module, tasks, f"non-finite optimiser moments ({key})", step)
        return True

    def _diverge(self, trainer, pl_module, task: str, what: str, step: int) -> None:
        """Tell the others (the stop protocol) and stop after this step, before the phase's sync."""
        plan = pl_module.plan
        phase = plan.phase_of(trainer.global_step - 1)  # the phase of the step that just ended
        report = divergence_report(task, what, step, trainer.global_rank, trainer.world_size)
        self.stop.diverge(phase, report)
        trainer.should_stop = True

    def _log_step_losses(self, trainer, pl_module) -> None:
        """Each step's loss under train/loss/<task> and learning rate under train/lr/<task>, written by
        every process (RankCSVLogger) for its own tasks, one row per step; read from the device here, at
        logging intervals and segment ends."""
        plan = pl_module.plan
        rows = self.phases.take_unlogged()
        for row in rows:
            task = plan.tasks[plan.local_tasks[row.slot]]
            for logger in trainer.loggers:
                logger.log_metrics({f"train/loss/{task}": row.value, f"train/lr/{task}": pl_module.learning_rate(row.step)},
                                   step=row.step)
        if rows:
            self.phases.shown_loss = rows[-1].value

    def _end_segment(self, trainer, pl_module, position) -> None:
        """Keep the task's end weights and (optimizer_state: keep) its moments, copied into the slot's
        reused host buffers; the optimiser still holds the moments, for the slot's next segment when
        it comes next (a process with one task)."""
        plan, phases = pl_module.plan, self.phases
        last_phase = position.phase == plan.iterations - 1
        phases.keep_segment_end(position.slot, position.phase, pl_module.working_state(position.slot))
        self.optimizer_holds = None
        if plan.batched:
            pass  # the stacked optimiser holds every task's moments, sliced by task: nothing to keep apart
        elif last_phase:
            phases.forget_moments(position.slot)  # the task has no later segment to resume
        elif pl_module.hparams.optimizer_state == "keep":
            phases.keep_moments(position.slot, position.phase, trainer.optimizers[0].state_dict()["state"])
            self.optimizer_holds = position.slot
        if last_phase and pl_module.layout.is_leader(trainer.global_rank):
            self._save_final(trainer, pl_module, position.task_index, position.slot)

    def _end_phase(self, trainer, pl_module, phase: int, global_step: int, resumed: bool = False) -> None:
        plan, layout = pl_module.plan, pl_module.layout
        keys = list(self.phases.avg)
        diagnostic_keys = pl_module.trained_names()
        local_states = [self.phases.segment_ends[slot] for slot in range(len(plan.local_tasks))]
        device = pl_module.trained_parameters()[0].device
        merge = self.sync_merge
        result = average_phase(local_states, keys, layout, pl_module.theta_0, self.phases.avg, diagnostic_keys, device,
                               keep_tasks=merge.keeps_tasks, host=self.phases.host)
        if merge.is_uniform:
            self.phases.avg = result.average  # on the device already
        elif merge.outer is not None:  # new tensors: a checkpoint writer may still read the old ones
            self.phases.avg, self.phases.outer_momentum = merge.outer.step(self.phases.avg, result.average,
                                                                           self.phases.outer_momentum)
        else:  # a tensor of the merge may be one of its inputs: the host buffers refilled at the next sync
            merged = merge.apply(result.task_states, pl_module.theta_0)
            self.phases.avg = {key: value.to(device, copy=True) for key, value in merged.items()}
        pl_module.phase_start = self.phases.avg
        self.phases.avg_phase = phase
        length = plan.lengths[phase]
        mean_losses = {plan.local_tasks[slot]: total / plan.phase_length(plan.local_tasks[slot], phase)
                       for slot, total in self.phases.loss_sums.items()}
        losses = gather_task_values(mean_losses, layout)
        waits = gather_task_values({trainer.global_rank: self.stop.waits[-1] if self.stop.waits else 0.0}, layout)
        cos_tau, cos_delta = cosine_from_gram(result.gram_tau), cosine_from_gram(result.gram_delta)
        record = {
            "phase": phase + 1,
            "step": plan.task_steps_before(phase + 1, _longest(plan)),  # each task's steps so far (the longest task's)
            "K": length,  # this phase's steps per task (the longest task's)
            "global_step": global_step,
            "tasks": list(plan.tasks),
            "mean_cos_tau": mean_off_diagonal(cos_tau),
            "mean_cos_delta": mean_off_diagonal(cos_delta),
            "cos_tau": cos_tau.tolist(),
            "cos_delta": cos_delta.tolist(),
            "loss": {plan.tasks[task]: value for task, value in losses.items()},
            "wait_s": [round(waits[rank], 4) for rank in sorted(waits)],  # per process, before this sync
        }
        if not plan.uniform:  # per-task budgets: each task's S_t, its steps so far and this phase's K_t
            indices = range(plan.num_tasks)
            record["budgets"] = {plan.tasks[t]: plan.budget(t) for t in indices}
            record["task_steps"] = {plan.tasks[t]: plan.task_steps_before(phase + 1, t) for t in indices}
            record["task_K"] = {plan.tasks[t]: plan.phase_length(t, phase) for t in indices}
        diagnostics = {"mima/mean_cos_tau": record["mean_cos_tau"], "mima/mean_cos_delta": record["mean_cos_delta"]}
        if resumed:  # Lightning refuses self.log in on_train_start: straight to the loggers
            for logger in trainer.loggers:
                logger.log_metrics(diagnostics, step=global_step - 1)
        else:
            for name, value in diagnostics.items():
                pl_module.log(name, value, on_step=True, on_epoch=False)
        if trainer.is_global_zero:
            RunFolder(Path(trainer.default_root_dir)).append_phase_record(record)
        self.phases.segment_ends.clear()
        self.phases.loss_sums.clear()

    # ------------------------------------------------------------------------- helpers
    @staticmethod
    def _load_into_encoder(pl_module, state: StateDict) -> None:
        pl_module.load_working(state)  # batched: into every slot of the stack

    def _prepare_optimizer(self, trainer, pl_module, next_slot: int) -> None:
        """Each segment is a fresh fine-tune from `avg`: new moments, or the next task's own ones.
        Those are already in the optimiser when the next segment is the task that just ran (a process
        with one task keeps its moments there); another task's are copied into the optimiser's own
        tensors, or loaded where it holds none of the same layout."""
        optimizer = trainer.optimizers[0]
        if pl_module.plan.batched:  # the stacked moments: kept where they are, or reset for every task at once
            if pl_module.hparams.optimizer_state != "keep":
                optimizer.state.clear()
            return
        kept = self.phases.task_moments.get(next_slot) if pl_module.hparams.optimizer_state == "keep" else None
        holds, self.optimizer_holds = self.optimizer_holds, None
        if kept is None:
            optimizer.state.clear()
        elif holds != next_slot and not _load_moments_in_place(optimizer, kept):
            optimizer.state.clear()
            groups = optimizer.state_dict()["param_groups"]  # keep the scheduler's current lr
            device = optimizer.param_groups[0]["params"][0].device
            optimizer.load_state_dict({"state": _moments_for_optimizer(kept, device), "param_groups": groups})

    def _save_final(self, trainer, pl_module, task_index: int, slot: int) -> None:
        """Queue the task's final model (the slot's end weights, in their host buffer) on the writer:
        its thread waits for the copies from the device, then writes; the buffer is not refilled
        before that (HostBuffers.hold)."""
        plan, tasks = pl_module.plan, pl_module.tasks
        host, weights = self.phases.host, self.phases.segment_ends[slot]
        lengths = plan.task_lengths[task_index]
        metadata = {
            "task": plan.tasks[task_index],
            "N": plan.iterations,
            "K": lengths[0] if len(set(lengths)) == 1 else list(lengths),  # this task's steps per phase
            "S": plan.budget(task_index),  # this task's budget S_t
            "seed": tasks.seed,
            "tasks": list(plan.tasks),
            "world_size": pl_module.layout.world_size,
            "config": {"model": dict(pl_module.hparams), "data": tasks.settings},
        }
        if not plan.uniform:
            metadata["budgets"] = {name: plan.budget(t) for t, name in enumerate(plan.tasks)}
        run, task, copied = RunFolder(Path(trainer.default_root_dir)), plan.tasks[task_index], host.ready()

        def write() -> None:
            copied()
            run.write_final(task, weights, metadata)

        self.writer.submit_call([run.final_file(task), run.final_metadata_file(task)], write)
        writer, written = self.writer, self.writer.submitted
        host.hold(("segment", slot), lambda: writer.wait_for_job(written))


def _longest(plan) -> int:
    """The run task with the largest budget (the first of them): the one whose steps metrics.jsonl counts."""
    return max(range(plan.num_tasks), key=plan.budget)
