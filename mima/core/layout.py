"""Which process trains which task: T tasks over W processes.

  W <= T:               tasks are dealt round-robin (rank r owns r, r + W, ...), so a process owns
                        ceil(T / W) or floor(T / W) of them, and runs them one after another inside
                        every phase from the same start point; where W does not divide T the
                        processes with one task less wait at each sync (the time is logged).
  W > T, T divides W:   each task has R = W / T replicas forming its task group (ranks t*R .. t*R+R-1);
                        they split the task's batch and average gradients with DDP inside the group.
No gradient ever crosses tasks. W > T that T does not divide would give tasks unequal numbers of
replicas (and batch shards), so it is refused with the list of W that fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from mima.core.errors import MimaError


def allowed_world_sizes(num_tasks: int, largest: int = 64) -> list[int]:
    multiples = [num_tasks * m for m in range(2, largest // num_tasks + 1)]
    return list(range(1, num_tasks + 1)) + multiples


@dataclass(frozen=True)
class TaskLayout:
    num_tasks: int
    world_size: int

    def __post_init__(self) -> None:
        t, w = self.num_tasks, self.world_size
        if w < 1 or t < 1 or (w > t and w % t):
            fits = allowed_world_sizes(t)
            shown = f"1 .. {t}" + (f", {', '.join(map(str, fits[t:t + 4]))}, ..." if len(fits) > t else "")
            raise MimaError(
                f"{w} processes (trainer.devices x trainer.num_nodes) do not fit {t} tasks: use at most T "
                f"processes or a multiple of T ({shown})"
            )

    @property
    def replicas(self) -> int:
        """Processes per task (R)."""
        return max(1, self.world_size // self.num_tasks)

    @property
    def most_tasks_per_process(self) -> int:
        return -(-self.num_tasks // self.world_size) if self.world_size <= self.num_tasks else 1

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
