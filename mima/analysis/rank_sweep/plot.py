"""Figures of the rank sweep: accuracy vs kept rank (paper 000, Fig. 1) and the per-layer I(k), R(k)
and R(k) / R(0) of centered and original task vectors (Fig. 2, 3, 8)."""

from __future__ import annotations

import torch

from mima.analysis.figures import plt
from mima.analysis.rank_sweep.compute import AccuracyCurve, LayerMetrics

COLORS = {"centered": "tab:orange", "original": "tab:blue"}
LABELS = {"centered": "centered (CART): theta_avg + lam sum_t SVD_k(theta_t - theta_avg)",
          "original": "original: theta_0 + lam sum_t SVD_k(theta_t - theta_0)"}


def plot_accuracy(curve: AccuracyCurve, title: str):
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
