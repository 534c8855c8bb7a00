"""The averaging step of a MIMA phase, across processes.

Every process holds the end weights of its own tasks. For each tensor (one key at a time, so the
extra memory is T copies of the largest tensor, never T models) the task copies are all-gathered,
put in task order and summed in that fixed order (in float32, or wider for wider tensors). The
average is therefore the same bit for bit whatever the number of processes and however the tasks
are spread over them; an all-reduce of partial sums would round differently with every layout.
The same pass accumulates the Gram matrices of the task vectors tau_t = theta_t - theta_0 and of
the phase updates delta_t = theta_t - avg_previous (float32 products per tensor, summed over
tensors in float64), from which the cosine diagnostics follow.

The end weights wait in host buffers (mima.training.phase_state.HostBuffers; pinned on a GPU):
each task's copy of a tensor goes from there straight into its row on the device, a non-blocking
copy queued behind the one that filled the buffer, never through a stacked tensor in pageable
host memory. With one process on the CPU the buffers are read where they are.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mima.core.layout import TaskLayout
from mima.training.phase_state import HostArena, HostBuffers

StateDict = dict[str, torch.Tensor]


@dataclass
class PhaseAverage:
    average: StateDict  # on the communication device, in the tensors' own dtypes
    gram_tau: torch.Tensor  # [T, T] float64
    gram_delta: torch.Tensor  # [T, T] float64
    task_states: list[StateDict] | None = None  # with keep_tasks: every task's end weights (host, task order)


def distributed_world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def gather_in_task_order(local: torch.Tensor, layout: TaskLayout) -> list[torch.Tensor]:
    """`local` stacks this process's task copies of one tensor ([tasks of the process, ...]); returns
    the leader copy of every task, in task order."""
    world = distributed_world()
    if world == 1:
        return list(local.unbind(0))
    if world != layout.world_size:
        raise RuntimeError(f"layout expects {layout.world_size} processes but {world} are running")
    most = layout.most_tasks_per_process
    if local.shape[0] < most:  # all_gather needs equal shapes; the padding is never read
        local = torch.cat([local, local[:1].expand(most - local.shape[0], *local.shape[1:])])
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local.contiguous())
    ordered = [gathered[rank][slot] for rank, slot in map(layout.owner, range(layout.num_tasks))]
    return ordered


def task_copies(local_states: Sequence[Mapping[str, torch.Tensor]], key: str, layout: TaskLayout,
                device: torch.device) -> list[torch.Tensor]:
    """Every task's copy of tensor `key` on `device`, in task order (this process's own come from
    `local_states`, in slot order)."""
    if distributed_world() == 1:
        return [state[key].to(device, non_blocking=True) for state in local_states]
    first = local_states[0][key]
    local = torch.empty((len(local_states), *first.shape), dtype=first.dtype, device=device)
    for row, state in zip(local, local_states):
        row.copy_(state[key], non_blocking=True)
    return gather_in_task_order(local, layout)


def average_phase(
    local_states: Sequence[Mapping[str, torch.Tensor]],
    keys: Sequence[str],
    layout: TaskLayout,
    theta_0: Mapping[str, torch.Tensor],
    previous_average: Mapping[str, torch.Tensor],
    diagnostic_keys: Collection[str],
    device: torch.device,
    keep_tasks: bool = False,
    host: HostBuffers | None = None,
) -> PhaseAverage:
    """Average the tasks' end weights (`local_states`: this process's tasks, in slot order); with
    `keep_tasks`, also return every task's gathered end weights (for a sync merge other than the
    average: mima.training.sync_merge), in `host`'s buffers ("task", t) when given (reused from
    phase to phase; their contents change at the next call), in new tensors otherwise."""
    num_tasks = layout.num_tasks
    gram_tau = torch.zeros(num_tasks, num_tasks, dtype=torch.float64, device=device)
    gram_delta = torch.zeros_like(gram_tau)
    average: StateDict = {}
    task_states: list[StateDict] | None = [{} for _ in range(num_tasks)] if keep_tasks else None
    wanted = num_tasks * HostArena.space_for(local_states[0][key] for key in keys)  # host bytes still to stage
    for key in keys:
        ordered = task_copies(local_states, key, layout, device)
        if task_states is not None:  # to the host now: T copies of one tensor on the device, never T models
            for task, (state, copy) in enumerate(zip(task_states, ordered)):
                name = ("task", task)
                state[key] = copy.to("cpu", copy=True) if host is None else host.stage(name, key, copy, wanted)
                wanted -= HostArena.space_for([copy])
        wide = torch.promote_types(ordered[0].dtype, torch.float32)
        total = ordered[0].to(wide, copy=True)
        for copy in ordered[1:]:
            total += copy
        average[key] = (total / num_tasks).to(ordered[0].dtype)
        if key in diagnostic_keys:
            flat = torch.stack([copy.reshape(-1) for copy in ordered]).to(wide)
            tau = flat - theta_0[key].to(device, wide).reshape(1, -1)
            gram_tau += (tau @ tau.T).double()
            delta = flat - previous_average[key].to(device, wide).reshape(1, -1)
            gram_delta += (delta @ delta.T).double()
    if task_states is not None and host is not None:
        host.copies_queued(device)
        host.wait()  # the merge reads them on the host
    return PhaseAverage(average, gram_tau.cpu(), gram_delta.cpu(), task_states)


def gather_task_values(local: Mapping[int, float], layout: TaskLayout) -> dict[int, float]:
    """Per-task scalars (e.g. mean losses) from every process; replicas of a task are averaged."""
    if distributed_world() == 1:
        return dict(local)
    everyone: list[dict[int, float]] = [{} for _ in range(distributed_world())]
    dist.all_gather_object(everyone, dict(local))
    sums: dict[int, list[float]] = {}
    for values in everyone:
        for task, value in values.items():
            sums.setdefault(task, []).append(value)
    return {task: sum(values) / len(values) for task, values in sorted(sums.items())}
