"""Figures of the cosine analysis (paper 001, Fig. 5 and 11):
  * heatmaps: the tau and delta matrices of selected phases (first, last and evenly spaced between);
  * phase boxes: box plots of the off-diagonal values per phase, tau and delta, one row per run;
  * final vs N: box plots of the final tau's off-diagonal values per N (several runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mima.analysis.cosine.compute import RunCosines, heatmap_phases, off_diagonal
from mima.analysis.figures import plt, save_figure


def plot_heatmaps(run: RunCosines, path: Path) -> None:
    chosen = [run.phases[i] for i in heatmap_phases(len(run.phases))]
    size = len(run.tasks)
    figure, axes = plt.subplots(2, len(chosen), figsize=(2.4 * len(chosen) + 1.2, 5.6), squeeze=False)
    image = None
    for column, phase in enumerate(chosen):
        for row, (name, matrix) in enumerate((("tau", phase.cos_tau), ("delta", phase.cos_delta))):
            axis = axes[row][column]
            image = axis.imshow(matrix, vmin=-1, vmax=1, cmap="RdBu_r")
            if size <= 8:  # the numbers stay readable only for small T
                for i in range(size):
                    for j in range(size):
                        axis.text(j, i, f"{matrix[i, j]:.2f}", ha="center", va="center", fontsize=9 if size <= 5 else 7)
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
        # each series drawn entirely in its own colour (outline, whiskers, caps, outliers), the median
        # in black: with matplotlib's default orange median a collapsed tau box looked like a delta box
        boxes_tau, boxes_delta = (
            axis.boxplot(values, positions=positions + shift, widths=width, patch_artist=True,
                         boxprops={"facecolor": colour, "edgecolor": colour, "alpha": 0.6},
                         whiskerprops={"color": colour}, capprops={"color": colour},
                         flierprops={"markeredgecolor": colour, "marker": marker},
                         medianprops={"color": "black", "linewidth": 1.2})
            for values, shift, colour, marker in ((tau, -0.2, "tab:blue", "o"), (delta, 0.2, "tab:orange", "x")))
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
