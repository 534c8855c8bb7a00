"""Accuracy vs kept rank of low-rank task vectors, and why: row-space interference and reconstruction error.

Choi et al. 2024, "Revisiting Weight Averaging for Model Merging" (CART), https://arxiv.org/abs/2412.12153
(paper 000, CART: arXiv:2412.12153). What this module computes, as we read the paper:

* Fig. 1, the "bell curve" (section 4.1, eq. 4): for every 2-D attention/MLP weight matrix l,
    centered: theta_avg^l + lam_cart * sum_t SVD_k(theta_t^l - theta_avg^l)
    original: theta_0^l   + lam_ta   * sum_t SVD_k(theta_t^l - theta_0^l)
  with k = cart_rank(shape, ratio) (mima.merging.cart: max(1, floor(ratio * min(m, n))), 0 for
  ratio 0). Other tensors follow each method without rank reduction: centered -> theta_avg (CART),
  original -> theta_0 + lam_ta * sum_t tau_t (task arithmetic). Centered vectors sum to zero, so the
  centered curve starts (k = 0) and ends (full rank) at theta_avg; the original curve ends at task
  arithmetic and, for the matrices, starts at theta_0. The paper does not state the lam of Fig. 1;
  we use CART's lam = 1 (its default without validation, Appendix D) and lam_ta = 0.3, the top of
  the paper's task-arithmetic grid {0.1, 0.2, 0.3} (Appendix D). The y axis is the mean accuracy
  over tasks.
* Eq. 5, row-space interference for one layer:
    I(k) = sum_{i != j} || (S_i V_i)^T (S_j V_j) ||_F,  S_t = diag(s_t,1..k) / ||tau_t||_F.
  We read V_t as the n x k matrix of the top-k right singular vectors of tau_t (the row space) and
  the product as the k x k matrix S_i V_i^T V_j S_j, i.e. S_i acting on the columns; that is the
  overlap of the row spaces that Appendix A bounds with ||V_t^T V_s||_2, and it is 0 for task vectors
  with orthogonal row spaces. (With V_t as k x n rows the n x n product would be V_i^T S_i S_j V_j,
  whose norm ||S_i S_j||_F ignores the singular vectors.) The main text says the singular values
  are "normalised by their l2 norm"; Appendix A divides by the Frobenius norm of the whole tau_t,
  which we follow: it makes I(k) non-decreasing in k, as Fig. 3 describes. The pair (j, i) gives
  the same norm as (i, j). A task vector of norm 0 contributes nothing.
* Eq. 7, reconstruction error: R(k) = sum_t || tau_t - SVD_k(tau_t) ||_F^2 = sum_t sum_{l > k} s_t,l^2
  (Eckart-Young). Both I and R are computed for centered (tau_t = theta_t - theta_avg, Fig. 2, 3)
  and original (tau_t = theta_t - theta_0, Fig. 2, Fig. 8 of Appendix C.1) vectors, per layer.

One SVD per task, matrix and kind (mima.core.linalg.svd) serves every ratio and rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from mima.analysis.rank_sweep.options import DEFAULT_LAM_CART, DEFAULT_LAM_TA, DEFAULT_RATIOS
from mima.core.linalg import SVD, svd
from mima.core.state_dicts import accumulator
from mima.merging.cart import DEFAULT_MATRIX_KEYS, cart_rank, is_matrix
from mima.merging.common import mean_tensor
from mima.merging.registry import combine

StateDict = dict[str, torch.Tensor]
Spectrum = list[SVD]  # one SVD per task, of that task's vector for one matrix

PAPER = "https://arxiv.org/abs/2412.12153"
KINDS = ("centered", "original")


# ----------------------------------------------------------------------------- spectra and metrics
def spectrum(vectors: Sequence[torch.Tensor]) -> Spectrum:
    """The thin SVD tau_t = U_t diag(s_t) Vh_t of each task's vector for one matrix (float32)."""
    return [svd(vector) for vector in vectors]


def low_rank_sum(spec: Spectrum, rank: int) -> torch.Tensor:
    """sum_t SVD_rank(tau_t)."""
    total = torch.zeros(spec[0].u.shape[0], spec[0].vh.shape[1], dtype=torch.float32)
    for part in spec:
        left, right = part.factors(rank)
        total += left @ right
    return total


