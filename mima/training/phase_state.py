"""Where one process stands in MIMA's phases: the one owner of that state.

`PhaseState` holds what a process carries from one task segment to the next and across a sync:
the phase's start point `avg`, each of its task slots' end weights of the running phase, the
kept AdamW moments (`optimizer_state: keep`), the per-slot loss sums, and whether a sync is
pending (a stop came at a sync, before it ran). `mima fit` makes one per process and hands it to
the two callbacks that need it: MimaSyncCallback changes it, MimaCheckpoint only serialises and
restores it. Neither callback reads the other.

`StepWatch` tells a callback whether the batch that just ended also ended an optimiser step (with
`trainer.accumulate_grad_batches` > 1 most batches only accumulate gradients); each callback keeps
its own, from the public step counter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mima.core.plan import PhasePlan

StateDict = dict[str, torch.Tensor]
Moments = dict[int, dict]  # an optimiser's per-parameter state: {param: {"step", "exp_avg", "exp_avg_sq"}}


@dataclass(frozen=True)
class StepLoss:
    """One optimiser step's loss as the host reads it: the sum of its micro-batches' losses."""

    step: int
    slot: int
    value: float


class StepLosses:
    """The losses of the steps the host has not read yet, kept as device tensors (one per
    micro-batch), and read all at once by `settle` with a single device-to-host copy."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, int, list[torch.Tensor]]] = []  # (step, slot, micro-batch losses)
        self.micro_batches: list[torch.Tensor] = []  # of the running step

    def add_micro_batch(self, loss: torch.Tensor) -> None:
        self.micro_batches.append(loss.detach())

    def end_step(self, step: int, slot: int) -> None:
        self.pending.append((step, slot, self.micro_batches))
        self.micro_batches = []

    def settle(self) -> list[StepLoss]:
        """The pending steps' losses as floats. Summed on the host in float64, micro-batch by
        micro-batch, as `float(loss)` per micro-batch summed them: the logged values stay the same."""
        if not self.pending:
            return []
        flat = torch.stack([loss.float() for _, _, losses in self.pending for loss in losses]).tolist()
        settled, index = [], 0
        for step, slot, losses in self.pending:
            total = 0.0
            for value in flat[index:index + len(losses)]:
                total += value
            index += len(losses)
            settled.append(StepLoss(step, slot, total))
        self.pending = []
        return settled


@dataclass
class PhaseState:
    avg: StateDict = field(default_factory=dict)  # the running phase's start point (on the device)
    avg_phase: int = -1  # `avg` is the average after the sync ending this phase (-1: theta_0)
    segment_ends: dict[int, StateDict] = field(default_factory=dict)  # slot -> end weights (CPU)
    segment_phase: int = 0  # the phase `segment_ends` belong to
    task_moments: dict[int, Moments] = field(default_factory=dict)  # slot -> AdamW state (CPU)
    moments_phase: dict[int, int] = field(default_factory=dict)  # slot -> phase whose segment end they are
    loss_sums: dict[int, float] = field(default_factory=dict)  # slot -> summed step losses this phase (settled ones)
    step_losses: StepLosses = field(default_factory=StepLosses)  # on the device, not yet in loss_sums
    unlogged: list[StepLoss] = field(default_factory=list)  # settled, not yet written to the loggers
    pending_sync: bool = False  # stopped at a sync before entering it: run it first on resume
    step_seconds: float | None = None  # this process's median step time (how long its syncs wait; not the weights)
    restored: bool = False  # loaded from a checkpoint (not a fresh start)

    @property
    def completed_syncs(self) -> int:
        return self.avg_phase + 1

    def boundary(self, plan: PhasePlan, step: int) -> tuple[str | int, int | None] | None:
        """What the working encoder and optimiser hold before process step `step`, if they equal
        tensors of this state: ("avg", slot whose kept moments the optimiser holds, or None) at the
        start of a segment; (slot, None) at a pending sync (the last segment's end weights); None
        inside a segment."""
        if self.pending_sync:
            return len(plan.local_tasks) - 1, None
        if step >= plan.local_steps or not plan.position(step).starts_segment:
            return None
        slot = plan.position(step).slot
        return "avg", slot if slot in self.task_moments else None

    def settle_losses(self) -> None:
        """Read the pending step losses (one host-device synchronisation) into `loss_sums`; they
        wait in `unlogged` for the loggers."""
        for settled in self.step_losses.settle():
            self.loss_sums[settled.slot] = self.loss_sums.get(settled.slot, 0.0) + settled.value
            self.unlogged.append(settled)

    def take_unlogged(self) -> list[StepLoss]:
        """Every step loss not yet logged, settled, in step order; forgotten here."""
        self.settle_losses()
        rows, self.unlogged = self.unlogged, []
        return rows

    def state_dict(self) -> dict:
        """The tensors themselves (no copies): the checkpoint code stores each once as a file and
        keeps a reference; the phases say which file. A save is a synchronisation point anyway:
        the pending step losses are settled into `loss_sums` first (and logged later)."""
        self.settle_losses()
        return {
            "avg": self.avg,
            "avg_phase": self.avg_phase,
            "segment_ends": dict(self.segment_ends),
            "segment_phase": self.segment_phase,
            "task_moments": dict(self.task_moments),
            "moments_phase": dict(self.moments_phase),
            "loss_sums": dict(self.loss_sums),
            "pending_sync": self.pending_sync,
            "step_seconds": self.step_seconds,
        }

    def load_state_dict(self, state: dict) -> None:
        self.avg = state["avg"]
        self.avg_phase = int(state["avg_phase"])
        self.segment_ends = {int(slot): weights for slot, weights in state["segment_ends"].items()}
        self.segment_phase = int(state["segment_phase"])
        self.loss_sums = {int(slot): value for slot, value in state["loss_sums"].items()}
        self.task_moments = {int(slot): moments for slot, moments in state["task_moments"].items()}
        self.moments_phase = {int(slot): int(phase) for slot, phase in state["moments_phase"].items()}
        self.pending_sync = bool(state["pending_sync"])
        self.step_seconds = state.get("step_seconds")  # absent in states saved before it was kept
        self.restored = True


class StepWatch:
    """Whether the batch that just ended stepped the optimiser: Lightning's step counter
    (`trainer.global_step`) counts optimiser steps, so it moved during the batch exactly then."""

    def __init__(self) -> None:
        self.steps_before = -1

    def batch_starts(self, global_step: int) -> None:
        self.steps_before = global_step

    def stepped(self, global_step: int) -> bool:
        return global_step != self.steps_before
