"""Choosing merge hyperparameters on validation data (never on test).

For each grid point the merged model is scored by its mean validation accuracy over the tasks;
the best is kept (the first one on ties, so smaller values win ties). Strategies of the form
anchor + lam * direction compute one direction per structural setting (e.g. per CART rank ratio,
all from one SVD per matrix) and sweep lam on it. A Selection carries the notes of the chosen merge
(what a data-dependent strategy learnt; empty for the others).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from mima.merging.pool import Pool
from mima.merging.registry import MergeMethod

TensorMap = Mapping[str, torch.Tensor]
Score = Callable[[dict[str, torch.Tensor]], float]
Point = TypeVar("Point")


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
