"""The MIMA schedule: which task, phase and per-task step each optimiser step of a process belongs to.

A process owns `local_tasks` (indices into the run's task list). Within each of the N phases
it runs its tasks one after another, K = S / N steps each, every one starting from the phase's
average. Its step counter g (Lightning's global_step) therefore walks

    phase 0: task a (K steps), task b (K steps), ... | phase 1: task a, task b, ... | ...

and the per-task step s = phase * K + step_in_phase runs 0 .. S-1 for every task, which is what
the learning-rate schedule and the data order are keyed on.
"""

from __future__ import annotations

from dataclasses import dataclass

from mima.core.errors import MimaError


def check_budget(
    total_steps: int, iterations: int, names: tuple[str, str] = ("model.steps", "model.iterations")
) -> int:
    """Validate S and N; return K = S / N. `names` are the options the user set them with."""
    steps_name, iterations_name = names
    if total_steps < 1:
        raise MimaError(f"{steps_name} must be a positive number of steps per task, got {total_steps}")
    if iterations < 1:
        raise MimaError(f"{iterations_name} (N) must be at least 1, got {iterations}")
    if total_steps % iterations:
        divisors = [n for n in range(1, min(total_steps, 64) + 1) if total_steps % n == 0]
        raise MimaError(
            f"{iterations_name}={iterations} does not divide {steps_name}={total_steps}: every phase must have "
            f"K = S/N whole steps (N that divide {total_steps}: {', '.join(map(str, divisors))}, ...)"
        )
    return total_steps // iterations


@dataclass(frozen=True)
class StepPosition:
    phase: int  # 0-based phase (MIMA iteration)
    slot: int  # position of the task among this process's tasks
    task_index: int  # index into the run's task list
    step_in_phase: int  # 0 .. K-1
    task_step: int  # 0 .. S-1, the step count of this task across phases

    @property
    def starts_segment(self) -> bool:
        return self.step_in_phase == 0


@dataclass(frozen=True)
class PhasePlan:
    tasks: tuple[str, ...]
    local_tasks: tuple[int, ...]
    total_steps: int
    iterations: int

    def __post_init__(self) -> None:
        check_budget(self.total_steps, self.iterations)
        if not self.local_tasks:
            raise MimaError("this process owns no task")

    @property
    def steps_per_phase(self) -> int:
        return self.total_steps // self.iterations

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def local_steps(self) -> int:
        """Optimiser steps this process takes over the whole run."""
        return self.total_steps * len(self.local_tasks)

    def position(self, step: int) -> StepPosition:
        """Where process step `step` (0-based) falls."""
        if not 0 <= step < self.local_steps:
            raise IndexError(f"step {step} outside the plan's {self.local_steps} steps")
        k = self.steps_per_phase
        segment, step_in_phase = divmod(step, k)
        phase, slot = divmod(segment, len(self.local_tasks))
        return StepPosition(
            phase=phase,
            slot=slot,
            task_index=self.local_tasks[slot],
            step_in_phase=step_in_phase,
            task_step=phase * k + step_in_phase,
        )

    def ends_segment(self, step: int) -> bool:
        """True if step `step` is a task's last step of a phase."""
        return (step + 1) % self.steps_per_phase == 0

    def ends_phase(self, step: int) -> bool:
        """True if step `step` is the last step of a phase on this process (time to synchronise)."""
        return (step + 1) % (self.steps_per_phase * len(self.local_tasks)) == 0
