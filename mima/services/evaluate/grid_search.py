"""Each merge's hyperparameters, chosen on the validation splits: its grid, the merged weights of each
grid point, and the best point (mima.merging.selection.BestPoint: the first best on ties, the rule
`mima merge --select-on val` uses too). The grid is walked in the registry's one order
(MergeMethod.grid_points), as `mima merge --select-on val` walks it, so both break ties alike.

A point is scored by the mean validation accuracy over the tasks, from its recorded cells
(mima.evaluation.cells); the chosen point's test accuracy is the merge's result.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence

from mima.core.errors import MimaError
from mima.evaluation.accuracy import accuracy_of
from mima.evaluation.cells import Cell, CellStore, point_key
from mima.merging.registry import GridPoint, MergeMethod, ScaledMerge, combine
from mima.merging.selection import BestPoint

Models = Callable[[], tuple[dict, list]]  # (theta_0, task models), loaded when first called
Weights = Callable[[], dict]  # a merged state dict, computed when first called
CurrentPool = Callable[[], object]  # the worker's task pool (or None) when a merge runs


def grid_points(method: MergeMethod) -> list[GridPoint]:
    """The method's validation grid in selection order, (structural setting, lam or None): the
    registry's walk (MergeMethod.grid_points)."""
    return method.grid_points()


def full_point(method: MergeMethod, setting: Mapping, lam: float | None) -> dict:
    """Every hyperparameter of the merge at a grid point (the others at their defaults), as recorded."""
    hparams = dict(setting) if lam is None else {**setting, "lam": lam}
    return {key: value for key, value in method.hyperparameters(hparams).items() if key != "matrix_keys"}


def validation_score(store: CellStore, run_id: str, model: str, point: str, tasks: Sequence[str]) -> float:
    """Mean validation accuracy over the tasks (the selection's score), from the counts."""
    scores = [accuracy_of(*store.get(Cell(run_id, model, point, "val", task))) for task in tasks]
    return sum(scores) / len(scores)


def recorded_best(store: CellStore, run_id: str, method: MergeMethod, grid: Sequence[GridPoint],
                  tasks: Sequence[str]) -> BestPoint[dict]:
    """The best of `grid` by the validation cells already recorded (every point's must be)."""
    best: BestPoint[dict] = BestPoint()
    for setting, lam in grid:
        hparams = full_point(method, setting, lam)
        best.offer(validation_score(store, run_id, method.name, point_key(hparams), tasks), hparams)
    return best


def grid_merges(method: MergeMethod, grid: Sequence[GridPoint], scored: Callable[[str], bool], models: Models,
                pool: CurrentPool) -> Iterator[tuple[dict, float | None, Weights | None]]:
    """(setting, lam, weights or None) in selection order; weights only for the points not yet
    `scored` (by their point key). A scaled method computes each needed setting's direction once,
    all settings in one sweep (CART: one SVD per task and matrix for every rank ratio)."""
    def done(setting, lam) -> bool:
        return scored(point_key(full_point(method, setting, lam)))

    if not isinstance(method, ScaledMerge):
        for setting, lam in grid:
            yield setting, lam, None if done(setting, lam) else _cached(
                lambda s=setting: method.merge(models()[1], models()[0], pool(), **s).state)
        return
    needed = [setting for setting in _unique_settings(grid) if not all(done(s, lam) for s, lam in grid if s == setting)]
    directions: dict[str, tuple[dict, dict]] = {}
    if needed:
        names = list(needed[0])
        settings = {name: tuple(dict.fromkeys(s[name] for s in needed)) for name in names}
        for setting, anchor, direction in method.sweep(models()[1], models()[0], settings):
            if setting in needed:
                directions[point_key(setting)] = (anchor, direction)
    for setting, lam in grid:
        pair = directions.get(point_key(setting))
        yield setting, lam, None if pair is None or done(setting, lam) else _cached(
            lambda a=pair[0], d=pair[1], value=lam: combine(a, d, value))


def merge_at(method: MergeMethod, point: str, models: Models, pool: CurrentPool) -> dict:
    """The merged weights at a chosen point (its point key), computed as the grid computed them."""
    hparams = json.loads(point)
    if not isinstance(method, ScaledMerge):
        grid_names = set(method.grid)
        return method.merge(models()[1], models()[0], pool(), **{k: v for k, v in hparams.items() if k in grid_names}).state
    structural = {name: (hparams[name],) for name in method.grid if name != "lam"}
    for _, anchor, direction in method.sweep(models()[1], models()[0], structural):
        return combine(anchor, direction, hparams["lam"])
    raise MimaError(f"{method.name}: no merge at {hparams}")


def _unique_settings(grid: Sequence[GridPoint]) -> list[dict]:
    """The grid's structural settings, each once, in order."""
    seen, unique = set(), []
    for setting, _ in grid:
        if point_key(setting) not in seen:
            seen.add(point_key(setting))
            unique.append(setting)
    return unique


def _cached(compute: Weights) -> Weights:
    """A callable computing its value once (the weights of one grid point)."""
    value = []

    def get():
        if not value:
            value.append(compute())
        return value[0]
    return get
