"""The MIMA synchronisation callback: ends task segments and phases.

At the end of each task segment (K steps of one task) the callback adds the task's weights to
the process's running sum and restarts the working encoder from the phase's start point `avg`
for the next task. At the end of each phase it turns the sum into the new average
(all-reduced across processes when torch.distributed is initialised), loads it, and logs the
alignment diagnostics of paper 001: mean pairwise cosine of the task vectors
tau_t = theta_t - theta_0 and of the incremental updates delta_t = theta_t - avg_previous.
In the last phase each task's end weights are the run's final task checkpoints.

Memory on the device: the working encoder, `avg` and one float32 running sum. The end weights of
the process's own tasks are copied to CPU for the diagnostics.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from mima.safetensors_io import save_state_dict, write_json_atomic
from mima.state_dicts import cosine_matrix, difference, is_mergeable, mean_off_diagonal

StateDict = dict[str, torch.Tensor]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class MimaSyncCallback(Callback):
    """Averaging phases, optimiser resets, diagnostics and final checkpoints for MimaModule."""

    def __init__(self) -> None:
        self.theta_0: StateDict = {}  # CPU
        self.avg: StateDict = {}  # device, the current phase's start point
        self.running_sum: StateDict = {}  # device, float32
        self.segment_ends: dict[int, StateDict] = {}  # slot -> CPU end weights of the current phase
        self.loss_sums: dict[int, float] = {}
        self.task_moments: dict[int, dict] = {}  # slot -> AdamW state, for optimizer_state="keep"
        self.param_keys: list[str] = []

    # ----------------------------------------------------------------------------- start
    def on_fit_start(self, trainer, pl_module) -> None:
        encoder_state = pl_module.encoder.state_dict()
        trainable = {name for name, p in pl_module.encoder.named_parameters() if p.requires_grad}
        self.param_keys = [key for key in encoder_state if key in trainable]
        self.theta_0 = {key: value.detach().to("cpu", copy=True) for key, value in encoder_state.items()}
        self.avg = {key: value.detach().clone() for key, value in encoder_state.items() if is_mergeable(value)}
        self.running_sum = {key: torch.zeros_like(value, dtype=torch.float32) for key, value in self.avg.items()}
        if trainer.is_global_zero:
            run_dir = Path(trainer.default_root_dir)
            if not (run_dir / "pretrained.safetensors").exists():
                save_state_dict(run_dir / "pretrained.safetensors", self.theta_0, metadata={"role": "theta_0"})

    # ------------------------------------------------------------------------ each step
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        plan = pl_module.plan
        step = trainer.global_step - 1  # the optimiser step that just finished
        position = plan.position(step)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.loss_sums[position.slot] = self.loss_sums.get(position.slot, 0.0) + float(loss)
        if not plan.ends_segment(step):
            return
        self._end_segment(trainer, pl_module, position)
        if plan.ends_phase(step):
            self._end_phase(trainer, pl_module, position.phase)
        self._load_into_encoder(pl_module, self.avg)
        self._prepare_optimizer(trainer, pl_module, next_slot=(position.slot + 1) % len(plan.local_tasks))

    def _end_segment(self, trainer, pl_module, position) -> None:
        plan = pl_module.plan
        end_state = {key: value.detach() for key, value in pl_module.encoder.state_dict().items()}
        with torch.no_grad():
            for key, total in self.running_sum.items():
                total += end_state[key]
        self.segment_ends[position.slot] = {key: value.to("cpu", copy=True) for key, value in end_state.items()}
        if pl_module.hparams.optimizer_state == "keep":
            self.task_moments[position.slot] = copy.deepcopy(trainer.optimizers[0].state_dict()["state"])
        if position.phase == plan.iterations - 1:
            self._save_final(trainer, pl_module, plan.tasks[position.task_index], self.segment_ends[position.slot])

    def _end_phase(self, trainer, pl_module, phase: int) -> None:
        plan = pl_module.plan
        previous_avg = {key: value.to("cpu", copy=True) for key, value in self.avg.items()}
        with torch.no_grad():
            for key, total in self.running_sum.items():
                if _distributed():
                    dist.all_reduce(total)
                self.avg[key] = (total / plan.num_tasks).to(self.avg[key].dtype)
                total.zero_()
        record = self._diagnostics(pl_module, phase, previous_avg)
        pl_module.log("mima/mean_cos_tau", record["mean_cos_tau"], on_step=True, on_epoch=False)
        pl_module.log("mima/mean_cos_delta", record["mean_cos_delta"], on_step=True, on_epoch=False)
        if trainer.is_global_zero:
            with open(Path(trainer.default_root_dir) / "metrics.jsonl", "a") as stream:
                stream.write(json.dumps(record) + "\n")
        self.segment_ends.clear()
        self.loss_sums.clear()

    def _diagnostics(self, pl_module, phase: int, previous_avg: StateDict) -> dict:
        plan = pl_module.plan
        slots = sorted(self.segment_ends)
        ends = [self.segment_ends[slot] for slot in slots]
        taus = [difference(end, self.theta_0, self.param_keys) for end in ends]
        deltas = [difference(end, previous_avg, self.param_keys) for end in ends]
        cos_tau = cosine_matrix(taus, self.param_keys)
        cos_delta = cosine_matrix(deltas, self.param_keys)
        k = plan.steps_per_phase
        names = [plan.tasks[plan.local_tasks[slot]] for slot in slots]
        return {
            "phase": phase + 1,
            "step": (phase + 1) * k,
            "tasks": names,
            "mean_cos_tau": mean_off_diagonal(cos_tau),
            "mean_cos_delta": mean_off_diagonal(cos_delta),
            "cos_tau": cos_tau.tolist(),
            "cos_delta": cos_delta.tolist(),
            "loss": {name: self.loss_sums.get(slot, float("nan")) / k for name, slot in zip(names, slots)},
        }

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
        run_dir = Path(trainer.default_root_dir)
        plan = pl_module.plan
        datamodule = trainer.datamodule
        metadata = {
            "task": task,
            "N": plan.iterations,
            "K": plan.steps_per_phase,
            "S": plan.total_steps,
            "seed": int(datamodule.hparams.seed),
            "tasks": list(plan.tasks),
            "config": {"model": dict(pl_module.hparams), "data": dict(datamodule.hparams)},
        }
        save_state_dict(run_dir / "final" / f"{task}.safetensors", weights, metadata={"mima": metadata})
        write_json_atomic(run_dir / "final" / f"{task}.json", metadata)
