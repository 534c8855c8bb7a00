"""Accuracy vs kept rank of low-rank task vectors, and why: row-space interference and reconstruction error.

Choi et al. 2024, "Revisiting Weight Averaging for Model Merging" (CART), https://arxiv.org/abs/2412.12153
(paper 000, /work/shared/seeds/000_*.txt). What this module computes, as we read the paper:

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

One SVD per task, matrix and kind serves every ratio and rank.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from mima.analysis.common import (
    StateDict,
    add_model_arguments,
    add_output_arguments,
    load_model_set,
    output_dir,
    run_iterations,
    save_figure,
    task_context,
    write_json,
)
from mima.errors import MimaError
from mima.merging.cart import DEFAULT_MATRIX_KEYS, cart_rank, is_matrix
from mima.merging.registry import combine
from mima.merging.uniform import mean_tensor
from mima.state_dicts import accumulator, check_compatible

NAME = "rank-sweep"
FILES = ("rank-sweep.json", "rank-sweep.png", "rank-sweep_layers.png")
PAPER = "https://arxiv.org/abs/2412.12153"
DEFAULT_RATIOS = (0.0, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.75, 1.0)
DEFAULT_LAM_CART = 1.0
DEFAULT_LAM_TA = 0.3
KINDS = ("centered", "original")
LAM_OPTION = {"centered": "lam_cart", "original": "lam_ta"}


# ----------------------------------------------------------------------------- spectra and metrics
@dataclass
class Spectrum:
    """The SVD tau_t = U_t diag(s_t) Vh_t of each task's vector for one matrix (float32)."""

    u: list[torch.Tensor]
    s: list[torch.Tensor]
    vh: list[torch.Tensor]

    @property
    def full_rank(self) -> int:
        return int(self.s[0].numel())


def spectrum(vectors: Sequence[torch.Tensor]) -> Spectrum:
    parts = [torch.linalg.svd(vector.float(), full_matrices=False) for vector in vectors]
    return Spectrum([p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts])


def low_rank_sum(spec: Spectrum, rank: int) -> torch.Tensor:
    """sum_t SVD_rank(tau_t)."""
    k = min(rank, spec.full_rank)
    total = torch.zeros(spec.u[0].shape[0], spec.vh[0].shape[1], dtype=torch.float32)
    for u, s, vh in zip(spec.u, spec.s, spec.vh):
        total += (u[:, :k] * s[:k]) @ vh[:k]
    return total


def interference(spec: Spectrum, ranks: Sequence[int]) -> list[float]:
    """I(k) of eq. 5 for each k in `ranks` (k above the full rank counts as the full rank)."""
    top = min(max(ranks, default=0), spec.full_rank)
    if top == 0:
        return [0.0 for _ in ranks]
    weights = []
    for s in spec.s:
        norm = float(s.double().square().sum().sqrt())
        weights.append((s[:top].double() / norm) if norm > 0 else torch.zeros(top, dtype=torch.float64))
    values = [0.0 for _ in ranks]
    count = len(spec.s)
    for i in range(count):
        for j in range(i + 1, count):
            block = weights[i][:, None] * (spec.vh[i][:top].double() @ spec.vh[j][:top].double().T) * weights[j][None, :]
            # prefix[a, b] = squared Frobenius norm of the leading (a+1) x (b+1) block: every k at once
            prefix = block.square().cumsum(0).cumsum(1)
            for index, rank in enumerate(ranks):
                k = min(rank, top)
                if k > 0:
                    values[index] += 2.0 * math.sqrt(float(prefix[k - 1, k - 1]))
    return values


def reconstruction_error(spec: Spectrum, ranks: Sequence[int]) -> list[float]:
    """R(k) of eq. 7 for each k in `ranks`: the squared singular values left out, summed over tasks."""
    tails = [s.double().square().flip(0).cumsum(0).flip(0) for s in spec.s]  # tail[k] = sum_{l >= k} s_l^2
    return [sum(float(tail[k]) if k < spec.full_rank else 0.0 for tail in tails) for k in ranks]


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
        ranks = list(range(max((s.full_rank for s in spectra["centered"].values()), default=0) + 1))
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
        full_rank={key: spectra["centered"][key].full_rank for key in layers},
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
    """Evaluate every merge of the sweep; `evaluate` is e.g. TaskContext.evaluator(split).accuracy."""
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


