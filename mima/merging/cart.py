"""CART: Centered Arithmetic with Rank-reduced Task vectors.

Choi et al. 2024, "Revisiting Weight Averaging for Model Merging", https://arxiv.org/abs/2412.12153
(paper 000; code https://github.com/JH-GEECS/CART_public):
theta = theta_avg + lam * sum_t SVD_r(theta_t - theta_avg) for each weight matrix.

Rules, following the official code:
  * Which tensors are low-ranked (`cart_matrix_key`, the official code's rule, by name parts): the
    2-D floating tensors whose key contains `attn` or `mlp` and contains neither `ln` nor `bias`.
    On open_clip ViTs these are exactly attn.in_proj_weight, attn.out_proj.weight, mlp.c_fc.weight
    and mlp.c_proj.weight; the same rule finds timm's attn.qkv / mlp.fc1, transformers'
    self_attn.q_proj / mlp.fc1 or a user's attn.in_proj.weight. Every other tensor (biases, norms,
    positional/class embeddings, the projection, conv stems) is the plain average theta_avg.
    `matrix_keys` replaces the rule by a regular expression searched in the key (still 2-D only).
    A pattern that selects no tensor is an error. If the default rule selects none although the
    model has 2-D tensors (names the rule does not know), that is an error too, suggesting
    --matrix-keys; a model with no 2-D tensor at all (MobileNetV2: its 1x1 convolutions are 4-D)
    has no matrix by CART's own definition, so CART is theta_avg there, with a warning.
  * Rank r = max(1, floor(rank_ratio * min(m, n))) as in the official code (the paper's
    Algorithm 1 writes a ceiling); rank_ratio = 0 keeps no low-rank part (theta_avg).
Since the centered vectors sum to zero, full rank gives back theta_avg for any lam.
Grid: rank_ratio in {4, 8, 16, 32}% x lam in 1.0 .. 3.0 on validation; 8% and lam = 1 without.
theta_0 is not needed. The rank sweep computes one SVD per task and matrix for all ratios.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping, Sequence

import torch

from mima.core.errors import MimaError
from mima.core.linalg import low_rank, svd
from mima.merging.common import (check_matrix_keys, is_matrix_key, tensor_step, mean_tensor, some_keys, tensor_headers,
                                 two_d_keys)
from mima.merging.catalogue import DEFAULT_MATRIX_KEYS
from mima.merging.registry import ScaledMerge, register

RULE = "2-D tensors whose key contains 'attn' or 'mlp' and neither 'ln' nor 'bias'"


def cart_matrix_key(key: str) -> bool:
    """The official CART code's choice of low-rank tensors, by name parts: the key contains `attn`
    or `mlp` and contains neither `ln` nor `bias` (plain substrings; the tensor must also be 2-D,
    see `is_matrix`). Paper 000 (https://arxiv.org/abs/2412.12153, section 5.1: weight matrices of
    the MLP and attention layers; biases and normalisation layers are averaged), code
    https://github.com/JH-GEECS/CART_public."""
    return ("attn" in key or "mlp" in key) and "ln" not in key and "bias" not in key


def cart_rank(shape: tuple[int, ...] | torch.Size, rank_ratio: float) -> int:
    """Kept rank for a matrix of `shape`: max(1, floor(ratio * min(m, n))), or 0 for ratio 0."""
    if rank_ratio <= 0:
        return 0
    full = min(shape)
    return min(full, max(1, math.floor(rank_ratio * full + 1e-9)))  # the epsilon absorbs 0.29 * 100 = 28.999...


def is_matrix(key: str, tensor_or_shape, matrix_keys: str = DEFAULT_MATRIX_KEYS) -> bool:
    """Whether `key` gets the low-rank treatment: 2-D, and the official rule (`matrix_keys` at its
    default) or a match of the user's pattern `matrix_keys` (re.search in the key)."""
    if matrix_keys == DEFAULT_MATRIX_KEYS:
        return len(getattr(tensor_or_shape, "shape", tensor_or_shape)) == 2 and cart_matrix_key(key)
    return is_matrix_key(key, tensor_or_shape, matrix_keys)


