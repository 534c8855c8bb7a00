"""`mima analyze rank-sweep MODELS`: accuracy vs kept rank of low-rank task vectors, and per-layer
I(k) and R(k) (paper 000). Writes rank-sweep.json, rank-sweep.png (unless --no-accuracy) and
rank-sweep_layers.png, by default into RUN/analysis/rank-sweep.
"""

from __future__ import annotations

import math
import re
import time

import torch

from mima.analysis.common import output_folder, write_json
from mima.analysis.rank_sweep.compute import (
    PAPER,
    AccuracyCurve,
    Sweep,
    accuracy_curve,
    column_mean,
    mean_relative,
    rank_sweep,
)
from mima.analysis.rank_sweep.options import NAME, RankSweepOptions
from mima.core.errors import MimaError
from mima.core.state_dicts import check_compatible
from mima.merging.cart import cart_rank, is_matrix
from mima.pools import ModelPool, model_pool

FILES = ("rank-sweep.json", "rank-sweep.png", "rank-sweep_layers.png")
LAM_OPTION = {"centered": "lam_cart", "original": "lam_ta"}


def _check_options(options: RankSweepOptions) -> None:
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


def main(options: RankSweepOptions) -> None:
    from mima.analysis.figures import save_figure
    from mima.analysis.rank_sweep.plot import plot_accuracy, plot_layers

    started = time.perf_counter()
    _check_options(options)
    models = model_pool(options.models, options.base, options.config)
    named = dict(zip(models.tasks, models.models))
    if models.base is not None:
        named["--base"] = models.base
    check_compatible(named)
    if not any(t.is_floating_point() and is_matrix(k, t, options.matrix_keys) for k, t in models.models[0].items()):
        raise MimaError(f"--matrix-keys {options.matrix_keys!r}: matches no 2-D weight of the models")
    pool = None if options.no_accuracy else models.task_pool()
    folder = output_folder(options.out, models.run, NAME, FILES, options.overwrite, inputs=options.read_paths)
    sweep = rank_sweep(models.models, models.base, sorted(options.ratios), options.ranks,
                       options.lam_cart, options.lam_ta, options.matrix_keys, models.tasks)
    curve = None
    if pool is not None:
        if torch.cuda.is_available():
            pool.encoder.to("cuda")
        curve = accuracy_curve(sweep, pool.evaluator(options.split).accuracy)
    n = models.iterations()
    label = f"{len(models.tasks)} tasks" + (f", N = {n}" if n is not None else "")
    outputs = [folder / FILES[0], folder / FILES[2]]
    if curve is not None:
        save_figure(plot_accuracy(curve, f"Accuracy vs kept rank of low-rank task vectors ({label}, {options.split} split)"),
                    folder / FILES[1])
        outputs.insert(1, folder / FILES[1])
    save_figure(plot_layers(sweep.layers, f"Per-layer I(k) and R(k) of centered vs original task vectors ({label}, "
                                          f"{len(sweep.layers.layers)} matrices)"), folder / FILES[2])
    seconds = time.perf_counter() - started
    write_json(folder / FILES[0], to_json(sweep, curve, models, options, n, seconds))
    print(summary(sweep, curve, n, options.split))
    print(f"wrote {', '.join(str(p) for p in outputs)} in {seconds:.1f} s")


def to_json(sweep: Sweep, curve: AccuracyCurve | None, models: ModelPool, options, n: int | None, seconds: float) -> dict:
    metrics = sweep.layers
    layers = {
        layer: {
            "full_rank": metrics.full_rank[layer],
            **{kind: {"I": metrics.interference[kind][layer], "R": metrics.reconstruction[kind][layer],
                      "R0": metrics.energy[kind][layer]} for kind in metrics.kinds},
        }
        for layer in metrics.layers
    }
    mean = {kind: {"I": column_mean(metrics.interference[kind]), "R": column_mean(metrics.reconstruction[kind])}
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
        "run": str(models.run.path) if models.run is not None else None,
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
        parts = [f"{kind}: I = {column_mean(metrics.interference[kind])[index]:.3f}, "
                 f"R/R(0) = {mean_relative(metrics, kind, index):.3f}" for kind in metrics.kinds]
        lines.append(f"k = {k} of {full} (mean over layers): " + "; ".join(parts))
    return "\n".join(lines)
