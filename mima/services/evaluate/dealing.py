"""Which process evaluates which cells: the work cut into units (everything of one run and model),
dealt over the processes by cost. Every process computes the same plan and takes its own share, so
no process has to tell another what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mima.services.evaluate.evaluation import Evaluation
from mima.core.names import FINE_TUNED, JOINT, ZERO_SHOT


@dataclass(frozen=True)
class Unit:
    """One piece of work dealt to one process: everything of one (run, model)."""

    kind: str  # zero_shot, joint, fine_tuned, geometry, merge
    run: int  # index into Evaluation.runs (zero_shot: the first run's theta_0; joint: ignored)
    method: str | None = None
    cost: int = 1  # forward passes over a task's split, for dealing


def plan_units(evaluation: Evaluation) -> list[Unit]:
    """Every unit of the evaluation, in plan order (a run's units together)."""
    count = len(evaluation.tasks)
    units = [Unit(ZERO_SHOT, 0, cost=count)]
    if evaluation.joint is not None:
        units.append(Unit(JOINT, 0, cost=count))
    for index, _ in enumerate(evaluation.runs):
        units += [Unit(FINE_TUNED, index, cost=count), Unit("geometry", index, cost=1)]
        units += [Unit("merge", index, method.name, cost=count * (len(evaluation.grid(method)) + 1))
                  for method in evaluation.methods]
    return units


def deal(units: Sequence[Unit], world: int) -> list[list[Unit]]:
    """Largest first to the least loaded process (ties: the lower rank); each process then takes its
    units in plan order, so that consecutive units share a run's loaded models."""
    order = sorted(range(len(units)), key=lambda i: (-units[i].cost, i))
    loads, dealt = [0] * world, [[] for _ in range(world)]
    for index in order:
        rank = min(range(world), key=lambda r: (loads[r], r))
        loads[rank] += units[index].cost
        dealt[rank].append(index)
    return [[units[i] for i in sorted(indices)] for indices in dealt]
