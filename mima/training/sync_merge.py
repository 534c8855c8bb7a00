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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from mima.core.errors import MimaError
from mima.merging import get_method

UNIFORM = "uniform"
StateDict = dict[str, torch.Tensor]


class SyncMerge:
    """The configured phase-end merge, checked when it is built (before any training)."""

    def __init__(self, name: str = UNIFORM, args: Mapping[str, object] | None = None, num_tasks: int | None = None) -> None:
        self.name = name
        self.args = dict(args or {})
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

    def apply(self, task_states: Sequence[Mapping[str, torch.Tensor]], theta_0: Mapping[str, torch.Tensor]) -> StateDict:
        """The merge of the tasks' end weights (in task order) with theta_0 as the base, on the CPU."""
        base = {key: theta_0[key].detach().to("cpu") for key in task_states[0]}
        merged = self.method.merge(list(task_states), base, **self.args).state
        return {key: merged[key].to(task_states[0][key].dtype) for key in task_states[0]}
