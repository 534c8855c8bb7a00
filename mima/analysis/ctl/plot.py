"""The figure of the CTL analysis: per layer, 1 - cosine (each alpha and the baseline, with the
quartiles across examples, paper 003 Fig. 2, 3, 7) and the length ratio (Fig. 8)."""

from __future__ import annotations

from collections.abc import Sequence

from mima.analysis.ctl.compute import OUTPUT, LinearityResult, Spread
from mima.analysis.figures import plt

INTERPOLATION_TEXT = (
    "1 − cos(f(θ_α), α f(θ_A) + (1−α) f(θ_B)),  θ_α = α θ_A + (1−α) θ_B",
    "|f(θ_α)| cos / |α f(θ_A) + (1−α) f(θ_B)|",
    "baseline: 1 − cos(f(θ_A), f(θ_B))",
    "α = {alpha:g}",
)
ARITHMETIC_TEXT = (
    "1 − cos(f(θ_0 + λ(τ_A + τ_B)), ½ f(θ_0 + 2λτ_A) + ½ f(θ_0 + 2λτ_B))",
    "|f(θ_0 + λ(τ_A + τ_B))| cos / |½ f(θ_0 + 2λτ_A) + ½ f(θ_0 + 2λτ_B)|",
    "baseline: 1 − cos(f(θ_0 + 2λτ_A), f(θ_0 + 2λτ_B))",
    "merged θ_0 + λ(τ_A + τ_B)",
)


def plot_linearity(result: LinearityResult, title: str, text: tuple[str, str, str, str] = INTERPOLATION_TEXT):
    """Two panels per layer: 1 - cosine (each alpha and the baseline) and the length ratio.

    `text` holds the formulas: left and right panel titles, the baseline's legend entry and a format
    string for each alpha's entry.
    """
    left_title, right_title, baseline_label, series = text
    names = [layer.layer for layer in result.layers]
    labels, prefix = _tick_labels(names)
    x = list(range(len(names)))
    figure = plt.figure(figsize=(max(10.0, 1.5 * len(names)), 5.0))
    grid = figure.add_gridspec(2, 2, height_ratios=[6, 1])
    left, right, key = figure.add_subplot(grid[0, 0]), figure.add_subplot(grid[0, 1]), figure.add_subplot(grid[1, :])
    offsets = _offsets(len(result.alphas) + 1)

    base = [_one_minus(layer.baseline_cosine) for layer in result.layers]
    _errorbar(left, [i + offsets[-1] for i in x], base, "k", "s", baseline_label, dashed=True)
    for index, alpha in enumerate(result.alphas):
        colour = plt.cm.viridis(0.1 + 0.75 * index / max(1, len(result.alphas) - 1))
        shifted = [i + offsets[index] for i in x]
        label = series.format(alpha=alpha)
        _errorbar(left, shifted, [_one_minus(layer.cosine[alpha]) for layer in result.layers], colour, "o", label)
        _errorbar(right, shifted, [layer.length_ratio[alpha] for layer in result.layers], colour, "o", label)
    right.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    # log-like scale: CTL's 1 - cosine sits orders of magnitude below the baseline's
    left.set_yscale("symlog", linthresh=_linthresh(result))
    left.set_ylabel("1 − cosine (0 = same direction)")
    left.set_title(left_title, fontsize=8)
    right.set_ylabel("length ratio (1 = same length)")
    right.set_title(right_title, fontsize=8)
    long = max(map(len, labels)) > 6
    for axis in (left, right):
        axis.set_xticks(x)
        axis.set_xticklabels(labels, rotation=30 if long else 0, ha="right" if long else "center", fontsize=8)
        axis.set_xlabel(f"layer ({prefix}<i>, then the tower output)" if prefix else "layer")
        axis.grid(alpha=0.3)
    handles, names_ = left.get_legend_handles_labels()
    key.axis("off")
    # alphas first, the baseline last
    key.legend(handles[1:] + handles[:1], names_[1:] + names_[:1], loc="center", ncol=len(handles), fontsize=8,
               frameon=False)
    figure.suptitle(f"{title}\npoints: mean over {result.examples} test images; bars: lower to upper quartile", fontsize=10)
    return figure


def _one_minus(spread: Spread) -> Spread:
    # 1 - x reverses order: the upper quartile of the cosine is the lower one of 1 - cosine
    s = spread
    return Spread(1 - s.mean, 1 - s.upper_quartile, 1 - s.median, 1 - s.lower_quartile, 1 - s.maximum, 1 - s.minimum)


def _linthresh(result: LinearityResult) -> float:
    """Linear range of the symlog axis: just under the smallest positive 1 - cosine shown."""
    values = [1 - layer.baseline_cosine.mean for layer in result.layers]
    values += [1 - s.mean for layer in result.layers for s in layer.cosine.values()]
    positive = [v for v in values if v > 0]
    return max(1e-9, min(positive) / 2) if positive else 1e-6


def _errorbar(axis, x, spreads: Sequence[Spread], colour, marker: str, label: str, dashed: bool = False) -> None:
    """Means joined by a line; the bar spans the quartiles (a skewed spread may leave the mean outside it)."""
    lower = [s.lower_quartile for s in spreads]
    upper = [s.upper_quartile for s in spreads]
    axis.errorbar(x, [(a + b) / 2 for a, b in zip(lower, upper)], yerr=[(b - a) / 2 for a, b in zip(lower, upper)],
                  fmt="none", ecolor=colour, elinewidth=1, capsize=3)
    axis.plot(x, [s.mean for s in spreads], color=colour, marker=marker, markersize=4,
              linestyle="--" if dashed else "-", linewidth=1, label=label)


def _offsets(count: int) -> list[float]:
    """Small horizontal shifts so the error bars of several series at one layer do not overlap."""
    width = 0.3
    return [(-width / 2 + width * i / max(1, count - 1)) if count > 1 else 0.0 for i in range(count)]


def _tick_labels(names: Sequence[str]) -> tuple[list[str], str]:
    """Drop the dotted prefix the blocks share (`transformer.resblocks.`) so ticks stay short."""
    blocks = [name for name in names if name != OUTPUT]
    if len(blocks) < 2:
        return list(names), ""
    parts = [name.split(".") for name in blocks]
    common = 0
    while all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
        common += 1
    prefix = ".".join(parts[0][:common]) + "." if common else ""
    return [name[len(prefix):] if name != OUTPUT else name for name in names], prefix
