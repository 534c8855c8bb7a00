"""How long a process waits at a sync for the others before it declares one of them dead.

Processes reach a phase's sync after different amounts of work: one may own two tasks and another
one, or tasks with different budgets (mima.core.layout.deal_tasks balances, but cannot always
even them out). The one with less work waits while the others still train. A fixed limit
(--collective_timeout) would abort such a run after its training was done once the difference is
long enough, so the limit at each sync is

    --collective_timeout + lag steps x this process's step time x MARGIN

where the lag is what the plan says the slowest process may still have to do when this one
arrives: the largest difference in steps of the phase between two processes (the same number on
every process), or, in the phase in which a resumed process started, the busiest process's whole
phase (processes resume from states saved at different points of the phase). The step time is the
running median of this process's own steps (host wall clock from one step's end to the next,
leaving out the segment ends, where averaging and checkpoints take their time); processes train
the same encoder at the same batch size, so another process's steps take about as long, and the
margin covers the difference. A process that measured no step yet (it resumed straight into a
pending sync) uses the median it saved with its state, or only the base timeout if there is none.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

from mima.core.layout import TaskLayout

MARGIN = 2.0  # how much slower another process's steps may be than this one's
WINDOW = 101  # steps the running median looks back over


class StepClock:
    """The running median of this process's optimiser-step durations, in seconds."""

    def __init__(self, window: int = WINDOW) -> None:
        self.durations: deque[float] = deque(maxlen=window)
        self.last_end: float | None = None  # when the previous step ended (None: no interval to close)
        self.saved: float | None = None  # the median saved with a resumed state, until a step is measured

    def step_ended(self, now: float) -> None:
        if self.last_end is not None:
            self.durations.append(now - self.last_end)
        self.last_end = now

    def restart(self, now: float) -> None:
        """After work that is not a training step (a segment end, a sync): the next interval starts now."""
        self.last_end = now

    def median(self) -> float | None:
        return statistics.median(self.durations) if self.durations else self.saved


def lag_steps(layout: TaskLayout, task_lengths: Sequence[Sequence[int]], phase: int, resumed_in_phase: bool) -> int:
    """Steps of `phase` that the slowest process may still have to take when another arrives at its sync."""
    steps = layout.phase_steps(task_lengths, phase)
    return max(steps) if resumed_in_phase else max(steps) - min(steps)


def sync_allowance_s(lag: int, step_seconds: float | None, margin: float = MARGIN) -> float:
    """Seconds added to the base timeout at a sync (0 without a measured step time)."""
    return lag * step_seconds * margin if step_seconds is not None else 0.0