def matrix_keys_of(model: Mapping[str, torch.Tensor], matrix_keys: str = DEFAULT_MATRIX_KEYS) -> list[str]:
    """The keys of `model` that get the low-rank treatment (floating and `is_matrix`)."""
    return [key for key, shape, floating in tensor_headers(model) if floating and is_matrix(key, shape, matrix_keys)]


def cart_matrices(method: str, models: Sequence[Mapping[str, torch.Tensor]], matrix_keys: str) -> list[str]:
    """The low-rank keys of the models (CART and the methods built on CART's matrices), checked before
    any work from the headers of lazy inputs.

    A user's pattern must select a matrix (mima.merging.common.check_matrix_keys, which every method
    taking `matrix_keys` runs). So must the default rule in a model that has 2-D tensors (their names
    are not the rule's); a model without 2-D tensors has no matrix for CART: a warning, and CART is
    the uniform average.
    """
    if matrix_keys != DEFAULT_MATRIX_KEYS:
        return check_matrix_keys(method, models[0], matrix_keys)
    selected = matrix_keys_of(models[0], matrix_keys)
    if selected:
        return selected
    two_d = two_d_keys(models[0])
    if two_d:
        raise MimaError(
            f"merge method '{method}': CART's default rule ({RULE}) selects none of the models' 2-D tensors "
            f"({some_keys(two_d)}), so it would be the uniform average; name the matrices with matrix_keys (--matrix-keys)"
        )
    warnings.warn(f"merge method '{method}': the models have no 2-D floating tensor, so CART keeps no low-rank part "
                  "and equals the uniform average", stacklevel=3)
    return []


def cart(models, base, rank_ratio: float, matrix_keys: str = DEFAULT_MATRIX_KEYS) -> Iterator:
    """(key, theta_avg, sum_t SVD_r(theta_t - theta_avg) or None) per key; the keys are checked first."""
    matrices = set(cart_matrices("cart", models, matrix_keys))
    return _cart(models, rank_ratio, matrices)


def _cart(models, rank_ratio: float, matrices: set[str]):
    for key in models[0]:
        average = mean_tensor(models, key)
        if key not in matrices:
            yield key, average, None
            continue
        rank = cart_rank(average.shape, rank_ratio)
        total = torch.zeros(average.shape, dtype=torch.float32, device=average.device)
        with tensor_step(key, models):
            for model in models:
                total += low_rank(model[key].float() - average.float(), rank)
        yield key, average, total


def cart_sweep(models, base, rank_ratio: Sequence[float], matrix_keys: str = DEFAULT_MATRIX_KEYS) -> Iterator:
    """(setting, theta_avg, direction) for every ratio, from one SVD per task and matrix."""
    matrices = set(cart_matrices("cart", models, matrix_keys))
    return _cart_sweep(models, list(rank_ratio), matrices)


def _cart_sweep(models, ratios: list[float], matrices: set[str]):
    anchor, directions = {}, {ratio: {} for ratio in ratios}  # every setting's merge: kept in host memory
    for key in models[0]:
        average = mean_tensor(models, key)
        anchor[key] = average.to("cpu")
        if key not in matrices:
            continue
        totals = {ratio: torch.zeros(average.shape, dtype=torch.float32, device=average.device) for ratio in ratios}
        for model in models:
            with tensor_step(key, models):
                decomposition = svd(model[key].float() - average.float())
            for ratio in ratios:
                totals[ratio] += decomposition.low_rank(cart_rank(average.shape, ratio))
        for ratio in ratios:
            directions[ratio][key] = totals[ratio].to("cpu")
    for ratio in ratios:
        yield {"rank_ratio": ratio}, anchor, directions[ratio]


register(
    ScaledMerge(
        name="cart",
        scaled_fn=cart,
        sweep_fn=cart_sweep,
    )
)
