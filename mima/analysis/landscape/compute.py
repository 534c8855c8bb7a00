"""Error landscape on the plane through theta_0 spanned by two task vectors (paper 001, Fig. 7 and Fig. 12).

Paper 001 (MIMA), section "Error landscape visualisation" and Fig. 7: following Izmailov et al. (2018),
take the orthonormal basis u, v of the plane spanned by the task vectors tau_A = theta_A - theta_0 and
tau_B = theta_B - theta_0 (Gram-Schmidt), and evaluate the error of each task at the points
P(x, y) = theta_0 + x u + y v. The paper's claim is that with more MIMA iterations N the low-error
valleys of the two tasks rotate towards each other, so that an average of the models lands in a
shared basin.

Here the error is 1 - top-1 accuracy (in %) on a fixed subset of each task's test split, through the
task's frozen head. Merges of more than two task models generally leave the plane; they are marked at
their orthogonal projection, and both the merge itself and its projection are evaluated, with the
distance between them (the off-plane distance) reported.

All inner products run key by key in float64 over every floating tensor of the encoder state dict,
so no model is ever flattened into one vector.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from mima.core.errors import MimaError
from mima.core.state_dicts import check_compatible, is_mergeable
from mima.core.subsets import fixed_subset


StateDict = dict[str, torch.Tensor]
TensorMap = Mapping[str, torch.Tensor]
ErrorFn = Callable[[TensorMap], dict[str, float]]


# ------------------------------------------------------------------------------------------ geometry
@dataclass
class PlaneBasis:
    """The plane theta_0 + span(tau_A, tau_B): origin, orthonormal u, v (float64) and the task vectors' sizes."""

    origin: TensorMap
    u: StateDict
    v: StateDict
    norm_a: float  # ||tau_A||
    norm_b: float  # ||tau_B||
    cosine: float  # cos(tau_A, tau_B)

    @property
    def keys(self) -> list[str]:
        return list(self.u)


@dataclass
class PlaneCoordinates:
    x: float  # <P - theta_0, u>
    y: float  # <P - theta_0, v>
    off_plane: float  # ||P - theta_0 - x u - y v||


def _delta64(model: TensorMap, origin: TensorMap, key: str) -> torch.Tensor:
    return model[key].detach().to("cpu", torch.float64) - origin[key].detach().to("cpu", torch.float64)


def _dot(a: TensorMap, b: TensorMap) -> float:
    return float(sum(torch.dot(a[key].reshape(-1), b[key].reshape(-1)) for key in a))


def plane_basis(base: TensorMap, model_a: TensorMap, model_b: TensorMap, names: Sequence[str] = ("A", "B")) -> PlaneBasis:
    """Gram-Schmidt on (tau_A, tau_B): u = tau_A/||tau_A||, v = the unit part of tau_B orthogonal to u."""
    check_compatible({"theta_0": base, names[0]: model_a, names[1]: model_b})
    keys = [key for key, value in base.items() if is_mergeable(value)]
    tau_a = {key: _delta64(model_a, base, key) for key in keys}
    norm_a = math.sqrt(_dot(tau_a, tau_a))
    if norm_a == 0:
        raise MimaError(f"--tasks {names[0]}: its model equals theta_0 (zero task vector), so it spans no direction")
    u = {key: tensor / norm_a for key, tensor in tau_a.items()}
    del tau_a
    tau_b = {key: _delta64(model_b, base, key) for key in keys}
    norm_b = math.sqrt(_dot(tau_b, tau_b))
    along = _dot(tau_b, u)
    # The orthogonal part's norm is summed directly rather than taken as sqrt(|b|^2 - along^2), which
    # cancels badly when the two task vectors are nearly parallel. Below about 1e-6 of ||tau_B|| the
    # orthogonal part is float32 rounding of the stored weights, not a direction.
    for key in keys:
        tau_b[key].sub_(u[key], alpha=along)
    norm_w = math.sqrt(_dot(tau_b, tau_b))
    if norm_w <= 1e-6 * norm_b or norm_b == 0:
        raise MimaError(
            f"--tasks {names[0]} {names[1]}: the task vectors are parallel (or tau_{names[1]} is zero), so they span no plane"
        )
    v = {key: tensor.div_(norm_w) for key, tensor in tau_b.items()}
    return PlaneBasis(base, u, v, norm_a, norm_b, along / norm_b if norm_b else 0.0)