# ----------------------------------------------------------------------------- plots
COLORS = {"centered": "tab:orange", "original": "tab:blue"}
LABELS = {"centered": "centered (CART): theta_avg + lam sum_t SVD_k(theta_t - theta_avg)",
          "original": "original: theta_0 + lam sum_t SVD_k(theta_t - theta_0)"}


def plot_accuracy(curve: AccuracyCurve, title: str):
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8.5, 5.8))
    x = [100 * r for r in curve.ratios]
    for kind, values in curve.mean.items():
        axes.plot(x, [100 * v for v in values], marker="o", color=COLORS[kind],
                  label=f"{LABELS[kind]}, lam = {curve.lam[kind]:g}")
    axes.axhline(100 * curve.average, color="gray", linestyle="--", label=f"theta_avg (uniform): {100 * curve.average:.1f}%")
    if curve.pretrained is not None:
        axes.axhline(100 * curve.pretrained, color="black", linestyle=":", label=f"theta_0 (pretrained): {100 * curve.pretrained:.1f}%")
    # the interesting ratios sit near 0 (the paper's peak is near 8%): linear up to 2%, log beyond
    axes.set_xscale("symlog", linthresh=2.0, linscale=0.5)
    axes.set_xticks(x)
    axes.set_xticklabels([f"{v:g}" for v in x])
    axes.minorticks_off()
    axes.set_xlabel("kept rank k / full rank (%)")
    axes.set_ylabel("mean accuracy over tasks (%)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)  # below: never over the curves
    return figure


def plot_layers(metrics: LayerMetrics, title: str):
    """Mean over layers with a min-max band: I(k), R(k), and R(k) / R(0)."""
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(1, 3, figsize=(15, 4.6))
    ranks = metrics.ranks
    for kind in metrics.kinds:
        relative = {layer: [v / metrics.energy[kind][layer] if metrics.energy[kind][layer] > 0 else 0.0 for v in values]
                    for layer, values in metrics.reconstruction[kind].items()}
        for axes, series in zip(panels, (metrics.interference[kind], metrics.reconstruction[kind], relative)):
            stacked = torch.tensor([series[layer] for layer in metrics.layers], dtype=torch.float64)
            axes.plot(ranks, stacked.mean(0).tolist(), color=COLORS[kind], label=f"{kind}: mean over {len(metrics.layers)} layers")
            axes.fill_between(ranks, stacked.min(0).values.tolist(), stacked.max(0).values.tolist(),
                              color=COLORS[kind], alpha=0.2, label=f"{kind}: min-max over layers")
    names = (
        ("row-space interference I(k) (eq. 5)", "I(k) (dimensionless)"),
        ("reconstruction error R(k) (eq. 7)", "R(k) = sum_t ||tau_t - SVD_k(tau_t)||_F^2 (weight units^2)"),
        ("relative reconstruction error R(k) / R(0)", "fraction of sum_t ||tau_t||_F^2 not kept"),
    )
    for axes, (panel_title, ylabel) in zip(panels, names):
        axes.set_title(panel_title, fontsize=10)
        axes.set_xlabel("kept rank k")
        axes.set_ylabel(ylabel, fontsize=9)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(title)
    return figure


# ----------------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--ratios", type=float, nargs="+", default=list(DEFAULT_RATIOS),
                        help="kept-rank ratios in [0, 1] for the accuracy curve (default: %(default)s)")
    parser.add_argument("--ranks", type=int, nargs="+",
                        help="ranks k for I(k) and R(k) (default: every rank from 0 to full)")
    parser.add_argument("--lam-cart", type=float, default=DEFAULT_LAM_CART, help="lam of the centered merges (default: 1.0)")
    parser.add_argument("--lam-ta", type=float, default=DEFAULT_LAM_TA,
                        help="lam of the original-task-vector merges (default: 0.3, the top of paper 000's grid)")
    parser.add_argument("--split", choices=("test", "val"), default="test", help="data split for accuracy (default: test)")
    parser.add_argument("--matrix-keys", default=DEFAULT_MATRIX_KEYS,
                        help="regular expression of the 2-D weights that get low rank (default: attention and MLP weights)")
    parser.add_argument("--no-accuracy", action="store_true", help="only I(k) and R(k): no data, no config needed")
    add_output_arguments(parser, NAME)


