"""Alignment of the task models during MIMA: pairwise cosines of tau and delta, phase by phase.

Paper 001 (MIMA), Fig. 5 and Fig. 11. At the end of phase i the trainer's sync callback logs, over
the trainable parameters of the encoder,
    tau_t   = theta_t - theta_0                 (the task vector so far)
    delta_t = theta_t - avg_(i-1)               (the phase's own update; avg_0 = theta_0)
and the T x T matrices of their pairwise cosines (metrics.jsonl, keys cos_tau and cos_delta). This
analysis needs no data and no model: it reads those matrices and draws
  * cosine_heatmaps_N<n>.png  the matrices of selected phases (first, last and evenly spaced between);
  * cosine_phases.png         box plots of the off-diagonal values per phase, tau and delta, one row per run;
  * cosine_vs_N.png           box plots of the final tau's off-diagonal values per N (several runs).
Under MIMA the tau cosines rise phase after phase while the delta cosines stay low: the models are
pulled into a shared region by the averaging, not by similar updates.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import yaml

from mima.analysis.common import output_dir, save_figure, write_json
from mima.errors import MimaError
from mima.run_dir import RunFolder

NAME = "cosine"
MAX_HEATMAP_PHASES = 6


@dataclass
class PhaseCosines:
    phase: int
    step: int  # per-task optimiser steps done at the end of the phase
    cos_tau: np.ndarray  # T x T
    cos_delta: np.ndarray  # T x T


@dataclass
class RunCosines:
    path: Path
    n: int
    tasks: list[str]
    phases: list[PhaseCosines]

    @property
    def final(self) -> PhaseCosines:
        return self.phases[-1]


def off_diagonal(matrix: np.ndarray) -> np.ndarray:
    """The values above the diagonal: each pair of tasks once."""
    rows, cols = np.triu_indices(matrix.shape[0], k=1)
    return matrix[rows, cols]


def read_run(path: Path) -> RunCosines:
    """The per-phase cosine matrices that `mima fit` logged for the run in `path`."""
    records = RunFolder(path).phase_records()
    if not records:
        raise MimaError(f"{path}: no metrics.jsonl with phase records (is this a `mima fit` run folder?)")
    missing = [r["phase"] for r in records if "cos_tau" not in r or "cos_delta" not in r]
    if missing:
        raise MimaError(f"{path}/metrics.jsonl: phase {missing[0]} has no cos_tau/cos_delta matrices")
    config_file = path / "config.yaml"
    config = yaml.safe_load(config_file.read_text()) if config_file.is_file() else {}
    n = int((config.get("model") or {}).get("iterations", len(records)))
    phases = [
        PhaseCosines(int(r["phase"]), int(r["step"]), np.array(r["cos_tau"], dtype=float), np.array(r["cos_delta"], dtype=float))
        for r in records
    ]
    return RunCosines(path, n, list(records[0]["tasks"]), phases)


def expand_runs(paths: Sequence[Path]) -> list[Path]:
    """Run folders; a sweep folder (`mima demo`, benchmarks/offline_suite.py) stands for its runs/*."""
    runs: list[Path] = []
    for path in paths:
        if not path.is_dir():
            raise MimaError(f"{path}: no such folder (expected a `mima fit` run folder or a sweep folder)")
        if (path / "metrics.jsonl").is_file():
            runs.append(path)
        elif (path / "runs").is_dir():
            found = sorted(p for p in (path / "runs").iterdir() if (p / "metrics.jsonl").is_file())
            if not found:
                raise MimaError(f"{path}/runs: no run folders with metrics.jsonl")
            runs.extend(found)
        else:
            raise MimaError(f"{path}: neither a run folder (metrics.jsonl) nor a sweep folder (runs/)")
    return runs


def load_runs(paths: Sequence[Path]) -> list[RunCosines]:
    runs = sorted((read_run(path) for path in expand_runs(paths)), key=lambda run: run.n)
    if len({tuple(run.tasks) for run in runs}) > 1:
        raise MimaError(f"the runs have different tasks ({runs[0].path}: {runs[0].tasks}, {runs[-1].path}: {runs[-1].tasks})")
    return runs


def heatmap_phases(count: int, most: int = MAX_HEATMAP_PHASES) -> list[int]:
    """Indices of the phases to draw: all of them up to `most`, else first, last and evenly between."""
    if count <= most:
        return list(range(count))
    return sorted({round(i * (count - 1) / (most - 1)) for i in range(most)})


# ------------------------------------------------------------------------------------------ plots
def plot_heatmaps(run: RunCosines, path: Path) -> None:
    chosen = [run.phases[i] for i in heatmap_phases(len(run.phases))]
    size = len(run.tasks)
    figure, axes = plt.subplots(2, len(chosen), figsize=(2.6 * len(chosen) + 1.2, 5.6), squeeze=False)
    image = None
    for column, phase in enumerate(chosen):
        for row, (name, matrix) in enumerate((("tau", phase.cos_tau), ("delta", phase.cos_delta))):
            axis = axes[row][column]
            image = axis.imshow(matrix, vmin=-1, vmax=1, cmap="RdBu_r")
            if size <= 8:  # the numbers stay readable only for small T
                for i in range(size):
                    for j in range(size):
                        axis.text(j, i, f"{matrix[i, j]:.2f}", ha="center", va="center", fontsize=7)
            labels = run.tasks if size <= 10 else [str(i) for i in range(size)]
            axis.set_xticks(range(size), labels, rotation=90, fontsize=7)
            axis.set_yticks(range(size), labels if column == 0 else [], fontsize=7)
            axis.set_title(f"{name}, phase {phase.phase}/{run.n}\n(step {phase.step})", fontsize=8)
    figure.suptitle(f"Pairwise cosine of task vectors tau (top) and phase updates delta (bottom), N = {run.n}", fontsize=10)
    figure.colorbar(image, ax=axes, shrink=0.8, label="cosine similarity")
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_phase_boxes(runs: Sequence[RunCosines], path: Path) -> None:
    figure, axes = plt.subplots(len(runs), 1, figsize=(max(6.0, 0.45 * max(len(r.phases) for r in runs) + 3), 2.8 * len(runs)),
                                squeeze=False, sharey=True)
    for axis, run in zip(axes[:, 0], runs):
        positions = np.arange(1, len(run.phases) + 1)
        tau = [off_diagonal(p.cos_tau) for p in run.phases]
        delta = [off_diagonal(p.cos_delta) for p in run.phases]
        width = 0.35
        boxes_tau = axis.boxplot(tau, positions=positions - 0.2, widths=width, patch_artist=True)
        boxes_delta = axis.boxplot(delta, positions=positions + 0.2, widths=width, patch_artist=True)
        for boxes, colour in ((boxes_tau, "tab:blue"), (boxes_delta, "tab:orange")):
            for patch in boxes["boxes"]:
                patch.set_facecolor(colour)
                patch.set_alpha(0.5)
        axis.set_xticks(positions, [str(p.phase) for p in run.phases])
        axis.set_xlabel(f"phase (K = {run.phases[0].step} steps each)")
        axis.set_ylabel("pairwise cosine")
        axis.set_title(f"N = {run.n}: cosines over all task pairs at the end of each phase", fontsize=9)
        axis.axhline(0, color="grey", linewidth=0.6)
        axis.grid(alpha=0.3)
        axis.legend([boxes_tau["boxes"][0], boxes_delta["boxes"][0]],
                    ["tau = theta_t - theta_0", "delta = theta_t - previous average"], fontsize=7, loc="upper left")
    save_figure(figure, path)


def plot_final_vs_n(runs: Sequence[RunCosines], path: Path) -> None:
    figure, axis = plt.subplots(figsize=(6.0, 4.0))
    values = [off_diagonal(run.final.cos_tau) for run in runs]
    axis.boxplot(values, tick_labels=[str(run.n) for run in runs])
    axis.plot(range(1, len(runs) + 1), [v.mean() for v in values], "o--", color="tab:red", label="mean over task pairs")
    axis.set_xlabel("MIMA iterations N (same budget S per task)")
    axis.set_ylabel("pairwise cosine of final task vectors tau")
    axis.set_title("Task-vector alignment at the end of training vs N")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    save_figure(figure, path)


# ------------------------------------------------------------------------------------ command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", type=Path, nargs="+", help="`mima fit` run folders, or a sweep folder (its runs/*)")
    parser.add_argument("--out", type=Path, help="output folder (default: RUN/analysis/cosine for one folder given)")
    parser.add_argument("--overwrite", action="store_true", help="replace outputs already in --out")


def output_files(runs: Sequence[RunCosines]) -> list[str]:
    files = [f"{NAME}.json", "cosine_phases.png"] + [f"cosine_heatmaps_N{run.n}.png" for run in runs]
    return files + (["cosine_vs_N.png"] if len(runs) > 1 else [])


def analyse(paths: Sequence[Path], out: Path | None = None, overwrite: bool = False) -> dict:
    """Read the runs, write the plots and cosine.json; return what was written to the JSON."""
    started = time.time()
    runs = load_runs(paths)
    if len({run.n for run in runs}) != len(runs):
        raise MimaError("two runs with the same N: give one run per N (compare other settings in separate calls)")
    if out is None and len(paths) > 1:
        raise MimaError("--out is needed when several folders are given")
    folder = output_dir(out, Path(paths[0]), NAME, output_files(runs), overwrite)
    for run in runs:
        plot_heatmaps(run, folder / f"cosine_heatmaps_N{run.n}.png")
    plot_phase_boxes(runs, folder / "cosine_phases.png")
    if len(runs) > 1:
        plot_final_vs_n(runs, folder / "cosine_vs_N.png")
    result = {
        "tasks": runs[0].tasks,
        "runs": [
            {
                "path": str(run.path),
                "N": run.n,
                "phases": [
                    {
                        "phase": p.phase,
                        "step": p.step,
                        "mean_cos_tau": float(off_diagonal(p.cos_tau).mean()) if len(run.tasks) > 1 else math.nan,
                        "mean_cos_delta": float(off_diagonal(p.cos_delta).mean()) if len(run.tasks) > 1 else math.nan,
                        "cos_tau": p.cos_tau.tolist(),
                        "cos_delta": p.cos_delta.tolist(),
                    }
                    for p in run.phases
                ],
            }
            for run in runs
        ],
        "seconds": round(time.time() - started, 2),
    }
    write_json(folder / f"{NAME}.json", result)
    for entry in result["runs"]:
        taus = " ".join(f"{p['mean_cos_tau']:.3f}" for p in entry["phases"])
        deltas = " ".join(f"{p['mean_cos_delta']:.3f}" for p in entry["phases"])
        print(f"N={entry['N']}: mean cos(tau) per phase {taus}\n      mean cos(delta) per phase {deltas}")
    print(f"Wrote {folder} in {result['seconds']:.1f} s")
    result["folder"] = str(folder)
    return result


def main(options: argparse.Namespace) -> None:
    analyse(options.runs, options.out, options.overwrite)
