"""Plots of a sweep over N: merged accuracy vs N, and task-vector alignment vs N."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import fmean, stdev

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mima.core.names import FINE_TUNED, JOINT, ZERO_SHOT  # noqa: E402
from mima.evaluation.results import ModelResult  # noqa: E402


def plot_accuracy_vs_n(results: Sequence[ModelResult], path: Path) -> None:
    n_values = sorted({r.N for r in results})
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    styles = {FINE_TUNED: dict(color="black", linestyle="--"), ZERO_SHOT: dict(color="grey", linestyle=":"),
              JOINT: dict(color="black", linestyle="-.", marker="")}
    labels = {FINE_TUNED: "fine-tuned (each task's own model)", ZERO_SHOT: "zero-shot (pretrained)",
              JOINT: "joint multi-task training (one model, same S)"}
    for model in dict.fromkeys(r.model for r in results):
        # one point per N: the mean over that N's seeds, with the sample standard deviation as an error bar
        by_n: dict[int, list[float]] = {}
        for r in results:
            if r.model == model:
                by_n.setdefault(r.N, []).append(100 * r.mean)
        ns = sorted(by_n)
        means = [fmean(by_n[n]) for n in ns]
        errors = [stdev(by_n[n]) if len(by_n[n]) > 1 else 0.0 for n in ns]
        label = labels.get(model, model)
        style = {"marker": "o", **styles.get(model, {})}
        if any(errors):
            axis.errorbar(ns, means, yerr=errors, capsize=3, label=label, **style)
        else:
            axis.plot(ns, means, label=label, **style)
    axis.set_xscale("log", base=2)
    axis.set_xticks(n_values, [str(n) for n in n_values])
    axis.set_xlabel("MIMA iterations N (fixed budget S per task)")
    axis.set_ylabel("average test accuracy over tasks (%)")
    axis.set_title("Merged-model accuracy vs N")
    axis.grid(alpha=0.3)
    # below the axes: inside, the legend covered the zero-shot and fine-tuned points it explains
    axis.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def plot_cosine_vs_n(
    pairwise_cos_tau: Mapping[int, Sequence[float]],
    phase_records: Mapping[int, Sequence[Mapping]],
    path: Path,
) -> None:
    """Left: box plot of the final task vectors' pairwise cosines per N (paper 001 Fig. 5; with
    several seeds at one N, the pairs of every seed). Right: mean pairwise cosine of tau and delta at
    the end of each phase (paper 001 Fig. 11; the caller passes one run per N)."""
    n_values = sorted(pairwise_cos_tau)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.boxplot([list(pairwise_cos_tau[n]) for n in n_values], tick_labels=[str(n) for n in n_values],
                 medianprops={"color": "black"})  # not the default orange, the colour of delta on the right
    left.set_xlabel("MIMA iterations N")
    left.set_ylabel("pairwise cosine of final task vectors tau_t")
    left.set_title("Task-vector alignment vs N")
    left.grid(alpha=0.3)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, n in enumerate(sorted(phase_records)):
        records = phase_records[n]
        steps = [r["step"] for r in records]
        color = colors[index % len(colors)]
        right.plot(steps, [r["mean_cos_tau"] for r in records], marker="o", color=color, label=f"tau, N={n}")
        right.plot(steps, [r["mean_cos_delta"] for r in records], marker="x", linestyle="--", color=color, label=f"delta, N={n}")
    right.set_xlabel("per-task optimiser step (end of phase)")
    right.set_ylabel("mean pairwise cosine")
    right.set_title("tau (task vector) vs delta (phase update)")
    right.grid(alpha=0.3)
    right.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