def _check_options(options: argparse.Namespace) -> None:
    for ratio in options.ratios:
        if not (math.isfinite(ratio) and 0 <= ratio <= 1):
            raise MimaError(f"--ratios {ratio:g}: expected fractions of the rank in [0, 1]")
    if len(set(options.ratios)) != len(options.ratios):
        raise MimaError(f"--ratios {' '.join(f'{r:g}' for r in options.ratios)}: a ratio is given twice")
    for rank in options.ranks or []:
        if rank < 0:
            raise MimaError(f"--ranks {rank}: expected ranks >= 0")
    for option, value in (("--lam-cart", options.lam_cart), ("--lam-ta", options.lam_ta)):
        if not math.isfinite(value):
            raise MimaError(f"{option} {value}: expected a finite number")
    try:
        re.compile(options.matrix_keys)
    except re.error as exc:
        raise MimaError(f"--matrix-keys {options.matrix_keys!r}: not a regular expression ({exc})") from None


def main(options: argparse.Namespace) -> None:
    started = time.perf_counter()
    _check_options(options)
    model_set = load_model_set(options.models, options.base, options.config)
    named = dict(zip(model_set.tasks, model_set.models))
    if model_set.base is not None:
        named["--base"] = model_set.base
    check_compatible(named)
    if not any(t.is_floating_point() and is_matrix(k, t, options.matrix_keys) for k, t in model_set.models[0].items()):
        raise MimaError(f"--matrix-keys {options.matrix_keys!r}: matches no 2-D weight of the models")
    context = None if options.no_accuracy else task_context(model_set)
    folder = output_dir(options.out, model_set.run_dir, NAME, FILES, options.overwrite)
    sweep = rank_sweep(model_set.models, model_set.base, sorted(options.ratios), options.ranks,
                       options.lam_cart, options.lam_ta, options.matrix_keys, model_set.tasks)
    curve = None
    if context is not None:
        if torch.cuda.is_available():
            context.encoder.to("cuda")
        curve = accuracy_curve(sweep, context.evaluator(options.split).accuracy)
    n = run_iterations(model_set.config)
    label = f"{len(model_set.tasks)} tasks" + (f", N = {n}" if n is not None else "")
    outputs = [folder / FILES[0], folder / FILES[2]]
    if curve is not None:
        save_figure(plot_accuracy(curve, f"Accuracy vs kept rank of low-rank task vectors ({label}, {options.split} split)"),
                    folder / FILES[1])
        outputs.insert(1, folder / FILES[1])
    save_figure(plot_layers(sweep.layers, f"Per-layer I(k) and R(k) of centered vs original task vectors ({label}, "
                                          f"{len(sweep.layers.layers)} matrices)"), folder / FILES[2])
    seconds = time.perf_counter() - started
    write_json(folder / FILES[0], to_json(sweep, curve, model_set, options, n, seconds))
    print(summary(sweep, curve, n, options.split))
    print(f"wrote {', '.join(str(p) for p in outputs)} in {seconds:.1f} s")


