"""The MIMA synchronisation callback: ends task segments and phases.

At the end of each task segment (K steps of one task) the callback keeps the task's end weights
(on the CPU) and restarts the working encoder from the phase's start point `avg` for the next
task of the process. At the end of each phase all processes average their tasks' end weights
(every floating tensor: parameters and buffers such as BatchNorm statistics; see
mima.training.averaging), load the average, reset the optimiser moments as configured, and log the
alignment diagnostics of paper 001: pairwise cosines of the task vectors tau_t = theta_t - theta_0
and of the phase updates delta_t = theta_t - avg_previous, over all tasks. In the last phase each
task's end weights are the run's final task checkpoint.

Device memory: the working encoder and `avg`; the end weights of the process's own tasks live on
the CPU until the phase ends, and so do the kept AdamW moments of its tasks that are not running
(`optimizer_state: keep`; host memory 2 encoder sizes per task of the process). Everything needed to resume mid-phase is in `state_dict()`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from mima.core.run_folder import RunFolder
from mima.core.state_dicts import cosine_from_gram, is_mergeable, mean_off_diagonal
from mima.training.averaging import average_phase, gather_task_values

StateDict = dict[str, torch.Tensor]


def _cpu_copy(state: StateDict) -> StateDict:
    return {key: value.detach().to("cpu", copy=True) for key, value in state.items()}


def _moments_to_cpu(optimizer_state: dict) -> dict:
    """A copy of an optimiser's per-parameter state with every tensor on the CPU: with several
    tasks per process only the running task's moments stay on the device (2 encoder-sized buffers),
    the others wait in host memory; `Optimizer.load_state_dict` moves them back."""
    return {
        param: {name: value.detach().to("cpu", copy=True) if torch.is_tensor(value) else copy.deepcopy(value)
                for name, value in moments.items()}
        for param, moments in optimizer_state.items()
    }


class MimaSyncCallback(Callback):
    """Averaging phases, optimiser resets, diagnostics and final checkpoints for MimaModule."""

    def __init__(self) -> None:
        self.avg: StateDict = {}  # the current phase's start point (device)
        self.segment_ends: dict[int, StateDict] = {}  # slot -> this phase's end weights (CPU)
        self.loss_sums: dict[int, float] = {}
        self.step_loss = 0.0  # the running step's loss, summed over its micro-batches
        self.task_moments: dict[int, dict] = {}  # slot -> AdamW state (CPU), for optimizer_state="keep"
        self._restored = False

    # ----------------------------------------------------------------------------- start
    def on_fit_start(self, trainer, pl_module) -> None:
        encoder_state = pl_module.encoder.state_dict()
        device = next(pl_module.encoder.parameters()).device
        if self._restored:
            self.avg = {key: value.to(device) for key, value in self.avg.items()}
        else:
            self.avg = {key: value.detach().clone() for key, value in encoder_state.items() if is_mergeable(value)}
        if trainer.is_global_zero:
            RunFolder(Path(trainer.default_root_dir)).write_pretrained(pl_module.theta_0)

    def on_train_start(self, trainer, pl_module) -> None:
        # Here, unlike in on_fit_start, Lightning has already restored the step counter.
        if trainer.is_global_zero:
            RunFolder(Path(trainer.default_root_dir)).trim_phase_records(trainer.global_step)

    # ------------------------------------------------------------------------ each step
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        plan = pl_module.plan
        # the step this (micro-)batch belongs to; global_step counts it only once the optimiser stepped
        step = trainer.global_step - 1 if pl_module.stepped else trainer.global_step
        position = plan.position(step)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs  # divided by the micro-batch count
        self.step_loss += float(loss)
        if not pl_module.stepped:
            return
        self.loss_sums[position.slot] = self.loss_sums.get(position.slot, 0.0) + self.step_loss
        self._log_step_loss(trainer, plan.tasks[position.task_index], step)
        if not plan.ends_segment(step):
            return
        self._end_segment(trainer, pl_module, position)
        if plan.ends_phase(step):
            self._end_phase(trainer, pl_module, position.phase, step + 1)
        self._load_into_encoder(pl_module, self.avg)
        self._prepare_optimizer(trainer, pl_module, next_slot=(position.slot + 1) % len(plan.local_tasks))

    def _log_step_loss(self, trainer, task: str, step: int) -> None:
        """The step's loss under train/loss/<task>, written by every process (RankCSVLogger) for its
        own tasks, one row per step."""
        for logger in trainer.loggers:
            logger.log_metrics({f"train/loss/{task}": self.step_loss}, step=step)
        self.step_loss = 0.0

    def _end_segment(self, trainer, pl_module, position) -> None:
        plan = pl_module.plan
        self.segment_ends[position.slot] = _cpu_copy(pl_module.encoder.state_dict())
        if pl_module.hparams.optimizer_state == "keep":
            self.task_moments[position.slot] = _moments_to_cpu(trainer.optimizers[0].state_dict()["state"])
        is_leader = pl_module.layout.is_leader(trainer.global_rank)
        if position.phase == plan.iterations - 1 and is_leader:
            self._save_final(trainer, pl_module, plan.tasks[position.task_index], self.segment_ends[position.slot])

    def _end_phase(self, trainer, pl_module, phase: int, global_step: int) -> None:
        plan, layout = pl_module.plan, pl_module.layout
        keys = list(self.avg)
        diagnostic_keys = {name for name, p in pl_module.encoder.named_parameters() if p.requires_grad}
        local_states = [self.segment_ends[slot] for slot in range(len(plan.local_tasks))]
        device = next(pl_module.encoder.parameters()).device
        result = average_phase(local_states, keys, layout, pl_module.theta_0, self.avg, diagnostic_keys, device)
        self.avg = {key: value.to(device) for key, value in result.average.items()}
        mean_losses = {plan.local_tasks[slot]: total / plan.steps_per_phase for slot, total in self.loss_sums.items()}
        losses = gather_task_values(mean_losses, layout)
        cos_tau, cos_delta = cosine_from_gram(result.gram_tau), cosine_from_gram(result.gram_delta)
        record = {
            "phase": phase + 1,
            "step": (phase + 1) * plan.steps_per_phase,
            "global_step": global_step,
            "tasks": list(plan.tasks),
            "mean_cos_tau": mean_off_diagonal(cos_tau),
            "mean_cos_delta": mean_off_diagonal(cos_delta),
            "cos_tau": cos_tau.tolist(),
            "cos_delta": cos_delta.tolist(),
            "loss": {plan.tasks[task]: value for task, value in losses.items()},
        }
        pl_module.log("mima/mean_cos_tau", record["mean_cos_tau"], on_step=True, on_epoch=False)
        pl_module.log("mima/mean_cos_delta", record["mean_cos_delta"], on_step=True, on_epoch=False)
        if trainer.is_global_zero:
            RunFolder(Path(trainer.default_root_dir)).append_phase_record(record)
        self.segment_ends.clear()
        self.loss_sums.clear()

    # ------------------------------------------------------------------------- helpers
    @staticmethod
    def _load_into_encoder(pl_module, state: StateDict) -> None:
        current = pl_module.encoder.state_dict()
        with torch.no_grad():
            for key, value in state.items():
                current[key].copy_(value)

    def _prepare_optimizer(self, trainer, pl_module, next_slot: int) -> None:
        """Each segment is a fresh fine-tune from `avg`: new moments, or the next task's own ones."""
        optimizer = trainer.optimizers[0]
        optimizer.state.clear()
        if pl_module.hparams.optimizer_state == "keep" and next_slot in self.task_moments:
            groups = optimizer.state_dict()["param_groups"]  # keep the scheduler's current lr
            optimizer.load_state_dict({"state": self.task_moments[next_slot], "param_groups": groups})

    def _save_final(self, trainer, pl_module, task: str, weights: StateDict) -> None:
        plan, tasks = pl_module.plan, pl_module.tasks
        metadata = {
            "task": task,
            "N": plan.iterations,
            "K": plan.steps_per_phase,
            "S": plan.total_steps,
            "seed": tasks.seed,
            "tasks": list(plan.tasks),
            "world_size": pl_module.layout.world_size,
            "config": {"model": dict(pl_module.hparams), "data": tasks.settings},
        }
        RunFolder(Path(trainer.default_root_dir)).write_final(task, weights, metadata)

    # --------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        return {
            "avg": _cpu_copy(self.avg),
            "segment_ends": self.segment_ends,
            "loss_sums": dict(self.loss_sums),
            "task_moments": self.task_moments,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.avg = state_dict["avg"]
        self.segment_ends = {int(slot): state for slot, state in state_dict["segment_ends"].items()}
        self.loss_sums = {int(slot): value for slot, value in state_dict["loss_sums"].items()}
        self.task_moments = {int(slot): state for slot, state in state_dict["task_moments"].items()}
        self._restored = True