def plane_coordinates(basis: PlaneBasis, state_dict: TensorMap) -> PlaneCoordinates:
    """(x, y) of the orthogonal projection of a state dict onto the plane, and its distance from it."""
    x = y = 0.0
    for key in basis.keys:
        delta = _delta64(state_dict, basis.origin, key).reshape(-1)
        x += float(torch.dot(delta, basis.u[key].reshape(-1)))
        y += float(torch.dot(delta, basis.v[key].reshape(-1)))
    residual = 0.0
    for key in basis.keys:
        delta = _delta64(state_dict, basis.origin, key)
        delta.sub_(basis.u[key], alpha=x).sub_(basis.v[key], alpha=y)
        residual += float(torch.dot(delta.reshape(-1), delta.reshape(-1)))
    return PlaneCoordinates(x, y, math.sqrt(residual))


def plane_point(basis: PlaneBasis, x: float, y: float) -> StateDict:
    """theta_0 + x u + y v in theta_0's dtypes (formed in float64, so a task model's own coordinates give it back)."""
    point: StateDict = {}
    for key, tensor in basis.origin.items():
        if key not in basis.u:
            point[key] = tensor  # integer buffers are not part of the geometry
            continue
        wide = basis.u[key] * x
        wide.add_(basis.v[key], alpha=y).add_(tensor.detach().to("cpu", torch.float64))
        point[key] = wide.to(tensor.dtype)
    return point


def grid_axes(points: Sequence[PlaneCoordinates], resolution: int, margin: float) -> tuple[list[float], list[float]]:
    """Evenly spaced x and y covering the points' bounding box, widened by `margin` x its size on each side.

    The shorter side is then widened about its centre to at least half the longer one: the plots draw
    both axes to the same scale (so the angle between the task vectors is true), and a sliver of a
    panel would hide the valleys' shape.
    """
    ranges = []
    for values in ([p.x for p in points], [p.y for p in points]):
        low, high = min(values), max(values)
        span = high - low if high > low else max(abs(high), 1.0)
        ranges.append([low - margin * span, high + margin * span])
    longest = max(high - low for low, high in ranges)
    for bounds in ranges:
        missing = longest / 2 - (bounds[1] - bounds[0])
        if missing > 0:
            bounds[0] -= missing / 2
            bounds[1] += missing / 2
    return tuple(np.linspace(low, high, resolution).tolist() for low, high in ranges)


def grid_errors(basis: PlaneBasis, xs: Sequence[float], ys: Sequence[float], errors: ErrorFn) -> dict[str, list[list[float]]]:
    """Each task's error at every grid point, as rows over y of columns over x (the layout of contourf)."""
    table: dict[str, list[list[float]]] = {}
    for row, y in enumerate(ys):
        for x in xs:
            for task, value in errors(plane_point(basis, x, y)).items():
                table.setdefault(task, [[] for _ in ys])[row].append(value)
    return table


# ---------------------------------------------------------------------------------------- evaluation
def _materialise(dataset: Dataset) -> TensorDataset:
    """The subset as two tensors: every grid point reads the same examples, so decode them once."""
    images, labels = zip(*(dataset[index] for index in range(len(dataset))))
    return TensorDataset(torch.stack(list(images)), torch.as_tensor(labels))


def error_function(pool, tasks: Sequence[str], examples: int | None, split: str = "test") -> tuple[ErrorFn, dict[str, int]]:
    """A function from an encoder state dict to each task's top-1 error in % on a fixed subset of `split`."""
    from mima.evaluation.accuracy import TaskEvaluator

    datasets = {task: _materialise(fixed_subset(getattr(pool.splits[task], split), examples)) for task in tasks}
    evaluator = TaskEvaluator(pool.encoder, {task: pool.heads[task] for task in tasks}, datasets)
    counts = {task: len(dataset) for task, dataset in datasets.items()}

    def errors(state_dict: TensorMap) -> dict[str, float]:
        # back to a whole number of mistakes: the metric's float32 accuracy would leave 92.49999970 for 92.5
        return {
            task: 100.0 * round((1.0 - accuracy) * counts[task]) / counts[task]
            for task, accuracy in evaluator.accuracy(state_dict, list(tasks)).items()
        }

    return errors, counts


