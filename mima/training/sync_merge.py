"""The phase-end operator: which merge turns the tasks' end weights into the next phase's start.

MIMA restarts every phase from the uniform average of the task models (`model.sync_merge:
uniform`, the default, computed by mima.training.averaging while it gathers the weights). Any
data-free merge of mima.merging can take its place, with theta_0 as its base:

    avg^(i) = Merge(theta_0; theta_1^(i), ..., theta_T^(i))      (SPEC 2.1, generalisations)

e.g. `sync_merge: task_arithmetic` with `sync_merge_args: {lam: 0.3}` is ATM, "Alternating Tuning
and Merging" (arXiv 2411.03055): each phase restarts from a task-arithmetic merge. Every process
gathers all T end weights in task order (on the CPU) and computes the same merge from them, so the
result is the same bit for bit at any number of processes, and after a resume.

Merges that learn from task data (AdaMerging, Fisher, ...) or keep one model per task (TALL masks)
have no place at the sync and are refused before training, in one line.

`outer_nesterov` is DiLoCo's outer optimiser (arXiv 2311.08105), which has state and so lives here,
not in mima.merging: with theta_s the phase's start point and avg the uniform average of the
phase's end weights, the pseudo-gradient g = theta_s - avg is stepped by SGD with Nesterov
momentum (torch.optim.SGD(nesterov=True) semantics, written out as tensor arithmetic):

    m <- mu_o m + g   (m = g at the first sync)      theta_next = theta_s - lr_o (g + mu_o m)

With lr_o = 1 and mu_o = 0 this is the average itself, up to rounding (theta_s - (theta_s - avg)).
The momentum m is the same on every process (computed from the same bits) and is saved in the
checkpoints (mima.training.phase_state.PhaseState.outer_momentum), so a resume goes on with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from mima.config.options import check_value
from mima.core.errors import MimaError
from mima.merging import get_method

UNIFORM = "uniform"
OUTER_NESTEROV = "outer_nesterov"
OUTER_DEFAULTS = {"outer_lr": 0.7, "outer_momentum": 0.9}  # DiLoCo's outer Nesterov (arXiv 2311.08105)
StateDict = dict[str, torch.Tensor]


def outer_nesterov_step(start: Mapping[str, torch.Tensor], average: Mapping[str, torch.Tensor],
                        momentum: Mapping[str, torch.Tensor], lr: float,
                        momentum_factor: float) -> tuple[StateDict, StateDict]:
    """The next phase's start point and momentum (see the module docstring): new tensors, never the
    inputs changed in place (a checkpoint writer may still be reading the old ones). The arithmetic is
    torch.optim.SGD's (nesterov=True, dampening 0), op for op, in float32 or wider; `momentum` empty:
    the first step (the buffer starts as the pseudo-gradient). With momentum_factor 0 no buffer is kept,
    as SGD keeps none."""
    next_start: StateDict = {}
    next_momentum: StateDict = {}
    for key, begin in start.items():
        wide = torch.promote_types(begin.dtype, torch.float32)
        pseudo_gradient = begin.to(wide) - average[key].to(wide)
        update = pseudo_gradient
        if momentum_factor != 0:
            kept = momentum.get(key)
            buffer = pseudo_gradient.clone() if kept is None else kept.mul(momentum_factor).add_(pseudo_gradient)
            update = pseudo_gradient.add(buffer, alpha=momentum_factor)
            next_momentum[key] = buffer
        next_start[key] = begin.to(wide).add(update, alpha=-lr).to(begin.dtype)
    return next_start, next_momentum


class OuterNesterov:
    """DiLoCo's outer step with its two options (model.sync_merge_args: outer_lr, outer_momentum)."""

    def __init__(self, args: Mapping[str, object]) -> None:
        unknown = sorted(set(args) - set(OUTER_DEFAULTS))
        if unknown:
            raise MimaError(f"model.sync_merge_args: {OUTER_NESTEROV} takes {', '.join(OUTER_DEFAULTS)}, got {unknown}")
        values = {**OUTER_DEFAULTS, **args}
        for name, value in values.items():
            check_value(f"model.sync_merge_args.{name}", value)  # its type and range, in one line
        self.lr = float(values["outer_lr"])
        self.momentum = float(values["outer_momentum"])

    def step(self, start: Mapping[str, torch.Tensor], average: Mapping[str, torch.Tensor],
             momentum: Mapping[str, torch.Tensor]) -> tuple[StateDict, StateDict]:
        return outer_nesterov_step(start, average, momentum, self.lr, self.momentum)


class SyncMerge:
    """The configured phase-end merge, checked when it is built (before any training)."""

    def __init__(self, name: str = UNIFORM, args: Mapping[str, object] | None = None, num_tasks: int | None = None) -> None:
        self.name = name
        self.args = dict(args or {})
        self.outer: OuterNesterov | None = None
        if name == OUTER_NESTEROV:  # an optimiser with state, not a merge: the average is its input
            self.outer = OuterNesterov(self.args)
            self.method = None
            return
        try:
            self.method = get_method(name)
        except MimaError as error:
            raise MimaError(f"model.sync_merge: {error}") from None
        if self.method.needs_data:
            raise MimaError(f"model.sync_merge: '{name}' learns from task data; the sync takes data-free merges "
                            "(e.g. uniform, task_arithmetic, ties)")
        if self.method.per_task:
            raise MimaError(f"model.sync_merge: '{name}' keeps one model per task; the sync needs one model")
        if self.is_uniform and self.args:
            raise MimaError(f"model.sync_merge_args: uniform takes no hyperparameters, got {sorted(self.args)}")
        try:
            self.method.hyperparameters(self.args)  # unknown names and bad values: one line, now
        except MimaError as error:
            raise MimaError(f"model.sync_merge_args: {error}") from None
        # the average (computed while gathering) is defined for one task too; other merges need their minimum
        if not self.is_uniform and num_tasks is not None and num_tasks < self.method.min_models:
            raise MimaError(f"model.sync_merge: '{name}' needs at least {self.method.min_models} tasks, the run has {num_tasks}")

    @property
    def is_uniform(self) -> bool:
        """The average itself: computed while gathering (mima.training.averaging), nothing to add."""
        return self.name == UNIFORM

    @property
    def keeps_tasks(self) -> bool:
        """Whether the sync must gather every task's end weights (a merge of mima.merging); the
        average and the outer step need only the average."""
        return not self.is_uniform and self.outer is None

    def apply(self, task_states: Sequence[Mapping[str, torch.Tensor]], theta_0: Mapping[str, torch.Tensor]) -> StateDict:
        """The merge of the tasks' end weights (in task order) with theta_0 as the base, on the CPU."""
        base = {key: theta_0[key].detach().to("cpu") for key in task_states[0]}
        merged = self.method.merge(list(task_states), base, **self.args).state
        return {key: merged[key].to(task_states[0][key].dtype) for key in task_states[0]}
