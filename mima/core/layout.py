"""Which process trains which task: T tasks over W processes.

  W <= T:               tasks are dealt largest first (`deal_tasks`): each task, in order of decreasing
                        budget, goes to the process with the least work so far, so the processes'
                        steps per phase are as even as this greedy rule makes them. With equal
                        budgets that is round-robin (rank r owns r, r + W, ...): ceil(T / W) or
                        floor(T / W) tasks each. A process runs its tasks one after another inside
                        every phase from the same start point; the processes with less work wait at
                        each sync (the time is logged).
  W > T, T divides W:   each task has R = W / T replicas forming its task group (ranks t*R .. t*R+R-1);
                        they split the task's batch and average gradients with DDP inside the group.
Budgets do not change this layout: each task group trains its task's own S_t steps, and groups
with less work wait at the syncs. No gradient ever crosses tasks. W > T that T does not divide would give tasks unequal numbers of
replicas (and batch shards), so it is refused with the list of W that fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mima.core.errors import MimaError


def deal_tasks(work: Sequence[int], world_size: int) -> tuple[tuple[int, ...], ...]:
    """Each process's tasks (indices, in run order) for tasks with the given `work` (steps per phase,
    or budgets S_t: with equal phases the two are proportional): longest processing time first, i.e.
    tasks in order of decreasing work (ties: the earlier task), each to the process with the least
    work so far (ties: the lower rank). With equal work this is round-robin, task i to rank i mod W:
    before task i, ranks below i mod W hold one task more than the others, so rank i mod W is the
    lowest of the least loaded."""
    loads, owned = [0] * world_size, [[] for _ in range(world_size)]
    for task in sorted(range(len(work)), key=lambda index: (-work[index], index)):
        rank = min(range(world_size), key=lambda candidate: (loads[candidate], candidate))
        loads[rank] += work[task]
        owned[rank].append(task)
    return tuple(tuple(sorted(tasks)) for tasks in owned)


def allowed_world_sizes(num_tasks: int, largest: int = 64) -> list[int]:
    multiples = [num_tasks * m for m in range(2, largest // num_tasks + 1)]
    return list(range(1, num_tasks + 1)) + multiples


@dataclass(frozen=True)
class TaskLayout:
    num_tasks: int
    world_size: int
    work: tuple[int, ...] = ()  # each task's budget S_t (what deal_tasks balances); empty: all equal
    dealt: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)  # W <= T: rank -> tasks

    def __post_init__(self) -> None:
        t, w = self.num_tasks, self.world_size
        if self.work and len(self.work) != t:
            raise MimaError(f"{len(self.work)} task budgets for {t} tasks")
        if w < 1 or t < 1 or (w > t and w % t):
            fits = allowed_world_sizes(t)
            shown = f"1 .. {t}" + (f", {', '.join(map(str, fits[t:t + 4]))}, ..." if len(fits) > t else "")
            raise MimaError(
                f"{w} processes (trainer.devices x trainer.num_nodes) do not fit {t} tasks: use at most T "
                f"processes or a multiple of T ({shown})"
            )
        work = tuple(self.work) or (1,) * t
        object.__setattr__(self, "dealt", deal_tasks(work, w) if w <= t else ())

    def check_batch(self, batch_size: int) -> None:
        """Refuse, in one line, a batch that the processes sharing a task cannot split evenly (a
        process would get a fraction of an example, or none: more processes than the batch has)."""
        if batch_size % self.replicas:
            raise MimaError(
                f"data.batch_size={batch_size} does not split evenly over the {self.replicas} processes that share each task"
            )

    @property
    def replicas(self) -> int:
        """Processes per task (R)."""
        return max(1, self.world_size // self.num_tasks)

    @property
    def most_tasks_per_process(self) -> int:
        return max(map(len, self.dealt)) if self.world_size <= self.num_tasks else 1

    def local_tasks(self, rank: int) -> tuple[int, ...]:
        if self.world_size <= self.num_tasks:
            return self.dealt[rank]
        return (rank // self.replicas,)

    def phase_steps(self, task_lengths: Sequence[Sequence[int]], phase: int) -> list[int]:
        """Steps each process takes in `phase`, given every task's phase lengths (PhasePlan.task_lengths)."""
        return [sum(task_lengths[task][phase] for task in self.local_tasks(rank)) for rank in range(self.world_size)]

    def replica_index(self, rank: int) -> int:
        return rank % self.replicas if self.world_size > self.num_tasks else 0

    def task_group_ranks(self) -> list[list[int]]:
        """The ranks of each task group (one group per rank when there are no replicas)."""
        r = self.replicas
        return [list(range(start, start + r)) for start in range(0, self.world_size, r)]

    def owner(self, task: int) -> tuple[int, int]:
        """(rank, slot) of the process that holds task `task`'s leader copy."""
        if self.world_size <= self.num_tasks:
            rank = next(rank for rank, tasks in enumerate(self.dealt) if task in tasks)
            return rank, self.dealt[rank].index(task)
        return task * self.replicas, 0

    def is_leader(self, rank: int) -> bool:
        return self.replica_index(rank) == 0
