"""The MIMA schedule: which task, phase and per-task step each optimiser step of a process belongs to.

A process owns `local_tasks` (indices into the run's task list). Within each of the N phases
it runs its tasks one after another, K = S / N steps each, every one starting from the phase's
average. Its step counter g (Lightning's global_step) therefore walks

    phase 0: task a (K steps), task b (K steps), ... | phase 1: task a, task b, ... | ...

and the per-task step s = (steps of the earlier phases) + step_in_phase runs 0 .. S-1 for every
task, which is what the learning-rate schedule and the data order are keyed on.

Phase lengths (`model.phase_schedule`): "equal" gives every phase K = S / N steps (paper 001);
"geometric" makes each phase `ratio` times as long as the one before (ratio > 1: short phases
first, syncing often early; ratio < 1: the reverse), K_i proportional to ratio^i, rounded so that
the N lengths sum to S exactly (largest remainders first, earlier phases on ties), each at least 1.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

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


PHASE_SCHEDULES = ("equal", "geometric")


def phase_lengths(total_steps: int, iterations: int, schedule: str = "equal", ratio: float = 2.0,
                  names: tuple[str, str] = ("model.steps", "model.iterations")) -> tuple[int, ...]:
    """K_1 .. K_N: the steps each task takes in each phase; they sum to S."""
    if schedule == "equal":
        return (check_budget(total_steps, iterations, names),) * iterations
    if schedule != "geometric":
        raise MimaError(f"model.phase_schedule: '{schedule}' is none of {', '.join(PHASE_SCHEDULES)}")
    steps_name, iterations_name = names
    if total_steps < 1 or iterations < 1:
        check_budget(total_steps, 1, names)  # the positive-value messages
        raise MimaError(f"{iterations_name} (N) must be at least 1, got {iterations}")
    if not ratio > 0:
        raise MimaError(f"model.phase_ratio must be positive (each phase ratio times the one before), got {ratio}")
    weights = [ratio ** phase for phase in range(iterations)]
    shares = [total_steps * weight / sum(weights) for weight in weights]
    lengths = [int(share) for share in shares]
    by_remainder = sorted(range(iterations), key=lambda phase: (-(shares[phase] - lengths[phase]), phase))
    for phase in by_remainder[: total_steps - sum(lengths)]:
        lengths[phase] += 1
    if min(lengths) < 1:
        raise MimaError(f"model.phase_ratio={ratio}: with {steps_name}={total_steps} and {iterations_name}={iterations} "
                        f"the shortest phase gets no step (lengths {lengths}); choose a ratio nearer 1 or fewer phases")
    return tuple(lengths)


@dataclass(frozen=True)
class StepPosition:
    phase: int  # 0-based phase (MIMA iteration)
    slot: int  # position of the task among this process's tasks
    task_index: int  # index into the run's task list
    step_in_phase: int  # 0 .. K_phase - 1
    task_step: int  # 0 .. S-1, the step count of this task across phases
    phase_length: int  # K_phase, this phase's steps per task

    @property
    def starts_segment(self) -> bool:
        return self.step_in_phase == 0


@dataclass(frozen=True)
class PhasePlan:
    tasks: tuple[str, ...]
    local_tasks: tuple[int, ...]
    total_steps: int
    iterations: int
    lengths: tuple[int, ...] = ()  # K_1 .. K_N (phase_lengths); empty: equal phases
    # derived from the above: the per-task step and the process step at which each phase starts
    task_starts: tuple[int, ...] = field(init=False, repr=False, compare=False)
    process_starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.lengths:
            object.__setattr__(self, "lengths", phase_lengths(self.total_steps, self.iterations))
        if len(self.lengths) != self.iterations or sum(self.lengths) != self.total_steps or min(self.lengths) < 1:
            raise MimaError(f"phase lengths {list(self.lengths)}: expected {self.iterations} positive lengths summing to "
                            f"{self.total_steps}")
        if not self.local_tasks:
            raise MimaError("this process owns no task")
        starts = [0]
        for length in self.lengths:
            starts.append(starts[-1] + length)
        object.__setattr__(self, "task_starts", tuple(starts))
        # a phase holds lengths[phase] steps of each of the process's tasks
        object.__setattr__(self, "process_starts", tuple(start * len(self.local_tasks) for start in starts))

    @property
    def steps_per_phase(self) -> int:
        """K with equal phases; with a schedule, see `lengths` (this is then an error)."""
        if len(set(self.lengths)) > 1:
            raise MimaError(f"the phases have different lengths {list(self.lengths)}; use PhasePlan.lengths")
        return self.lengths[0]

    @property
    def equal_phases(self) -> bool:
        return len(set(self.lengths)) == 1

    def task_steps_before(self, phase: int) -> int:
        """Per-task steps taken before `phase` starts (0 for the first; S after the last)."""
        return self.task_starts[phase]

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
        phase = bisect.bisect_right(self.process_starts, step) - 1
        k = self.lengths[phase]
        slot, step_in_phase = divmod(step - self.process_starts[phase], k)
        return StepPosition(
            phase=phase,
            slot=slot,
            task_index=self.local_tasks[slot],
            step_in_phase=step_in_phase,
            task_step=self.task_starts[phase] + step_in_phase,
            phase_length=k,
        )

    def ends_segment(self, step: int) -> bool:
        """True if step `step` is a task's last step of a phase."""
        position = self.position(step)
        return position.step_in_phase == position.phase_length - 1

    def ends_phase(self, step: int) -> bool:
        """True if step `step` is the last step of a phase on this process (time to synchronise)."""
        position = self.position(step)
        return position.slot == len(self.local_tasks) - 1 and position.step_in_phase == position.phase_length - 1
