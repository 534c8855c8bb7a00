"""Choosing merge hyperparameters on validation data (never on test).

For each grid point the merged model is scored by its mean validation accuracy over the tasks;
the best is kept (the first one on ties, so smaller values win ties). Strategies of the form
anchor + lam * direction compute one direction per structural setting (e.g. per CART rank ratio,
all from one SVD per matrix) and sweep lam on it. A Selection carries the notes of the chosen merge
(what a data-dependent strategy learnt; empty for the others). `choose` is the one entry point of
`mima merge` and mima.merge (through mima.services.merge): the given hyperparameters, or the grid
searched on the validation splits (per-task methods: each task's value on its own split).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch

from mima.core.errors import MimaError
from mima.merging.pool import Pool
from mima.merging.registry import MergeMethod, PerTaskMerge

TensorMap = Mapping[str, torch.Tensor]
Score = Callable[[dict[str, torch.Tensor]], float]
Point = TypeVar("Point")


class Evaluator(Protocol):
    """What selection asks of a split's evaluator (mima.evaluation.accuracy.TaskEvaluator)."""

    def accuracy(self, state: TensorMap, tasks: Sequence[str] | None = None) -> dict[str, float]: ...

    def mean_accuracy(self, state: TensorMap) -> float: ...


class JudgingPool(Pool, Protocol):
    """A task pool that can also judge a merge on a split (mima.pools.TaskPool)."""

    def evaluator(self, split: str) -> Evaluator: ...


class BestPoint(Generic[Point]):
    """The best-scoring grid point offered so far: the highest validation score, the first one on ties
    (grids list smaller values first, so smaller values win ties). The one rule every selection uses
    (`mima merge --select-on val`, `mima evaluate`'s grid search)."""

    def __init__(self) -> None:
        self.score: float | None = None
        self.point: Point | None = None

    def offer(self, score: float, point: Point) -> bool:
        """Keep `point` if it scores higher than every point before it; True when it does."""
        if self.score is not None and not score > self.score:
            return False
        self.score, self.point = score, point
        return True


@dataclass
class Selection:
    method: str
    hparams: dict[str, object]
    score: float | None  # mean validation accuracy of the chosen point; None without validation
    trials: list[dict[str, object]] = field(default_factory=list)  # every grid point with its score
    merged: dict[str, torch.Tensor] = field(default_factory=dict)
    notes: dict[str, object] = field(default_factory=dict)  # what the strategy reports (learnt coefficients, ...)


def merge_with_defaults(method: MergeMethod, models: Sequence[TensorMap], base: TensorMap | None,
                        pool: Pool | None = None, allow_non_finite: bool = False) -> Selection:
    output = method.merge(models, base, pool, allow_non_finite)
    return Selection(method.name, dict(method.hyperparameters({})), None, [], output.state, output.notes)


def select_on_validation(
    method: MergeMethod, models: Sequence[TensorMap], base: TensorMap | None, score: Score, pool: Pool | None = None,
    allow_non_finite: bool = False,
) -> Selection:
    """Search the method's grid (other hyperparameters at their defaults) and keep the best score; every
    merge is checked as MergeMethod.check says (NaN/Inf refused unless `allow_non_finite`)."""
    if not method.grid:
        selection = merge_with_defaults(method, models, base, pool, allow_non_finite)
        selection.score = score(selection.merged)
        selection.trials = [{**selection.hparams, "score": selection.score}]
        return selection
    best: BestPoint[Selection] = BestPoint()
    trials: list[dict[str, object]] = []
    for point, output in method.grid_merges(models, base, pool, allow_non_finite):
        value = score(output.state)
        full = method.hyperparameters(point)
        trials.append({**{k: v for k, v in full.items() if k != "matrix_keys"}, "score": value})
        best.offer(value, Selection(method.name, full, value, trials, output.state, dict(output.notes)))
    chosen = best.point
    chosen.trials = trials
    return chosen


def choose(method: MergeMethod, models: Sequence[TensorMap], base: TensorMap | None, pool: JudgingPool | None,
           given: Mapping[str, object], select_on: str | None, allow_non_finite: bool = False) -> Selection:
    """The merge `mima merge` writes: with the `given` hyperparameters (the others at their defaults),
    or with select_on="val" the grid point that scores best on the pool's validation splits."""
    if select_on is None:
        output = method.merge(models, base, pool, allow_non_finite, **given)
        return Selection(method.name, method.hyperparameters(given), None, [], output.state, output.notes)
    validation = pool.evaluator("val")
    if isinstance(method, PerTaskMerge):
        return select_per_task(method, models, base, pool, allow_non_finite)
    if given:
        raise MimaError("--select-on val chooses the hyperparameters itself; leave them out or drop --select-on")
    return select_on_validation(method, models, base, validation.mean_accuracy, pool=pool, allow_non_finite=allow_non_finite)


def select_per_task(method: PerTaskMerge, models: Sequence[TensorMap], base: TensorMap | None, pool: JudgingPool,
                    allow_non_finite: bool = False) -> Selection:
    """Per-task methods pick their grid value for each task on that task's own validation split (the
    best score, the first value on ties: BestPoint)."""
    if not method.grid:
        return merge_with_defaults(method, models, base, allow_non_finite=allow_non_finite)
    (name, values), = method.grid.items()
    validation = pool.evaluator("val")
    scores: dict[float, list[float]] = {}
    for value in values:
        index = method(models, base, allow_non_finite=allow_non_finite, **{name: value})
        scores[value] = [validation.accuracy(method.reconstruct(index, t), [task])[task] for t, task in enumerate(pool.tasks)]
    best = []
    for t in range(len(pool.tasks)):
        task_best: BestPoint[object] = BestPoint()
        for value in values:
            task_best.offer(scores[value][t], value)
        best.append(task_best.point)
    trials = [{name: value, "task": task, "score": scores[value][t]} for value in values for t, task in enumerate(pool.tasks)]
    chosen = method.hyperparameters({name: best})
    return Selection(method.name, chosen, None, trials, method(models, base, allow_non_finite=allow_non_finite, **{name: best}))
