"""CART: Centered Arithmetic with Rank-reduced Task vectors.

Choi et al. 2024, "Revisiting Weight Averaging for Model Merging", https://arxiv.org/abs/2412.12153
(paper 000): theta = theta_avg + lam * sum_t SVD_r(theta_t - theta_avg) for each weight matrix.

Rules, following the official code:
  * Low rank applies to the 2-D weights of attention and MLP layers (keys matching `matrix_keys`;
    for open_clip ViTs: attn.in_proj_weight, attn.out_proj.weight, mlp.c_fc.weight,
    mlp.c_proj.weight). Every other tensor (biases, norms, positional/class embeddings, the
    projection, conv stems) is the plain average theta_avg.
  * Rank r = max(1, floor(rank_ratio * min(m, n))) as in the official code (the paper's
    Algorithm 1 writes a ceiling); rank_ratio = 0 keeps no low-rank part (theta_avg).
Since the centered vectors sum to zero, full rank gives back theta_avg for any lam.
Grid: rank_ratio in {4, 8, 16, 32}% x lam in 1.0 .. 3.0 on validation; 8% and lam = 1 without.
theta_0 is not needed. The rank sweep computes one SVD per task and matrix for all ratios.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch

from mima.core.linalg import low_rank, svd
from mima.merging.registry import MergeMethod, register
from mima.merging.uniform import mean_tensor

DEFAULT_MATRIX_KEYS = r"(attn\.in_proj_weight|attn\.out_proj\.weight|mlp\.c_fc\.weight|mlp\.c_proj\.weight)$"


def cart_rank(shape: tuple[int, ...] | torch.Size, rank_ratio: float) -> int:
    """Kept rank for a matrix of `shape`: max(1, floor(ratio * min(m, n))), or 0 for ratio 0."""
    if rank_ratio <= 0:
        return 0
    full = min(shape)
    return min(full, max(1, math.floor(rank_ratio * full + 1e-9)))  # the epsilon absorbs 0.29 * 100 = 28.999...


def is_matrix(key: str, tensor_or_shape, matrix_keys: str) -> bool:
    shape = getattr(tensor_or_shape, "shape", tensor_or_shape)
    return len(shape) == 2 and re.search(matrix_keys, key) is not None


def cart(models, base, rank_ratio: float, matrix_keys: str = DEFAULT_MATRIX_KEYS):
    """(key, theta_avg, sum_t SVD_r(theta_t - theta_avg) or None) per key."""
    for key in models[0]:
        average = mean_tensor(models, key)
        if not (average.is_floating_point() and is_matrix(key, average, matrix_keys)):
            yield key, average, None
            continue
        rank = cart_rank(average.shape, rank_ratio)
        total = torch.zeros(average.shape, dtype=torch.float32)
        for model in models:
            total += low_rank(model[key].float() - average.float(), rank)
        yield key, average, total


def cart_sweep(models, base, rank_ratio: Sequence[float], matrix_keys: str = DEFAULT_MATRIX_KEYS):
    """(setting, theta_avg, direction) for every ratio, from one SVD per task and matrix."""
    ratios = list(rank_ratio)
    anchor, directions = {}, {ratio: {} for ratio in ratios}
    for key in models[0]:
        average = mean_tensor(models, key)
        anchor[key] = average
        if not (average.is_floating_point() and is_matrix(key, average, matrix_keys)):
            continue
        totals = {ratio: torch.zeros(average.shape, dtype=torch.float32) for ratio in ratios}
        for model in models:
            decomposition = svd(model[key].float() - average.float())
            for ratio in ratios:
                totals[ratio] += decomposition.low_rank(cart_rank(average.shape, ratio))
        for ratio in ratios:
            directions[ratio][key] = totals[ratio]
    for ratio in ratios:
        yield {"rank_ratio": ratio}, anchor, directions[ratio]


register(
    MergeMethod(
        name="cart",
        paper="https://arxiv.org/abs/2412.12153",
        summary="average plus lam times the rank-reduced centered task vectors",
        needs_base=False,
        defaults={"lam": 1.0, "rank_ratio": 0.08, "matrix_keys": DEFAULT_MATRIX_KEYS},
        grid={"rank_ratio": (0.04, 0.08, 0.16, 0.32), "lam": tuple(round(1.0 + 0.2 * i, 1) for i in range(11))},
        scaled_fn=cart,
        sweep_fn=cart_sweep,
    )
)
