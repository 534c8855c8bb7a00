"""How sure a test accuracy is, and whether two models' accuracies differ by more than their noise.

Pure functions of counts and per-image records (which images a model classified correctly, in the
split's fixed order; mima.evaluation.cells stores them beside each cell's counts):

    wilson_interval           a 95 % interval on one accuracy (correct of total), the Wilson score
                              interval (as scipy.stats.binomtest(...).proportion_ci(method="wilson"))
    mcnemar_p_value           the exact (binomial) McNemar test of two models on the same images: only
                              the discordant images count, b = only the first correct, c = only the
                              second; under "no difference" b ~ Binomial(b + c, 1/2); two-sided p =
                              min(1, 2 P(X <= min(b, c))), computed in integers (exact for any size)
    bootstrap_mean_interval   a 95 % interval on the mean over tasks of one model's accuracies
    paired_bootstrap_interval a 95 % interval on the difference of two models' means over tasks

The bootstraps resample each task's images with replacement, independently per task (the tasks'
test sets are independent samples), RESAMPLES times, and take the 2.5 and 97.5 percentiles of the
statistic (numpy.quantile's default, linear interpolation). A resample is drawn in its sufficient
statistics, which have exactly the distribution of resampled images: the number of correct images
among n drawn with replacement from a task with k correct is Binomial(n, k / n); for a pair of
models, the numbers of (only the first correct, only the second correct, the rest) among n drawn are
Multinomial(n, (b / n, c / n, 1 - (b + c) / n)). This costs RESAMPLES draws per task instead of
RESAMPLES x n, so that hundreds of comparisons over tens of thousands of images take seconds.
Each interval draws from its own numpy Generator seeded SEED (PCG64), the tasks in the order given,
one call of `size=RESAMPLES` per task: the same records give the same interval in any process, in any
order of computation.

A difference is distinguishable at 95 % when its interval excludes 0 (the mean over tasks), or when
its McNemar p-value is below ALPHA (one task).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence

import numpy as np

from mima.core.names import Z95

CONFIDENCE = 0.95
ALPHA = 1 - CONFIDENCE  # the two-sided test level that matches the intervals
RESAMPLES = 2000  # bootstrap resamples per interval
SEED = 0  # every bootstrap's numpy Generator seed
PERCENTILES = (ALPHA / 2, 1 - ALPHA / 2)

Interval = tuple[float, float]


# ------------------------------------------------------------------------------ one accuracy
def wilson_interval(correct: int, total: int, z: float = Z95) -> Interval:
    """The Wilson score interval of correct / total ((0, 1) without images)."""
    if total <= 0:
        return 0.0, 1.0
    p = correct / total
    shrink = 1 + z * z / total
    center = (p + z * z / (2 * total)) / shrink
    half = z / shrink * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total))
    # at no or every image correct the bound is exactly 0 or 1 (rounding would leave 1e-17 or 1 - 1e-16)
    return 0.0 if correct == 0 else max(0.0, center - half), 1.0 if correct == total else min(1.0, center + half)


# ------------------------------------------------------------------------------ two models, one task
def mcnemar_p_value(only_first: int, only_second: int) -> float:
    """The exact two-sided McNemar p-value from the discordant counts (1.0 when there are none)."""
    discordant = only_first + only_second
    if discordant == 0:
        return 1.0
    smaller = min(only_first, only_second)
    term, tail = 1, 1  # C(discordant, 0), and the sum of C(discordant, i) for i <= smaller
    for i in range(smaller):
        term = term * (discordant - i) // (i + 1)
        tail += term
    return min(1.0, 2 * tail / (1 << discordant))  # big integers: one correctly rounded division


def discordant_counts(first: np.ndarray, second: np.ndarray) -> tuple[int, int]:
    """(images only `first` classified correctly, images only `second` did) of two boolean records
    of the same images."""
    if first.shape != second.shape:
        raise ValueError(f"per-image records of {first.shape[0]} and {second.shape[0]} images: not the same images")
    return int(np.count_nonzero(first & ~second)), int(np.count_nonzero(second & ~first))


# ------------------------------------------------------------------------------ means over tasks
def _percentile_interval(statistic: np.ndarray) -> Interval:
    low, high = np.quantile(statistic, PERCENTILES)
    return float(low), float(high)


def bootstrap_mean_interval(counts: Sequence[tuple[int, int]], resamples: int = RESAMPLES, seed: int = SEED) -> Interval:
    """The bootstrap interval of the mean over tasks of correct / total, from each task's
    (correct, total) (the module text: the images of each task resampled)."""
    rng = np.random.default_rng(seed)
    mean = np.zeros(resamples)
    for correct, total in counts:
        if total:  # a task without images counts as accuracy 0, as accuracy_of says
            mean += rng.binomial(total, correct / total, size=resamples) / total
    return _percentile_interval(mean / len(counts))


def paired_bootstrap_interval(discordant: Sequence[tuple[int, int, int]], resamples: int = RESAMPLES,
                              seed: int = SEED) -> Interval:
    """The paired bootstrap interval of mean_t acc(first, t) - mean_t acc(second, t), from each task's
    (only the first correct, only the second correct, total images): both models' records
    resampled on the same images."""
    rng = np.random.default_rng(seed)
    difference = np.zeros(resamples)
    for only_first, only_second, total in discordant:
        if not total:
            continue  # no images: no difference
        draws = rng.multinomial(total, [only_first / total, only_second / total, 1 - (only_first + only_second) / total],
                                size=resamples)
        difference += (draws[:, 0] - draws[:, 1]) / total
    return _percentile_interval(difference / len(discordant))


def excludes_zero(interval: Interval) -> bool:
    """A difference whose interval excludes 0 is distinguishable at its confidence."""
    return interval[0] > 0 or interval[1] < 0


# ------------------------------------------------------------------------------ records on disk
def pack_record(correct: np.ndarray) -> str:
    """A boolean per-image record as text: numpy.packbits (big-endian bit order, the last byte padded
    with zeros) in base64; 10,000 images take 1,668 characters."""
    return base64.b64encode(np.packbits(np.asarray(correct, dtype=bool)).tobytes()).decode("ascii")


def unpack_record(text: str, total: int) -> np.ndarray:
    """The boolean record of `total` images that `pack_record` wrote as `text`; ValueError if it is not one
    (not base64, another number of bytes, or a padding bit set)."""
    try:
        packed = np.frombuffer(base64.b64decode(text.encode("ascii"), validate=True), dtype=np.uint8)
    except (ValueError, UnicodeEncodeError):
        raise ValueError("not base64 text") from None
    if packed.size != (total + 7) // 8:
        raise ValueError(f"{packed.size} bytes where {total} images take {(total + 7) // 8}")
    bits = np.unpackbits(packed).astype(bool)
    if bits[total:].any():
        raise ValueError("bits set past the last image")
    return bits[:total]
