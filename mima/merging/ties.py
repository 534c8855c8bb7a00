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
"""

from __future__ import annotations

from typing import Literal

import torch

from mima.merging.registry import MergeMethod, combine, floating_keys, register

TrimScope = Literal["global", "per-tensor"]


def magnitude_threshold(magnitudes: torch.Tensor, k: float) -> float:
    """The kth smallest magnitude with kth = n - int(n * k / 100); 0 (keep everything) when that is < 1."""
    count = magnitudes.numel()
    kth = count - int(count * k / 100)
    if kth < 1:
        return 0.0
    return float(magnitudes.reshape(-1).kthvalue(kth).values)


def _task_vector(model, base, key: str) -> torch.Tensor:
    return model[key].float() - base[key].float()


def global_threshold(model, base, keys, k: float) -> float:
    magnitudes = torch.cat([_task_vector(model, base, key).abs().reshape(-1) for key in keys])
    return magnitude_threshold(magnitudes, k)


def ties_direction(models, base, k: float = 20.0, trim: TrimScope = "global"):
    """(theta_0, the TIES-merged task vector)."""
    if trim not in ("global", "per-tensor"):
        raise ValueError(f"trim must be 'global' or 'per-tensor', got {trim!r}")
    keys = floating_keys(base)
    thresholds = [global_threshold(model, base, keys, k) for model in models] if trim == "global" else None

    def trimmed(key: str) -> torch.Tensor:
        rows = []
        for index, model in enumerate(models):
            tau = _task_vector(model, base, key)
            threshold = thresholds[index] if thresholds else magnitude_threshold(tau.abs(), k)
            rows.append(tau * (tau.abs() >= threshold))
        return torch.stack(rows)

    # Majority sign over the whole model, for entries whose trimmed sum is exactly zero.
    elected_sign_total = sum(float(torch.sign(trimmed(key).sum(dim=0)).sum()) for key in keys)
    majority = float(torch.sign(torch.tensor(elected_sign_total)))

    direction = {}
    for key in keys:
        stacked = trimmed(key)
        sign = torch.sign(stacked.sum(dim=0))
        sign[sign == 0] = majority
        agrees = torch.where(sign > 0, stacked > 0, stacked < 0)
        selected = stacked * agrees
        count = (selected != 0).sum(dim=0).clamp(min=1)
        direction[key] = selected.sum(dim=0) / count
    return base, direction


def ties(models, base, lam: float, k: float, trim: TrimScope = "global"):
    anchor, direction = ties_direction(models, base, k=k, trim=trim)
    return combine(anchor, direction, lam)


register(
    MergeMethod(
        name="ties",
        fn=ties,
        paper="https://arxiv.org/abs/2306.01708",
        summary="trim to top-k% magnitude, elect signs, disjoint mean, scaled by lam",
        needs_base=True,
        defaults={"lam": 1.0, "k": 20.0, "trim": "global"},
        grid={"lam": tuple(round(0.8 + 0.05 * i, 2) for i in range(21))},
        direction_fn=ties_direction,
    )
)
