"""Choosing merge hyperparameters on validation data (never on test).

For each grid point the merged model is scored by its mean validation accuracy over the tasks;
the best is kept (the first one on ties, so smaller lambdas win ties). Strategies written as
anchor + lam * direction compute one direction per structural setting and sweep lam cheaply.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from mima.merging.registry import MergeMethod, combine

TensorMap = Mapping[str, torch.Tensor]
Score = Callable[[dict[str, torch.Tensor]], float]


@dataclass
class Selection:
    method: str
    hparams: dict[str, object]
    score: float | None  # mean validation accuracy of the chosen point; None without validation
    trials: list[dict[str, object]]  # every grid point with its score
    merged: dict[str, torch.Tensor]


def merge_with_defaults(method: MergeMethod, models: Sequence[TensorMap], base: TensorMap | None) -> Selection:
    merged = method(models, base)
    return Selection(method.name, dict(method.defaults), None, [], merged)


def select_on_validation(
    method: MergeMethod, models: Sequence[TensorMap], base: TensorMap | None, score: Score
) -> Selection:
    """Search the method's grid (other hyperparameters at their defaults) and keep the best score."""
    if not method.grid:
        return _scored(merge_with_defaults(method, models, base), score)
    structural = {name: values for name, values in method.grid.items() if name != "lam"}
    lams = method.grid.get("lam", (method.defaults.get("lam"),))
    fixed = {k: v for k, v in method.defaults.items() if k not in method.grid}
    best: Selection | None = None
    trials: list[dict[str, object]] = []
    for values in itertools.product(*structural.values()):
        setting = {**fixed, **dict(zip(structural, values))}
        if method.direction_fn is not None and "lam" in method.defaults:
            anchor, direction = method.direction_fn(models, base, **setting)
            candidates = ((lam, lambda lam=lam: combine(anchor, direction, lam)) for lam in lams)
        else:
            candidates = ((lam, lambda lam=lam: method(models, base, **setting, lam=lam)) for lam in lams)
        for lam, build in candidates:
            merged = build()
            value = score(merged)
            hparams = {**setting, "lam": lam}
            trials.append({**hparams, "score": value})
            if best is None or value > best.score:
                best = Selection(method.name, hparams, value, trials, merged)
    best.trials = trials
    return best


def _scored(selection: Selection, score: Score) -> Selection:
    selection.score = score(selection.merged)
    selection.trials = [{**selection.hparams, "score": selection.score}]
    return selection
