"""The MIMA schedule: which task, phase and per-task step each optimiser step of a process belongs to.

A process owns `local_tasks` (indices into the run's task list). Within each of the N phases
it runs its tasks one after another, K = S / N steps each, every one starting from the phase's
average. Its step counter g (Lightning's global_step) therefore walks

    phase 0: task a (K steps), task b (K steps), ... | phase 1: task a, task b, ... | ...

and the per-task step s = (steps of the earlier phases) + step_in_phase runs 0 .. S-1 for every
task, which is what the learning-rate schedule and the data order are keyed on.

Per-task budgets (`model.steps` as a map task -> S_t): task t takes K_t = S_t / N steps in each
phase (or its own geometric lengths), so a phase of a process holds K_a steps of task a, then K_b
of task b, ...; every task still takes its N segments from the same N phase averages, and its
per-task step runs 0 .. S_t - 1. One number S is the same as a map giving every task S.

Batched (`model.batch_tasks`, `batched=True`): the process's tasks step together as one stacked
model, so process step g advances every local task by one per-task step: g walks
phase 0 (K steps) | phase 1 | ..., every slot's segment ends with its phase, and g is the per-task
step. That needs the process's tasks to have the same phase lengths. A batched step has no single
task slot: `position` refuses, `positions` gives each slot's, `phase_of` the phase.

Phase lengths (`model.phase_schedule`): "equal" gives every phase K = S / N steps (paper 001);
"geometric" makes each phase `ratio` times as long as the one before (ratio > 1: short phases
first, syncing often early; ratio < 1: the reverse), K_i proportional to ratio^i, rounded so that
the N lengths sum to S exactly (largest remainders first, earlier phases on ties), each at least 1.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
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


Budget = int | Mapping[str, int]  # model.steps: one S for every task, or S_t per task


def task_budgets(steps: Budget, tasks: Sequence[str]) -> tuple[int, ...]:
    """S_t of each of the run's `tasks`, in run order. A map must name exactly the run's tasks."""
    if not isinstance(steps, Mapping):
        return (int(steps),) * len(tasks)
    unknown = [str(name) for name in steps if name not in tasks]
    if unknown:
        raise MimaError(f"model.steps names {', '.join(map(repr, unknown))}, not a task of the run "
                        f"(its tasks: {', '.join(tasks)})")
    missing = [name for name in tasks if name not in steps]
    if missing:
        raise MimaError(f"model.steps gives no budget for task {', '.join(map(repr, missing))}: a map of budgets "
                        f"needs every task of the run ({', '.join(tasks)})")
    return tuple(int(steps[name]) for name in tasks)


def task_phase_lengths(steps: Budget, tasks: Sequence[str], iterations: int, schedule: str = "equal",
                       ratio: float = 2.0) -> tuple[tuple[int, ...], ...]:
    """Each task's K_1 .. K_N (phase_lengths of its own S_t), in run order."""
    if not isinstance(steps, Mapping):
        return (phase_lengths(int(steps), iterations, schedule, ratio),) * len(tasks)
    budgets = task_budgets(steps, tasks)
    return tuple(phase_lengths(budget, iterations, schedule, ratio, names=(f"model.steps.{name}", "model.iterations"))
                 for name, budget in zip(tasks, budgets))


@dataclass(frozen=True)
class StepPosition:
    phase: int  # 0-based phase (MIMA iteration)
    slot: int  # position of the task among this process's tasks
    task_index: int  # index into the run's task list
    step_in_phase: int  # 0 .. K_phase - 1
    task_step: int  # 0 .. S_t - 1, the step count of this task across phases
    phase_length: int  # K_phase of this task, its steps in this phase
    task_budget: int  # S_t, this task's steps over the whole run

    @property
    def starts_segment(self) -> bool:
        return self.step_in_phase == 0