def interference(spec: Spectrum, ranks: Sequence[int]) -> list[float]:
    """I(k) of eq. 5 for each k in `ranks` (k above the full rank counts as the full rank)."""
    top = min(max(ranks, default=0), spec[0].full_rank)
    if top == 0:
        return [0.0 for _ in ranks]
    weights = []
    for part in spec:
        norm = float(part.s.double().square().sum().sqrt())
        weights.append((part.s[:top].double() / norm) if norm > 0 else torch.zeros(top, dtype=torch.float64))
    values = [0.0 for _ in ranks]
    count = len(spec)
    for i in range(count):
        for j in range(i + 1, count):
            block = weights[i][:, None] * (spec[i].vh[:top].double() @ spec[j].vh[:top].double().T) * weights[j][None, :]
            # prefix[a, b] = squared Frobenius norm of the leading (a+1) x (b+1) block: every k at once
            prefix = block.square().cumsum(0).cumsum(1)
            for index, rank in enumerate(ranks):
                k = min(rank, top)
                if k > 0:
                    values[index] += 2.0 * math.sqrt(float(prefix[k - 1, k - 1]))
    return values


def reconstruction_error(spec: Spectrum, ranks: Sequence[int]) -> list[float]:
    """R(k) of eq. 7 for each k in `ranks`: the squared singular values left out, summed over tasks."""
    tails = [part.s.double().square().flip(0).cumsum(0).flip(0) for part in spec]  # tail[k] = sum_{l >= k} s_l^2
    full_rank = spec[0].full_rank
    return [sum(float(tail[k]) if k < full_rank else 0.0 for tail in tails) for k in ranks]


# ----------------------------------------------------------------------------- the sweep
@dataclass
class LayerMetrics:
    """Per-layer I(k) and R(k) for each kind of task vector, on the ranks asked for."""

    ranks: list[int]
    layers: list[str]
    full_rank: dict[str, int]
    interference: dict[str, dict[str, list[float]]]  # kind -> layer -> I(k) per rank
    reconstruction: dict[str, dict[str, list[float]]]  # kind -> layer -> R(k) per rank
    energy: dict[str, dict[str, float]]  # kind -> layer -> R(0) = sum_t ||tau_t||_F^2

    @property
    def kinds(self) -> list[str]:
        return list(self.interference)


@dataclass
class Sweep:
    """Every merge of the rank sweep, held as anchors and low-rank directions (built on demand)."""

    tasks: list[str]
    ratios: list[float]
    lam: dict[str, float]  # kind -> lam
    anchors: dict[str, StateDict]  # kind -> theta_avg or theta_0
    directions: dict[str, dict[float, StateDict]]  # kind -> ratio -> key -> direction (missing: anchor kept)
    kept_ranks: dict[float, list[int]]  # ratio -> the distinct ranks kept over the matrices
    matrices: list[str]
    layers: LayerMetrics

    @property
    def kinds(self) -> list[str]:
        return list(self.anchors)

    def state_dict(self, kind: str, ratio: float) -> StateDict:
        return combine(self.anchors[kind], self.directions[kind][ratio], self.lam[kind])


def rank_sweep(
    models: Sequence[Mapping[str, torch.Tensor]],
    base: Mapping[str, torch.Tensor] | None,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    ranks: Sequence[int] | None = None,
    lam_cart: float = DEFAULT_LAM_CART,
    lam_ta: float = DEFAULT_LAM_TA,
    matrix_keys: str = DEFAULT_MATRIX_KEYS,
    tasks: Sequence[str] | None = None,
) -> Sweep:
    """Centered (and, with theta_0, original) low-rank merges for every ratio, plus I(k), R(k) per matrix.

    `ranks` None means every rank from 0 to the largest full rank.
    """
    ratios = [float(r) for r in ratios]
    kinds = ["centered"] + (["original"] if base is not None else [])
    anchors: dict[str, StateDict] = {kind: {} for kind in kinds}
    directions: dict[str, dict[float, StateDict]] = {kind: {r: {} for r in ratios} for kind in kinds}
    spectra: dict[str, dict[str, Spectrum]] = {kind: {} for kind in kinds}
    kept: dict[float, set[int]] = {r: set() for r in ratios}
    matrices: list[str] = []
    for key in models[0]:
        average = mean_tensor(models, key)
        anchors["centered"][key] = average
        if base is not None:
            anchors["original"][key] = base[key]
        if not average.is_floating_point():
            continue
        if not is_matrix(key, average, matrix_keys):
            if base is not None:
                task_sum = accumulator(base[key])
                for model in models:
                    task_sum += model[key] - base[key].to(task_sum.dtype)
                for r in ratios:
                    directions["original"][r][key] = task_sum
            continue
        matrices.append(key)
        for kind in kinds:
            start = average if kind == "centered" else base[key]
            spec = spectrum([model[key].float() - start.float() for model in models])
            spectra[kind][key] = spec
            for r in ratios:
                rank = cart_rank(average.shape, r)
                kept[r].add(rank)
                directions[kind][r][key] = low_rank_sum(spec, rank)
    if ranks is None:
        ranks = list(range(max((spec[0].full_rank for spec in spectra["centered"].values()), default=0) + 1))
    return Sweep(
        tasks=list(tasks) if tasks is not None else [f"task{i}" for i in range(len(models))],
        ratios=ratios,
        lam={"centered": lam_cart, "original": lam_ta},
        anchors=anchors,
        directions=directions,
        kept_ranks={r: sorted(kept[r]) for r in ratios},
        matrices=matrices,
        layers=_layer_metrics(spectra, list(ranks)),
    )


