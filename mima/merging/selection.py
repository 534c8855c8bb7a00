"""Choosing merge hyperparameters on validation data (never on test).

For each grid point the merged model is scored by its mean validation accuracy over the tasks;
the best is kept (the first one on ties, so smaller values win ties). Strategies of the form
anchor + lam * direction compute one direction per structural setting (e.g. per CART rank ratio,
all from one SVD per matrix) and sweep lam on it. A Selection carries the notes of the chosen merge
(what a data-dependent strategy learnt; empty for the others).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from mima.merging.pool import Pool
from mima.merging.registry import MergeMethod, combine

TensorMap = Mapping[str, torch.Tensor]
Score = Callable[[dict[str, torch.Tensor]], float]


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
    best: Selection | None = None
    trials: list[dict[str, object]] = []

    def consider(hparams: dict, merged: dict, notes: dict | None = None) -> None:
        nonlocal best
        value = score(merged)
        full = method.hyperparameters(hparams)
        trials.append({**{k: v for k, v in full.items() if k != "matrix_keys"}, "score": value})
        if best is None or value > best.score:
            best = Selection(method.name, full, value, trials, merged, dict(notes or {}))

    structural = {name: values for name, values in method.grid.items() if name != "lam"}
    if method.scaled_fn is not None:
        lams = method.grid.get("lam", (method.defaults["lam"],))
        for setting, anchor, direction in method.sweep(models, base, structural, allow_non_finite):
            for lam in lams:
                consider({**setting, "lam": lam}, combine(anchor, direction, lam))
    else:
        for values in itertools.product(*method.grid.values()):
            hparams = dict(zip(method.grid, values))
            output = method.merge(models, base, pool, allow_non_finite, **hparams)
            consider(hparams, output.state, output.notes)
    best.trials = trials
    return best
