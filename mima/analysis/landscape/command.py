"""`mima analyze landscape MODELS --tasks A B`: the error landscape on the plane of two task vectors.

Writes landscape.json (the grid, the marked points, the basis) and landscape.png, by default into
RUN/analysis/landscape.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict

import numpy as np
import torch

from mima.analysis.common import output_folder, write_json
from mima.analysis.landscape.compute import (
    Landscape,
    compute_landscape,
    data_free_method,
    error_function,
    merged_models,
)
from mima.analysis.landscape.options import NAME
from mima.core.errors import MimaError
from mima.pools import ModelPool, model_pool

FILES = ("landscape.json", "landscape.png")


def _check_options(options: argparse.Namespace) -> None:
    if options.resolution < 2:
        raise MimaError(f"--resolution {options.resolution}: expected at least 2 grid points per axis")
    if not math.isfinite(options.margin) or options.margin < 0:
        raise MimaError(f"--margin {options.margin}: expected a finite fraction >= 0")
    if options.examples < 1:
        raise MimaError(f"--examples {options.examples}: expected a positive number of test examples")
    if options.tasks[0] == options.tasks[1]:
        raise MimaError(f"--tasks {options.tasks[0]} {options.tasks[1]}: expected two different tasks")
    for name in options.merges:
        method = data_free_method(name)
        if options.lam is not None and "lam" in method.defaults:
            try:
                method.hyperparameters({"lam": options.lam})
            except MimaError as exc:
                raise MimaError(f"--lam: {exc}") from None


def main(options: argparse.Namespace) -> None:
    from mima.analysis.figures import save_figure
    from mima.analysis.landscape.plot import landscape_title, plot_landscape

    started = time.perf_counter()
    _check_options(options)
    models = model_pool(options.models, options.base, options.config)
    base = models.require_base()
    pair = tuple(options.tasks)
    for task in pair:
        if task not in models.tasks:
            raise MimaError(f"--tasks {task}: not among the models' tasks ({', '.join(models.tasks)})")
    folder = output_folder(options.out, models.run, NAME, FILES, options.overwrite, create=False,
                           inputs=options.read_paths)
    pool = models.task_pool()
    for task in pair:
        if task not in pool.heads:
            raise MimaError(f"--tasks {task}: the config {models.config} defines no task of that name ({', '.join(pool.tasks)})")
    folder.mkdir(parents=True, exist_ok=True)  # only now: a mistake above leaves no empty folder behind
    if torch.cuda.is_available():
        pool.encoder.to("cuda")  # evaluation only; the geometry stays on the CPU in float64
    errors, counts = error_function(pool, pair, options.examples)
    merges = merged_models(options.merges, models.models, base, options.lam, pool)
    landscape, _ = compute_landscape(models.tasks, models.models, base, pair, errors,
                                     options.resolution, options.margin, merges)
    landscape.examples = counts
    n = models.iterations()
    seconds = time.perf_counter() - started
    write_json(folder / FILES[0], to_json(landscape, models, n, seconds))
    source = models.run.path.name if models.run is not None else ", ".join(models.tasks)
    save_figure(plot_landscape(landscape, landscape_title(source, n, pair, counts)), folder / FILES[1])
    print(summary(landscape, n))
    print(f"wrote {folder / FILES[0]} and {folder / FILES[1]} in {time.perf_counter() - started:.1f} s")


def to_json(landscape: Landscape, models: ModelPool, n: int | None, seconds: float) -> dict:
    task_a, task_b = landscape.tasks
    return {
        "run": str(models.run.path) if models.run is not None else None,
        "N": n,
        "tasks": [task_a, task_b],
        "all_tasks": models.tasks,
        "split": "test",
        "examples": landscape.examples,
        "error_unit": "percent top-1 error",
        "basis": {
            "norm_tau_a": landscape.norm_a,
            "norm_tau_b": landscape.norm_b,
            "cos_tau_a_tau_b": landscape.cosine,
            "angle_degrees": math.degrees(math.acos(max(-1.0, min(1.0, landscape.cosine)))),
            "u": f"tau_{task_a} / ||tau_{task_a}||",
            "v": f"unit part of tau_{task_b} orthogonal to u",
        },
        "grid": {"x": landscape.x, "y": landscape.y, "layout": "error[task][row over y][column over x]",
                 "error": landscape.error},
        "points": [asdict(point) for point in landscape.points],
        "seconds": seconds,
    }


def summary(landscape: Landscape, n: int | None) -> str:
    task_a, task_b = landscape.tasks
    angle = math.degrees(math.acos(max(-1.0, min(1.0, landscape.cosine))))
    lines = [
        f"landscape{'' if n is None else f' N={n}'}: ||tau_{task_a}|| = {landscape.norm_a:.4g}, "
        f"||tau_{task_b}|| = {landscape.norm_b:.4g}, cos = {landscape.cosine:.3f} ({angle:.1f} deg)",
        f"  {'point':<18}{'x':>9}{'y':>9}{'off-plane':>11}  error % {task_a}/{task_b}/mean (projection)",
    ]
    for p in landscape.points:
        own = "/".join(f"{p.error[k]:.1f}" for k in (task_a, task_b, "mean"))
        proj = "" if p.kind != "merge" else "  (" + "/".join(f"{p.projected_error[k]:.1f}" for k in (task_a, task_b, "mean")) + ")"
        x, y = (0.0 if abs(value) < 5e-4 else value for value in (p.x, p.y))  # no "-0.000" from rounding
        lines.append(f"  {p.name:<18}{x:>9.3f}{y:>9.3f}{p.off_plane:>11.3f}  {own}{proj}")
    mean = np.asarray(landscape.error["mean"])
    row, col = np.unravel_index(int(mean.argmin()), mean.shape)
    lows = ", ".join(f"{task} {float(np.min(landscape.error[task])):.1f}%" for task in (task_a, task_b))
    lines.append(f"  grid of {len(landscape.x)}x{len(landscape.y)}: lowest error {lows}; lowest mean "
                 f"{mean.min():.1f}% at ({landscape.x[col]:.3f}, {landscape.y[row]:.3f})")
    return "\n".join(lines)
