"""Model Breadcrumbs: keep a band of each task vector's magnitudes, dropping the largest outliers
and the small noise, then task arithmetic.

Davari & Belilovsky 2023, "Model Breadcrumbs: Scaling Multi-Task Model Merging with Sparse Masks",
https://arxiv.org/abs/2312.06795. As the official code (TaskVectorMiddleKeep): per row (the last
dimension; a 1-D tensor is one row), order the entries by magnitude, zero the top int(n * gamma),
keep the next int(n * density), zero the rest; scalars are kept. Ties in magnitude are broken by
position (a stable sort), so the mask is deterministic. mergekit masks the whole flattened tensor
instead; this is not that variant. theta = theta_0 + lam * sum_t masked tau_t.
Defaults: the official search's starting point, density (beta) 0.15, gamma 0.006, lam 0.2;
lam searched on validation over 0.05 .. 1.0.
"""

from __future__ import annotations

import torch

from mima.merging.common import summed_task_vectors
from mima.merging.registry import ScaledMerge, register


def breadcrumb_mask(tau: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    if tau.ndim == 0:
        return torch.ones_like(tau, dtype=torch.bool)
    rows = tau.reshape(-1, tau.shape[-1])
    width = rows.shape[1]
    top, keep = int(width * gamma), int(width * density)
    order = torch.sort(rows.abs(), dim=1, descending=True, stable=True).indices
    mask = torch.zeros_like(rows, dtype=torch.bool)
    mask.scatter_(1, order[:, top : top + keep], True)
    return mask.reshape(tau.shape)


def breadcrumbs(models, base, density: float, gamma: float):
    return summed_task_vectors(models, base, lambda index, key, tau: tau * breadcrumb_mask(tau, density, gamma))


register(
    ScaledMerge(
        name="breadcrumbs",
        scaled_fn=breadcrumbs,
        entrywise=True,
    )
)
