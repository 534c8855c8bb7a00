"""DELLA: drop task-vector entries at random, less often the larger they are, rescale, then elect
signs and take the disjoint mean; theta = theta_0 + lam * merged.

Deep et al. 2024, "DELLA-Merging: Reducing Interference in Model Merging through Magnitude-Based
Sampling", https://arxiv.org/abs/2406.11617, as mergekit's `della` (mergekit/sparsify.py
della_magprune, and generalized_task_arithmetic.py with consensus "sum", normalize on, every
model's weight 1):
  MagPrune, per task and tensor, within each row (a 2-D tensor's rows; a 1-D tensor is one row):
    rank the row's magnitudes 1 .. n (smallest first); keep entry i with probability
    p_i = (density - epsilon) + 2 epsilon (rank_i - 1) / (n - 1), and rescale a kept entry by 1 / p_i.
    In the paper's terms the drop probability is 1 - p_i, its mean p = 1 - density and its window
    width 2 epsilon, and the rescale is 1 / (1 - drop probability).
  Elect: the sign of the sum over tasks of the pruned vectors (a sum of exactly 0 counts as +1);
  Fuse:  the sum of the entries whose sign is the elected one (zeros never agree) divided by their
         count (at least 1), times lam.
Every floating tensor is a task-vector entry (mergekit prunes every tensor it merges); integer
tensors come from theta_0. density = 1 keeps every entry unscaled (mergekit's rule); otherwise
density - epsilon and density + epsilon must lie strictly inside (0, 1), as mergekit requires.

Deliberate differences:
  * Rescale by 1 / p_i, as the paper and the authors' mergekit fork (declare-lab/della,
    rank_magnitude_sampling); current mergekit instead rescales each pruned tensor to the L1 norm
    it had before pruning.
  * The random draws are seeded and reproducible: entry i is kept when u_i < p_i, with u =
    torch.rand(rows x width) from a generator seeded by the first 8 bytes (little endian, 63 bits)
    of sha256('della/<seed>/<task index>/<tensor name>'); mergekit draws torch.bernoulli from the
    global generator. Each tensor's draws can thus be repeated without storing them.
  * Tensors of 3 or more dimensions (conv1's patch embedding) are ranked over rows of the first
    dimension with the rest flattened (mergekit ranks along dimension 1 only); equal magnitudes
    are ranked by position (earlier first, a stable sort); a row of one entry (a 0-D tensor, a matrix of one
    column) is kept with probability density (mergekit's formula divides 0 by 0 there).
Defaults: density 0.5 (mima's DARE default: the reference has none for these models), epsilon 0.15
and lam 1 (mergekit's defaults), seed 0; lam searched on validation over TIES's grid 0.8 .. 1.8 (the
paper tunes lam, the drop rate and the window per merge; DELLA's disjoint mean is on TIES's scale).
"""

from __future__ import annotations

import hashlib

import torch

from mima.core.errors import MimaError
from mima.merging.common import task_vectors_by_key
from mima.merging.registry import ScaledMerge, register


def della_seed(seed: int, task: int, key: str) -> int:
    digest = hashlib.sha256(f"della/{seed}/{task}/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def rows_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as rows [R, n]: 2-D and larger by the first dimension, 0-D and 1-D as one row."""
    if tensor.ndim >= 2:
        return tensor.reshape(tensor.shape[0], -1)
    return tensor.reshape(1, -1)


def keep_probabilities(rows: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """p_i = density - epsilon + 2 epsilon (rank_i - 1) / (n - 1), ranks by magnitude within each row."""
    width = rows.shape[1]
    if width < 2:
        return torch.full_like(rows, density)
    order = torch.argsort(rows.abs(), dim=1, stable=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(width, device=rows.device).expand_as(order))  # 0-based rank of each entry
    return (density - epsilon) + 2 * epsilon * ranks.to(rows.dtype) / (width - 1)


def magprune(tau: torch.Tensor, density: float, epsilon: float, seed: int, task: int, key: str) -> torch.Tensor:
    """Task t's tensor with entries dropped by magnitude-ranked probabilities and the rest rescaled."""
    if density >= 1:
        return tau
    rows = rows_of(tau.float())
    probabilities = keep_probabilities(rows, density, epsilon)
    generator = torch.Generator().manual_seed(della_seed(seed, task, key))
    draws = torch.rand(rows.shape, generator=generator).to(rows.device)  # drawn on the CPU: the same on any device
    kept = draws < probabilities
    return (rows * kept / probabilities).reshape(tau.shape)


def disjoint_mean(pruned: torch.Tensor) -> torch.Tensor:
    """Mean over tasks [T, ...] of the entries whose sign is the sign of their sum (0 sum: +1)."""
    elected = torch.where(pruned.sum(dim=0) >= 0, 1.0, -1.0)
    agrees = torch.sign(pruned) == elected
    count = agrees.sum(dim=0).clamp(min=1)
    return (pruned * agrees).sum(dim=0) / count


def check_window(density: float, epsilon: float) -> None:
    if density < 1 and not (0 < density - epsilon and density + epsilon < 1):
        raise MimaError(f"merge method 'della': density - epsilon and density + epsilon must lie in (0, 1), "
                        f"got density={density}, epsilon={epsilon}")


def della(models, base, density: float, epsilon: float, seed: int):
    """(key, theta_0, DELLA-merged task vector or None) per key; checks the window before the first key."""
    check_window(density, epsilon)
    return _della(models, base, density, epsilon, seed)


def _della(models, base, density: float, epsilon: float, seed: int):
    for key, anchor, taus in task_vectors_by_key(models, base):
        if taus is None:
            yield key, anchor, None
            continue
        pruned = torch.stack([magprune(tau, density, epsilon, seed, task, key) for task, tau in enumerate(taus)])
        yield key, anchor, disjoint_mean(pruned)


register(
    ScaledMerge(
        name="della",
        scaled_fn=della,
        entrywise=True,
    )
)
