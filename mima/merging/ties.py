"""TIES-merging: trim, elect sign, disjoint mean; theta = theta_0 + lam * merged.

Yadav et al. 2023, "TIES-Merging: Resolving Interference When Merging Models",
https://arxiv.org/abs/2306.01708. Faithful to the official code (ties_merging in the authors'
repository), which differs from the paper and from mergekit in three details:
  * Trim is global: each task vector is flattened over ALL its tensors, and entries with
    |tau| >= the kth smallest magnitude survive, kth index = n - int(n * k / 100). Magnitude ties
    at the threshold all survive, so slightly more than k% can be kept. `trim="per-tensor"`
    applies the same rule to each tensor separately (mergekit's variant), as an explicit option.
  * Elect: sign of the sum of the trimmed vectors; entries whose sum is exactly 0 take the
    majority sign, sign(sum of all elected signs) over the whole model. (If that is 0 too, the
    entry keeps sign 0, and the official code then keeps its negative entries.)
  * Disjoint mean: the sum of entries agreeing with the elected sign divided by the number of
    such non-zero entries (at least 1).
Every floating tensor is a task-vector entry (biases and norms too); integer tensors come from
theta_0. lam: 0.8 .. 1.8 on validation (paper 001), 1.0 without; k = 20.

Streaming: three passes over the inputs, one key at a time, except that the global threshold of a
task needs that task's magnitudes in one float32 buffer (one model's size), partitioned in place.
"""

from __future__ import annotations

from typing import Literal

import torch

from mima.merging.registry import ScaledMerge, floating_keys, register

TrimScope = Literal["global", "per-tensor"]


def kth_index(count: int, k: float) -> int:
    """1-based index of the threshold magnitude: n - int(n * k / 100), as the official code."""
    return count - int(count * k / 100)


def kth_smallest_inplace(values: torch.Tensor, kth: int) -> float:
    """The kth smallest (1-based) of a contiguous float32 CPU tensor, reordering it in place (numpy's
    partition: exact, so the threshold is the same whichever device computed the magnitudes)."""
    array = values.numpy()
    array.partition(kth - 1)
    return float(array[kth - 1])


def magnitude_threshold(magnitudes: torch.Tensor, k: float) -> float:
    """Entries with magnitude >= this survive a top-k% trim; 0 keeps everything."""
    kth = kth_index(magnitudes.numel(), k)
    if kth < 1:
        return 0.0
    return kth_smallest_inplace(magnitudes.reshape(-1).float().to("cpu").contiguous().clone(), kth)


def _task_vector(model, base, key: str) -> torch.Tensor:
    return model[key].float() - base[key].float()


def _numel(state, key: str) -> int:
    infos = getattr(state, "infos", None)
    return infos[key].numel if infos is not None else state[key].numel()


def ties_vectors(models, base, k: float, trim: TrimScope, transform=None):
    """The TIES-merged task vector, (key, tensor) for each floating key of `base`, in order.

    `transform(index, key, tau)` may change each task vector before trimming (DARE drops entries);
    it must give the same result every time it is called, since each key is read in three passes.
    """
    keys = floating_keys(base)

    def task_vector(index: int, model, key: str) -> torch.Tensor:
        tau = _task_vector(model, base, key)
        return transform(index, key, tau) if transform is not None else tau

    thresholds: list[float] = []
    if trim == "global":
        sizes = [_numel(base, key) for key in keys]
        kth = kth_index(sum(sizes), k)
        for index, model in enumerate(models):
            if kth < 1:
                thresholds.append(0.0)
                continue
            magnitudes = torch.empty(sum(sizes), dtype=torch.float32)  # on the CPU, for numpy's partition
            offset = 0
            for key, size in zip(keys, sizes):
                magnitudes[offset : offset + size] = task_vector(index, model, key).abs().reshape(-1)
                offset += size
            thresholds.append(kth_smallest_inplace(magnitudes, kth))
            del magnitudes

    def trimmed(key: str) -> torch.Tensor:
        rows = []
        for index, model in enumerate(models):
            tau = task_vector(index, model, key)
            threshold = thresholds[index] if trim == "global" else magnitude_threshold(tau.abs(), k)
            rows.append(tau * (tau.abs() >= threshold))
        return torch.stack(rows)

    # Majority sign over the whole model, for entries whose trimmed sum is exactly zero.
    elected_sign_total = sum(float(torch.sign(trimmed(key).sum(dim=0)).sum()) for key in keys)
    majority = float(torch.sign(torch.tensor(elected_sign_total)))
    for key in keys:
        stacked = trimmed(key)
        sign = torch.sign(stacked.sum(dim=0))
        sign[sign == 0] = majority
        agrees = torch.where(sign > 0, stacked > 0, stacked < 0)
        selected = stacked * agrees
        count = (selected != 0).sum(dim=0).clamp(min=1)
        yield key, selected.sum(dim=0) / count


def with_base(base, vectors):
    """(key, theta_0, merged task vector or None) for every key of `base`, from a generator of
    (key, vector) over its floating keys in the same order."""
    pending = next(vectors, None)
    for key in base:
        if pending is not None and pending[0] == key:
            yield key, base[key], pending[1]
            pending = next(vectors, None)
        else:
            yield key, base[key], None


def ties(models, base, k: float, trim: TrimScope):
    """(key, theta_0, TIES-merged task vector) per key."""
    return with_base(base, ties_vectors(models, base, k, trim))


register(
    ScaledMerge(
        name="ties",
        scaled_fn=ties,
        entrywise=True,
    )
)
