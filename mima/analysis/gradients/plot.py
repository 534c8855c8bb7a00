"""The figure of the gradients analysis (paper 004): (a) each epoch's share of the total gradient
norm, (b) cos(g_k, g_1), (c) test accuracy of the task-arithmetic merges of one-epoch and converged
task vectors."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from mima.analysis.figures import plt, save_figure
from mima.core.names import ZERO_SHOT

def plot_gradients(results: Mapping, path: Path) -> None:
    """(a) share of the total gradient norm per epoch, (b) cos(g_k, g_1), (c) merged test accuracy."""
    tasks = list(results["tasks"])
    per_task = results["per_task"]
    epochs = len(per_task[tasks[0]]["share"])
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    width = 0.8 / len(tasks)
    xs = range(1, epochs + 1)
    for index, task in enumerate(tasks):
        offset = (index - (len(tasks) - 1) / 2) * width
        axes[0].bar([x + offset for x in xs], per_task[task]["share"], width=width, label=task)
        axes[1].plot(list(xs), per_task[task]["cos_first"], marker="o", label=task)
    axes[0].axhline(1 / epochs, color="grey", linestyle=":", linewidth=1, label="equal share (1/E)")
    axes[0].set(xlabel="epoch k", ylabel="||g_k|| / sum_k' ||g_k'||  (fraction)", title="(a) share of the total gradient norm")
    axes[1].set(xlabel="epoch k", ylabel="cos(g_k, g_1)", title="(b) alignment with the first epoch's gradient")
    axes[1].set_ylim(min(0.0, min(min(per_task[t]["cos_first"]) for t in tasks)) - 0.05, 1.05)
    for axis in axes[:2]:
        axis.set_xticks(list(xs))
        axis.legend(fontsize=8)
        axis.grid(axis="y", alpha=0.3)

    merged = results["merged"]
    groups = tasks + ["mean"]
    for index, (name, label) in enumerate((("one_epoch", "1 epoch"), ("converged", f"{epochs} epochs"))):
        values = [100 * merged[name]["test"][t] for t in tasks] + [100 * merged[name]["test_mean"]]
        offset = (index - 0.5) * 0.38
        bars = axes[2].bar([g + offset for g in range(len(groups))], values, width=0.38,
                           label=f"{label} (lam={merged[name]['lam']:g})")
        axes[2].bar_label(bars, fmt="%.0f", fontsize=7)
    zero_shot = [100 * per_task[t]["test_accuracy"][ZERO_SHOT] for t in tasks]
    zero_shot.append(sum(zero_shot) / len(zero_shot))
    axes[2].scatter(range(len(groups)), zero_shot, marker="_", s=900, color="black", linewidths=2, zorder=3,
                    label="zero-shot (theta_0)")
    axes[2].set_xticks(range(len(groups)), groups, rotation=20)
    axes[2].set(ylabel="test accuracy (%)", ylim=(0, 105), title="(c) task arithmetic merge: 1 epoch vs converged")
    axes[2].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=3, markerscale=0.4)
    axes[2].grid(axis="y", alpha=0.3)
    settings = results["settings"]
    figure.suptitle(f"Task vectors vs per-epoch gradients (paper 004): {settings['optimizer']}, lr={settings['lr']:g}, "
                    f"batch {settings['batch_size']}, {epochs} epochs per task")
    save_figure(figure, path)
