"""Which process trains which task: T tasks over W processes.

  W <= T, W divides T:  each process owns T / W tasks, round-robin (rank r owns r, r + W, ...), and
                        runs them one after another inside every phase from the same start point.
  W > T, T divides W:   each task has R = W / T replicas forming its task group (ranks t*R .. t*R+R-1);
                        they split the task's batch and average gradients with DDP inside the group.
No gradient ever crosses tasks. Other W would give processes unequal work per phase, so they are
refused with the list of W that fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from mima.core.errors import MimaError


def allowed_world_sizes(num_tasks: int, largest: int = 64) -> list[int]:
    divisors = [w for w in range(1, num_tasks + 1) if num_tasks % w == 0]
    multiples = [num_tasks * m for m in range(2, largest // num_tasks + 1)]
    return divisors + multiples


@dataclass(frozen=True)
class TaskLayout:
    num_tasks: int
    world_size: int

    def __post_init__(self) -> None:
        t, w = self.num_tasks, self.world_size
        if w < 1 or t < 1 or (w <= t and t % w) or (w > t and w % t):
            fits = ", ".join(map(str, allowed_world_sizes(t)))
            raise MimaError(
                f"{w} processes (trainer.devices x trainer.num_nodes) do not fit {t} tasks: use a W that divides "
                f"T or a multiple of T, e.g. {fits}"
            )

    @property
    def replicas(self) -> int:
        """Processes per task (R)."""
        return max(1, self.world_size // self.num_tasks)

    @property
    def tasks_per_process(self) -> int:
        return max(1, self.num_tasks // self.world_size)

    def local_tasks(self, rank: int) -> tuple[int, ...]:
        if self.world_size <= self.num_tasks:
            return tuple(range(rank, self.num_tasks, self.world_size))
        return (rank // self.replicas,)

    def replica_index(self, rank: int) -> int:
        return rank % self.replicas if self.world_size > self.num_tasks else 0

    def task_group_ranks(self) -> list[list[int]]:
        """The ranks of each task group (one group per rank when there are no replicas)."""
        r = self.replicas
        return [list(range(start, start + r)) for start in range(0, self.world_size, r)]

    def owner(self, task: int) -> tuple[int, int]:
        """(rank, slot) of the process that holds task `task`'s leader copy."""
        if self.world_size <= self.num_tasks:
            return task % self.world_size, task // self.world_size
        return task * self.replicas, 0

    def is_leader(self, rank: int) -> bool:
        return self.replica_index(rank) == 0
