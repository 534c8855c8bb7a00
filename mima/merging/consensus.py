"""Consensus merging with TALL masks: keep the entries of the multi-task vector that at least k
tasks rely on.

Wang et al. 2024, "Localizing Task Information for Improved Model Merging and Compression",
https://arxiv.org/abs/2405.07813, as the official code (nik-dim/tall_masks):
  tau_MTL = sum_t tau_t (unscaled), over every floating tensor;
  task masks m_t = |tau_t| > mask_lam * |tau_MTL - tau_t|   (strict, as the code);
  consensus mask = (sum_t m_t >= min_tasks)                  (non-strict: k = 1 keeps the union);
  theta = theta_0 + lam * (tau_MTL * consensus mask).
Integer tensors come from theta_0. Defaults: min_tasks (k) = 2, mask_lam 0.4 (the middle of the
paper's 0.2 .. 0.6; the paper picks it per task on validation for TALL masks, see mima.merging.tall),
lam searched on validation over 0.1 .. 1.0, 0.4 without validation.
"""

from __future__ import annotations

import torch

from mima.core.errors import MimaError
from mima.merging.common import task_vectors_by_key
from mima.merging.registry import ScaledMerge, register


def task_masks(taus: torch.Tensor, total: torch.Tensor, mask_lam) -> torch.Tensor:
    """m_t = |tau_t| > lam_t * |tau_MTL - tau_t|, for stacked task vectors [T, ...]; `mask_lam` is a
    number or one value per task."""
    lam = torch.as_tensor(mask_lam, dtype=taus.dtype, device=taus.device).reshape(-1, *([1] * (taus.ndim - 1)))
    return taus.abs() > lam * (total.unsqueeze(0) - taus).abs()


def per_task_lams(mask_lam, tasks: int) -> list[float]:
    """`mask_lam` as one value per task (a single number is every task's)."""
    lams = list(mask_lam) if isinstance(mask_lam, (list, tuple)) else [mask_lam] * tasks
    if len(lams) != tasks:
        raise MimaError(f"mask_lam: {len(lams)} values for {tasks} tasks (give one, or one per task)")
    return lams


def consensus(models, base, mask_lam, min_tasks: int):
    """(key, theta_0, consensus-masked tau_MTL or None) per key; checks mask_lam before the first key."""
    return _consensus(models, base, per_task_lams(mask_lam, len(models)), min_tasks)


def _consensus(models, base, mask_lam: list[float], min_tasks: int):
    for key, anchor, taus in task_vectors_by_key(models, base):
        if taus is None:
            yield key, anchor, None
            continue
        stacked = torch.stack(taus)
        total = stacked.sum(dim=0)
        yield key, anchor, total * (task_masks(stacked, total, mask_lam).sum(dim=0) >= min_tasks)


register(
    ScaledMerge(
        name="consensus",
        scaled_fn=consensus,
        entrywise=True,
    )
)