@dataclass(frozen=True)
class PhasePlan:
    """One process's schedule. `total_steps` and `lengths` are the budget S and phase lengths of
    every task; with per-task budgets `task_lengths` holds each run task's own K_1 .. K_N and
    `total_steps` / `lengths` are those of the longest task (use `budget` / `phase_length`)."""

    tasks: tuple[str, ...]
    local_tasks: tuple[int, ...]
    total_steps: int
    iterations: int
    lengths: tuple[int, ...] = ()  # K_1 .. K_N (phase_lengths); empty: equal phases
    task_lengths: tuple[tuple[int, ...], ...] = ()  # per run task (task_phase_lengths); empty: all `lengths`
    batched: bool = False  # model.batch_tasks: every process step advances all local tasks together
    # derived from the above: each task's step and this process's step at which each phase starts,
    # and where each slot's segment starts inside each phase (process steps from the phase start)
    task_starts: tuple[int, ...] = field(init=False, repr=False, compare=False)
    process_starts: tuple[int, ...] = field(init=False, repr=False, compare=False)
    slot_starts: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.lengths:
            object.__setattr__(self, "lengths", phase_lengths(self.total_steps, self.iterations))
        if not self.task_lengths:
            object.__setattr__(self, "task_lengths", (tuple(self.lengths),) * len(self.tasks))
        if len(self.task_lengths) != len(self.tasks):
            raise MimaError(f"phase lengths for {len(self.task_lengths)} tasks, but the run has {len(self.tasks)}")
        for lengths in (self.lengths, *self.task_lengths):
            if len(lengths) != self.iterations or min(lengths) < 1:
                raise MimaError(f"phase lengths {list(lengths)}: expected {self.iterations} positive lengths")
        if sum(self.lengths) != self.total_steps or self.total_steps != max(map(sum, self.task_lengths)):
            raise MimaError(f"phase lengths {list(self.lengths)}: expected the longest task's lengths, summing to "
                            f"{self.total_steps}")
        if not self.local_tasks:
            raise MimaError("this process owns no task")
        object.__setattr__(self, "task_starts", _running_sums(self.lengths))
        if self.batched:
            local_lengths = {self.task_lengths[task] for task in self.local_tasks}
            if len(local_lengths) > 1:
                raise MimaError("model.batch_tasks: the tasks of a process step together, so they need the same phase "
                                f"lengths, but model.steps gives them {sorted(map(list, local_lengths))}; give every "
                                "task the same budget or set model.batch_tasks false")
            lengths = next(iter(local_lengths))
            object.__setattr__(self, "slot_starts", tuple((0,) * (len(self.local_tasks) + 1) for _ in lengths))
            object.__setattr__(self, "process_starts", _running_sums(lengths))
            return
        # a phase holds phase_length(task, phase) steps of each of the process's tasks, in slot order
        slot_starts = tuple(_running_sums([self.task_lengths[task][phase] for task in self.local_tasks])
                            for phase in range(self.iterations))
        object.__setattr__(self, "slot_starts", slot_starts)
        object.__setattr__(self, "process_starts", _running_sums([starts[-1] for starts in slot_starts]))

    @property
    def uniform(self) -> bool:
        """Whether every task has the same budget and phase lengths (one `model.steps` number)."""
        return len(set(self.task_lengths)) == 1

    def budget(self, task_index: int) -> int:
        """S_t of run task `task_index`."""
        return sum(self.task_lengths[task_index])

    def phase_length(self, task_index: int, phase: int) -> int:
        """K of run task `task_index` in `phase`."""
        return self.task_lengths[task_index][phase]

    @property
    def steps_per_phase(self) -> int:
        """K with equal phases; with a schedule, see `lengths` (this is then an error)."""
        if len(set(self.lengths)) > 1:
            raise MimaError(f"the phases have different lengths {list(self.lengths)}; use PhasePlan.lengths")
        return self.lengths[0]

    @property
    def equal_phases(self) -> bool:
        return all(len(set(lengths)) == 1 for lengths in self.task_lengths)

    def task_steps_before(self, phase: int, task_index: int | None = None) -> int:
        """Per-task steps taken before `phase` starts (0 for the first; S_t after the last); the task
        may be left out when every task has the same lengths."""
        if task_index is None:
            if not self.uniform:
                raise MimaError("the tasks have different budgets; name the task")
            return self.task_starts[phase]
        return sum(self.task_lengths[task_index][:phase])

    def process_phase_steps(self, phase: int) -> int:
        """Optimiser steps this process takes in `phase` (all its task segments)."""
        return self.process_starts[phase + 1] - self.process_starts[phase]

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def local_steps(self) -> int:
        """Optimiser steps this process takes over the whole run."""
        return self.process_starts[-1]

    def phase_of(self, step: int) -> int:
        """The phase process step `step` (0-based) belongs to."""
        if not 0 <= step < self.local_steps:
            raise IndexError(f"step {step} outside the plan's {self.local_steps} steps")
        return bisect.bisect_right(self.process_starts, step) - 1

    def position(self, step: int) -> StepPosition:
        """Where process step `step` (0-based) falls (one task's step; a batched plan has none: `positions`)."""
        if self.batched:
            raise RuntimeError("a batched plan's step belongs to every local task: use PhasePlan.positions")
        phase = self.phase_of(step)
        offset = step - self.process_starts[phase]
        slot = bisect.bisect_right(self.slot_starts[phase], offset) - 1
        return self._slot_position(phase, slot, offset - self.slot_starts[phase][slot])

    def positions(self, step: int) -> list[StepPosition]:
        """Each task step process step `step` takes: one per local slot when batched, else the one."""
        if not self.batched:
            return [self.position(step)]
        phase = self.phase_of(step)
        return [self._slot_position(phase, slot, step - self.process_starts[phase]) for slot in range(len(self.local_tasks))]

    def _slot_position(self, phase: int, slot: int, step_in_phase: int) -> StepPosition:
        task = self.local_tasks[slot]
        return StepPosition(
            phase=phase,
            slot=slot,
            task_index=task,
            step_in_phase=step_in_phase,
            task_step=self.task_steps_before(phase, task) + step_in_phase,
            phase_length=self.task_lengths[task][phase],
            task_budget=self.budget(task),
        )

    def ends_segment(self, step: int) -> bool:
        """True if step `step` is a task's last step of a phase (batched: every task's, the phase's end)."""
        position = self.positions(step)[-1]
        return position.step_in_phase == position.phase_length - 1

    def ends_phase(self, step: int) -> bool:
        """True if step `step` is the last step of a phase on this process (time to synchronise)."""
        position = self.positions(step)[-1]
        return position.slot == len(self.local_tasks) - 1 and position.step_in_phase == position.phase_length - 1


def _running_sums(values: Sequence[int]) -> tuple[int, ...]:
    """0, v0, v0 + v1, ...: where each of consecutive runs of `values` steps starts (and the end)."""
    sums = [0]
    for value in values:
        sums.append(sums[-1] + value)
    return tuple(sums)


def plan_for_budgets(tasks: Sequence[str], local_tasks: Sequence[int], task_lengths: Sequence[Sequence[int]],
                     iterations: int, batched: bool = False) -> PhasePlan:
    """The PhasePlan of a process whose run's tasks have the phase lengths `task_lengths` (task_phase_lengths):
    with one budget for every task exactly the plan of that budget."""
    task_lengths = tuple(tuple(lengths) for lengths in task_lengths)
    longest = max(task_lengths, key=sum)
    return PhasePlan(tasks=tuple(tasks), local_tasks=tuple(local_tasks), total_steps=sum(longest), iterations=iterations,
                     lengths=longest, task_lengths=() if len(set(task_lengths)) == 1 else task_lengths, batched=batched)
