"""CART-Indexing: one shared average plus a small per-task part; each task gets its own model back.

Choi et al. 2024, https://arxiv.org/abs/2412.12153, Appendix C.2, as the official code
(StaticMergeModule, "CART-INDEXING"): the index keeps theta_avg and, per task, for each attention/
MLP weight matrix (CART's rule, mima.merging.cart.cart_matrix_key: 2-D, key with `attn` or `mlp`
and neither `ln` nor `bias`; or the pattern `matrix_keys`, which must select a tensor) the rank-r
factors of theta_t - theta_avg (r = max(1, floor(rank_ratio * min(m, n))), 8% by default), and for
every other floating tensor the full centered difference (so those tensors come back exactly).
Task t's model is theta_avg + left_t @ right_t on the matrices and theta_avg + (theta_t - theta_avg)
elsewhere.

Index keys: `avg/<key>`, `task<i>/<key>/left` (m x r, singular values folded in),
`task<i>/<key>/right` (r x n), `task<i>/<key>/full`. A singular pair's sign is the SVD library's, so an
index made on a GPU may differ from the CPU's by the sign of a pair; a task's model, their product,
does not depend on it (mima.core.linalg).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mima.core.linalg import svd
from mima.merging.cart import DEFAULT_MATRIX_KEYS, cart_matrices, cart_rank
from mima.merging.common import index_entries, tensor_step, mean_tensor
from mima.merging.registry import PerTaskMerge, register


def cart_index(models, base, rank_ratio: float, matrix_keys: str = DEFAULT_MATRIX_KEYS) -> dict[str, torch.Tensor]:
    matrices = set(cart_matrices("cart_indexing", models, matrix_keys))
    index: dict[str, torch.Tensor] = {}
    for key in models[0]:
        average = mean_tensor(models, key)
        index[f"avg/{key}"] = average
        if not average.is_floating_point():
            continue
        for task, model in enumerate(models):
            centered = model[key].float() - average.float()
            if key in matrices:
                # U_r S_r and V_r stored apart (a pair's sign is the SVD library's: mima.core.linalg)
                with tensor_step(key, models):
                    left, right = svd(centered).factors(cart_rank(average.shape, rank_ratio))
                index[f"task{task}/{key}/left"] = left.contiguous()
                index[f"task{task}/{key}/right"] = right.contiguous()
            else:
                index[f"task{task}/{key}/full"] = centered
    return index


def cart_reconstruct(index: Mapping[str, torch.Tensor], task: int) -> dict[str, torch.Tensor]:
    model = {}
    for key, average in index_entries(index, "avg/"):
        if f"task{task}/{key}/left" in index:
            delta = index[f"task{task}/{key}/left"] @ index[f"task{task}/{key}/right"]
        elif f"task{task}/{key}/full" in index:
            delta = index[f"task{task}/{key}/full"]
        else:
            model[key] = average.clone()
            continue
        model[key] = (average.float() + delta).to(average.dtype)
    return model


register(
    PerTaskMerge(
        name="cart_indexing",
        index_fn=cart_index,
        reconstruct_fn=cart_reconstruct,
    )
)