def to_json(sweep: Sweep, curve: AccuracyCurve | None, model_set, options, n: int | None, seconds: float) -> dict:
    metrics = sweep.layers
    layers = {
        layer: {
            "full_rank": metrics.full_rank[layer],
            **{kind: {"I": metrics.interference[kind][layer], "R": metrics.reconstruction[kind][layer],
                      "R0": metrics.energy[kind][layer]} for kind in metrics.kinds},
        }
        for layer in metrics.layers
    }
    mean = {kind: {"I": _column_mean(metrics.interference[kind]), "R": _column_mean(metrics.reconstruction[kind])}
            for kind in metrics.kinds}
    accuracy = None
    if curve is not None:
        accuracy = {
            "unit": "fraction of test examples classified correctly, mean over tasks",
            "split": options.split,
            **{kind: {"lam": curve.lam[kind], "mean": curve.mean[kind], "per_task": curve.per_task[kind]} for kind in curve.mean},
            "theta_avg": {"mean": curve.average, "per_task": curve.average_per_task},
            "theta_0": None if curve.pretrained is None else {"mean": curve.pretrained, "per_task": curve.pretrained_per_task},
        }
    return {
        "analysis": NAME,
        "paper": PAPER,
        "run": str(model_set.run_dir) if model_set.run_dir is not None else None,
        "N": n,
        "tasks": sweep.tasks,
        "ratios": sweep.ratios,
        "kept_ranks": {f"{r:g}": ranks for r, ranks in sweep.kept_ranks.items()},
        "lam": {kind: sweep.lam[kind] for kind in sweep.kinds},
        "matrix_keys": options.matrix_keys,
        "accuracy": accuracy,
        "layers": {"ranks": metrics.ranks, "mean_over_layers": mean, "per_layer": layers,
                   "I": "eq. 5 with singular values divided by ||tau_t||_F", "R": "eq. 7, sum_t ||tau_t - SVD_k(tau_t)||_F^2"},
        "seconds": seconds,
    }


def _column_mean(series: Mapping[str, list[float]]) -> list[float]:
    rows = list(series.values())
    return [sum(column) / len(rows) for column in zip(*rows)] if rows else []


def summary(sweep: Sweep, curve: AccuracyCurve | None, n: int | None, split: str) -> str:
    head = f"rank-sweep: {len(sweep.tasks)} tasks" + (f", N = {n}" if n is not None else "") + \
        f", {len(sweep.matrices)} low-rank matrices, " + ", ".join(f"{LAM_OPTION[k]} = {sweep.lam[k]:g}" for k in sweep.kinds)
    lines = [head]
    if curve is not None:
        kinds = list(curve.mean)
        lines.append(f"mean {split} accuracy (%) vs kept rank:")
        lines.append("  ratio  rank   " + "".join(f"{kind:>10}" for kind in kinds))
        for index, ratio in enumerate(curve.ratios):
            ranks = "/".join(str(r) for r in sweep.kept_ranks[ratio])
            lines.append(f"  {100 * ratio:4g}%  {ranks:>5}  " + "".join(f"{100 * curve.mean[k][index]:10.1f}" for k in kinds))
        best = max(range(len(curve.ratios)), key=lambda i: curve.mean["centered"][i])
        line = f"theta_avg {100 * curve.average:.1f}%"
        if curve.pretrained is not None:
            line += f", theta_0 {100 * curve.pretrained:.1f}%"
        lines.append(line + f"; best centered {100 * curve.mean['centered'][best]:.1f}% at {100 * curve.ratios[best]:g}%")
    metrics = sweep.layers
    full = max(metrics.full_rank.values(), default=0)
    picks = sorted({k for k in (1, cart_rank((full,), 0.08), full) if k in metrics.ranks and k > 0})
    for k in picks:
        index = metrics.ranks.index(k)
        parts = [f"{kind}: I = {_column_mean(metrics.interference[kind])[index]:.3f}, "
                 f"R/R(0) = {_mean_relative(metrics, kind, index):.3f}" for kind in metrics.kinds]
        lines.append(f"k = {k} of {full} (mean over layers): " + "; ".join(parts))
    return "\n".join(lines)


def _mean_relative(metrics: LayerMetrics, kind: str, index: int) -> float:
    values = [metrics.reconstruction[kind][layer][index] / metrics.energy[kind][layer]
              for layer in metrics.layers if metrics.energy[kind][layer] > 0]
    return sum(values) / len(values) if values else 0.0
