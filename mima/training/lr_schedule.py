"""Learning-rate factors as a function of a task's own step count.

The paper's recipe (paper 001, section 5; task_vectors' `cosine_lr`): linear warm-up
lr * (s + 1) / w for s < w, then cosine decay 0.5 * (1 + cos(pi * (s - w) / (S - w))) over the
rest of the budget. `scope="run"` (the default) runs this once over the task's whole budget S_t,
keyed on the task step s; `scope="phase"` restarts it in every phase over K steps.
"""

from __future__ import annotations

import math

from mima.config.model import ScheduleName, ScheduleScope
from mima.core.plan import PhasePlan



def warmup_cosine(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / span))


def warmup_constant(step: int, warmup: int) -> float:
    return (step + 1) / warmup if step < warmup else 1.0


def lr_factor(
    plan: PhasePlan, process_step: int, schedule: ScheduleName, scope: ScheduleScope, warmup: int, segment_warmup: int = 0
) -> float:
    """The factor multiplying the base learning rate at process step `process_step`. With
    `segment_warmup` > 0 the schedule's factor is also ramped up linearly over the first
    `segment_warmup` steps of every task segment (each phase's fresh fine-tune from the average),
    on top of the run's own warm-up."""
    step = min(process_step, plan.local_steps - 1)  # Lightning evaluates one step past the end
    position = plan.positions(step)[0]  # batched (model.batch_tasks): every slot is at the same task step
    if scope == "run":
        local_step, total = position.task_step, position.task_budget  # this task's S_t
    else:
        local_step, total = position.step_in_phase, position.phase_length
    warmup = min(warmup, total)
    factor = warmup_cosine(local_step, total, warmup) if schedule == "cosine" else warmup_constant(local_step, warmup)
    if segment_warmup > 0:
        factor *= min(1.0, (position.step_in_phase + 1) / segment_warmup)
    return factor
