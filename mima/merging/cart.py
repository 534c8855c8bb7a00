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
theta_0 is not needed.
"""

from __future__ import annotations

import math
import re

import torch

from mima.merging.registry import MergeMethod, combine, register
from mima.state_dicts import is_mergeable, mean_state_dict

DEFAULT_MATRIX_KEYS = r"(attn\.in_proj_weight|attn\.out_proj\.weight|mlp\.c_fc\.weight|mlp\.c_proj\.weight)$"


def cart_rank(shape: tuple[int, ...] | torch.Size, rank_ratio: float) -> int:
    """Kept rank for a matrix of `shape`: max(1, floor(ratio * min(m, n))), or 0 for ratio 0."""
    if rank_ratio <= 0:
        return 0
    full = min(shape)
    return min(full, max(1, math.floor(rank_ratio * full + 1e-9)))  # the epsilon absorbs 0.29 * 100 = 28.999...


def low_rank(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """The best rank-`rank` approximation (truncated SVD) of a 2-D tensor, in float32."""
    if rank == 0:
        return torch.zeros_like(matrix, dtype=torch.float32)
    u, s, vh = torch.linalg.svd(matrix.float(), full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vh[:rank]


def is_cart_matrix(key: str, tensor: torch.Tensor, matrix_keys: str) -> bool:
    return tensor.ndim == 2 and is_mergeable(tensor) and re.search(matrix_keys, key) is not None


def cart_direction(models, base=None, rank_ratio: float = 0.08, matrix_keys: str = DEFAULT_MATRIX_KEYS):
    """(theta_avg, sum_t SVD_r(theta_t - theta_avg) on the low-rank matrices)."""
    average = mean_state_dict(models)
    direction = {}
    for key, mean in average.items():
        if not is_cart_matrix(key, mean, matrix_keys):
            continue
        rank = cart_rank(mean.shape, rank_ratio)
        total = torch.zeros(mean.shape, dtype=torch.float32, device=mean.device)
        for model in models:
            total += low_rank(model[key].float() - mean.float(), rank)
        direction[key] = total
    return average, direction


def cart(models, base, lam: float, rank_ratio: float, matrix_keys: str = DEFAULT_MATRIX_KEYS):
    anchor, direction = cart_direction(models, base, rank_ratio=rank_ratio, matrix_keys=matrix_keys)
    return combine(anchor, direction, lam)


register(
    MergeMethod(
        name="cart",
        fn=cart,
        paper="https://arxiv.org/abs/2412.12153",
        summary="average plus lam times the rank-reduced centered task vectors",
        needs_base=False,
        defaults={"lam": 1.0, "rank_ratio": 0.08, "matrix_keys": DEFAULT_MATRIX_KEYS},
        grid={"rank_ratio": (0.04, 0.08, 0.16, 0.32), "lam": tuple(round(1.0 + 0.2 * i, 1) for i in range(11))},
        direction_fn=cart_direction,
    )
)