def _layer_metrics(spectra: dict[str, dict[str, Spectrum]], ranks: list[int]) -> LayerMetrics:
    layers = list(spectra["centered"])
    return LayerMetrics(
        ranks=ranks,
        layers=layers,
        full_rank={key: spectra["centered"][key][0].full_rank for key in layers},
        interference={kind: {key: interference(spec, ranks) for key, spec in by_key.items()} for kind, by_key in spectra.items()},
        reconstruction={kind: {key: reconstruction_error(spec, ranks) for key, spec in by_key.items()} for kind, by_key in spectra.items()},
        energy={kind: {key: reconstruction_error(spec, [0])[0] for key, spec in by_key.items()} for kind, by_key in spectra.items()},
    )


def layer_metrics(
    models: Sequence[Mapping[str, torch.Tensor]],
    base: Mapping[str, torch.Tensor] | None,
    ranks: Sequence[int] | None = None,
    matrix_keys: str = DEFAULT_MATRIX_KEYS,
) -> LayerMetrics:
    """Per-layer I(k) (eq. 5) and R(k) (eq. 7) of centered and (with theta_0) original task vectors."""
    return rank_sweep(models, base, ratios=(), ranks=ranks, matrix_keys=matrix_keys).layers


# ----------------------------------------------------------------------------- accuracy
@dataclass
class AccuracyCurve:
    """Mean accuracy over tasks (a fraction in [0, 1]) for each kept-rank ratio and kind."""

    ratios: list[float]
    mean: dict[str, list[float]]  # kind -> per ratio
    per_task: dict[str, list[dict[str, float]]]  # kind -> per ratio -> task -> accuracy
    average: float  # theta_avg
    average_per_task: dict[str, float]
    pretrained: float | None  # theta_0
    pretrained_per_task: dict[str, float] | None = None
    lam: dict[str, float] = field(default_factory=dict)


Evaluate = Callable[[Mapping[str, torch.Tensor]], dict[str, float]]


def accuracy_curve(sweep: Sweep, evaluate: Evaluate) -> AccuracyCurve:
    """Evaluate every merge of the sweep; `evaluate` is e.g. TaskPool.evaluator(split).accuracy."""
    mean: dict[str, list[float]] = {}
    per_task: dict[str, list[dict[str, float]]] = {}
    for kind in sweep.kinds:
        per_task[kind] = [evaluate(sweep.state_dict(kind, r)) for r in sweep.ratios]
        mean[kind] = [_mean(scores) for scores in per_task[kind]]
    average = evaluate(sweep.anchors["centered"])
    pretrained = evaluate(sweep.anchors["original"]) if "original" in sweep.anchors else None
    return AccuracyCurve(
        ratios=list(sweep.ratios),
        mean=mean,
        per_task=per_task,
        average=_mean(average),
        average_per_task=average,
        pretrained=_mean(pretrained) if pretrained is not None else None,
        pretrained_per_task=pretrained,
        lam={kind: sweep.lam[kind] for kind in sweep.kinds},
    )


def _mean(scores: Mapping[str, float]) -> float:
    return sum(scores.values()) / len(scores)


def column_mean(series: Mapping[str, list[float]]) -> list[float]:
    """The mean over layers of per-layer series (one value per rank)."""
    rows = list(series.values())
    return [sum(column) / len(rows) for column in zip(*rows)] if rows else []


def mean_relative(metrics: LayerMetrics, kind: str, index: int) -> float:
    """The mean over layers (of nonzero energy) of R(k) / R(0) at ranks[index]."""
    values = [metrics.reconstruction[kind][layer][index] / metrics.energy[kind][layer]
              for layer in metrics.layers if metrics.energy[kind][layer] > 0]
    return sum(values) / len(values) if values else 0.0