# ------------------------------------------------------------------------------------------- results
@dataclass
class MarkedPoint:
    name: str
    kind: str  # "pretrained", "task" or "merge"
    x: float
    y: float
    off_plane: float
    error: dict[str, float]  # of the model itself (mean included)
    projected_error: dict[str, float]  # of theta_0 + x u + y v
    hparams: dict[str, object] = field(default_factory=dict)


@dataclass
class Landscape:
    tasks: tuple[str, str]
    norm_a: float
    norm_b: float
    cosine: float
    x: list[float]
    y: list[float]
    error: dict[str, list[list[float]]]  # task A, task B and "mean": rows over y, columns over x
    points: list[MarkedPoint]
    examples: dict[str, int]


def _with_mean(errors: dict[str, float]) -> dict[str, float]:
    return {**errors, "mean": sum(errors.values()) / len(errors)}


def data_free_method(name: str):
    """The registered merge `name`, refusing the ones that need data or keep one model per task."""
    from mima.merging import get_method

    try:
        method = get_method(name)
    except MimaError as exc:
        raise MimaError(f"--merges: {exc}") from None
    if method.per_task or method.needs_data:
        kind = "keeps one model per task" if method.per_task else "needs task data"
        raise MimaError(f"--merges {name}: this merge {kind}; the landscape marks data-free merges only")
    return method


def merged_models(names: Sequence[str], models: Sequence[TensorMap], base: TensorMap, lam: float | None, pool=None):
    """(name, hyperparameters, merged state dict) of each data-free merge of all the task models."""
    from mima.merging.selection import merge_with_defaults

    merges = []
    for name in names:
        method = data_free_method(name)
        if lam is not None and "lam" in method.defaults:
            hparams = method.hyperparameters({"lam": lam})
            merged = method(models, base, pool=pool, lam=lam)
        else:
            selection = merge_with_defaults(method, models, base, pool=pool)
            hparams, merged = selection.hparams, selection.merged
        merges.append((name, {k: v for k, v in hparams.items() if k != "matrix_keys"}, merged))
    return merges


def compute_landscape(
    tasks: Sequence[str],
    models: Sequence[TensorMap],
    base: TensorMap,
    pair: tuple[str, str],
    errors: ErrorFn,
    resolution: int = 11,
    margin: float = 0.2,
    merges: Sequence[tuple[str, dict, TensorMap]] = (),
) -> tuple[Landscape, PlaneBasis]:
    """The plane of tasks `pair`, its marked points (theta_0, both task models, merges) and the error grid."""
    task_a, task_b = pair
    model_of = dict(zip(tasks, models))
    basis = plane_basis(base, model_of[task_a], model_of[task_b], pair)
    marked = [("theta_0", "pretrained", {}, base), (task_a, "task", {}, model_of[task_a]), (task_b, "task", {}, model_of[task_b])]
    marked += [(name, "merge", hparams, merged) for name, hparams, merged in merges]
    points = []
    for name, kind, hparams, state_dict in marked:
        where = plane_coordinates(basis, state_dict)
        own = _with_mean(errors(state_dict))
        # theta_0 and the two task models lie on the plane: their projection is the model itself
        projected = own if kind != "merge" else _with_mean(errors(plane_point(basis, where.x, where.y)))
        points.append(MarkedPoint(name, kind, where.x, where.y, where.off_plane, own, projected, hparams))
    xs, ys = grid_axes([PlaneCoordinates(p.x, p.y, p.off_plane) for p in points], resolution, margin)
    table = grid_errors(basis, xs, ys, errors)
    table["mean"] = [[(a + b) / 2 for a, b in zip(row_a, row_b)] for row_a, row_b in zip(table[task_a], table[task_b])]
    landscape = Landscape((task_a, task_b), basis.norm_a, basis.norm_b, basis.cosine, xs, ys, table, points, {})
    return landscape, basis


