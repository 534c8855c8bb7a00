"""DARE: drop each task-vector entry with probability p and rescale the rest by 1 / (1 - p), then
merge with task arithmetic or TIES.

Yu et al. 2024, "Language Models are Super Mario: Absorbing Abilities from Homologous Models as a
Free Lunch", https://arxiv.org/abs/2311.03099. As the official code (MergeLM): an independent
Bernoulli(p) drop per entry of every floating tensor, rescaled by 1 / (1 - p). The masks are
seeded by (seed, task index, tensor name), so a merge is reproducible and each tensor's mask can be
drawn again in every pass without storing it. p = 0 is task arithmetic (or TIES) exactly.
Defaults (FusionBench's CLIP settings): p = 0.5, lam = 0.3 with task arithmetic; lam = 1, k = 20
with TIES; lam searched on validation over the same grids as those methods.
"""

from __future__ import annotations

import hashlib

import torch

from mima.merging.common import summed_task_vectors
from mima.merging.registry import ScaledMerge, register
from mima.merging.ties import ties_vectors, with_base


def drop_seed(seed: int, task: int, key: str) -> int:
    digest = hashlib.sha256(f"dare/{seed}/{task}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def dare(tau: torch.Tensor, drop: float, seed: int, task: int, key: str) -> torch.Tensor:
    """Drop entries with probability `drop`, rescale the kept ones by 1 / (1 - drop)."""
    if drop == 0:
        return tau
    generator = torch.Generator().manual_seed(drop_seed(seed, task, key))
    keep = torch.rand(tau.shape, generator=generator) >= drop  # drawn on the CPU: the same mask on any device
    return tau * keep.to(tau.device) / (1 - drop)


def dare_task_arithmetic(models, base, drop: float, seed: int):
    return summed_task_vectors(models, base, lambda index, key, tau: dare(tau, drop, seed, index, key))


def dare_ties(models, base, drop: float, seed: int, k: float, trim: str):
    transform = lambda index, key, tau: dare(tau, drop, seed, index, key)  # noqa: E731
    return with_base(base, ties_vectors(models, base, k, trim, transform=transform))


register(
    ScaledMerge(
        name="dare_task_arithmetic",
        scaled_fn=dare_task_arithmetic,
        entrywise=True,
    )
)
register(
    ScaledMerge(
        name="dare_ties",
        scaled_fn=dare_ties,
        entrywise=True,
    )
)
