"""The figure of the landscape analysis: three contour panels (task A, task B, their mean) on one
error scale, with theta_0, the task models and the merges marked (paper 001, Fig. 7)."""

from __future__ import annotations

import math

import numpy as np

from mima.analysis.figures import plt
from mima.analysis.landscape.compute import Landscape

_MERGE_MARKERS = [("*", "white"), ("P", "tab:orange"), ("X", "tab:pink"), ("D", "tab:cyan"), ("p", "tab:olive"), ("h", "gold")]


def _tex(name: str) -> str:
    return r"\mathrm{" + name.replace("_", r"\_") + "}"


def plot_landscape(landscape: Landscape, title: str):
    """Three contour panels (task A, task B, their mean) on one error scale, the marked points, a legend column."""
    from mpl_toolkits.axes_grid1 import make_axes_locatable

    task_a, task_b = landscape.tasks
    grids = [np.asarray(landscape.error[key]) for key in (task_a, task_b, "mean")]
    low = 5 * math.floor(min(float(g.min()) for g in grids) / 5)
    high = 5 * math.ceil(max(float(g.max()) for g in grids) / 5)
    levels = np.arange(low, max(high, low + 5) + 0.1, 2.5)
    xs, ys = np.asarray(landscape.x), np.asarray(landscape.y)
    # panels keep equal units on both axes, so the angle between the task vectors is drawn true
    ratio = min(max((ys[-1] - ys[0]) / (xs[-1] - xs[0]), 0.5), 2.0)
    figure, axes = plt.subplots(1, 4, figsize=(18, 3.9 * ratio + 1.5), gridspec_kw={"width_ratios": [1, 1, 1, 0.62]})
    panel_titles = [f"{task_a}: test error", f"{task_b}: test error", f"mean error of {task_a} and {task_b}"]
    for ax, grid, panel_title in zip(axes, grids, panel_titles):
        filled = ax.contourf(xs, ys, grid, levels=levels, cmap="viridis")
        ax.contour(xs, ys, grid, levels=levels[::4], colors="white", linewidths=0.5, alpha=0.6)
        ax.set_aspect("equal", adjustable="box")
        bar_axis = make_axes_locatable(ax).append_axes("right", size="4%", pad=0.08)
        figure.colorbar(filled, cax=bar_axis, label="top-1 error (%)", ticks=levels[::4])
        _draw_points(ax, landscape)
        ax.set_title(panel_title)
        ax.set_xlabel(rf"x along $\tau_{{{_tex(task_a)}}}$ (weight-space units, L2)")
        ax.set_xlim(xs[0], xs[-1])
        ax.set_ylim(ys[0], ys[-1])
    axes[0].set_ylabel(rf"y along the part of $\tau_{{{_tex(task_b)}}} \perp \tau_{{{_tex(task_a)}}}$" + "\n(weight-space units, L2)")
    handles, labels = axes[0].get_legend_handles_labels()
    axes[3].axis("off")
    axes[3].legend(handles, labels, loc="center left", fontsize=8, frameon=False, borderaxespad=0)
    figure.suptitle(title)
    return figure


def _draw_points(ax, landscape: Landscape) -> None:
    task_a = landscape.tasks[0]
    for point in landscape.points:
        if point.kind == "task":
            ax.annotate("", xy=(point.x, point.y), xytext=(0, 0), arrowprops={"arrowstyle": "->", "color": "0.8", "lw": 1.5})
    merge_index = 0
    for point in landscape.points:
        size = 60
        if point.kind == "merge":
            marker, colour = _MERGE_MARKERS[merge_index % len(_MERGE_MARKERS)]
            merge_index += 1
            size = 160 if marker == "*" else 70
            label = (f"{point.name} merge of all tasks, at its projection\n(off plane by {point.off_plane:.3g}); "
                     f"mean error {point.error['mean']:.1f}% (projection {point.projected_error['mean']:.1f}%)")
        elif point.kind == "task":
            marker, colour = ("^", "tab:red") if point.name == task_a else ("s", "tab:blue")
            label = rf"$\theta_{{{_tex(point.name)}}}$ (fine-tuned); mean error {point.error['mean']:.1f}%"
        else:
            marker, colour = "o", "black"
            label = rf"$\theta_0$ (pretrained); mean error {point.error['mean']:.1f}%"
        ax.scatter([point.x], [point.y], marker=marker, s=size, c=colour, edgecolors="black", linewidths=0.8,
                   label=label, zorder=3)
    ax.plot([], [], color="0.8", lw=1.5, label="task vectors (grey arrows)")




def landscape_title(source: str, n: int | None, pair: tuple[str, str], examples: dict[str, int]) -> str:
    run = f"{source} (N = {n})" if n is not None else source
    counts = "/".join(map(str, dict.fromkeys(examples.values())))
    return (rf"Error landscape of {run}: the plane through $\theta_0$ spanned by $\tau_{{{_tex(pair[0])}}}$ and "
            rf"$\tau_{{{_tex(pair[1])}}}$ (error on {counts} test examples per task)")
