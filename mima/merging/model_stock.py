"""Model Stock: per tensor, interpolate between the fine-tuned average and theta_0 by the tasks' angle.

Jang et al. 2024, "Model Stock: All we need is just a few fine-tuned models",
https://arxiv.org/abs/2403.19522, as FusionBench's `ModelStock`
(fusion_bench/method/model_stock/model_stock.py). For each floating tensor, with N models and
tau_t = theta_t - theta_0:
  cos_ij = <tau_i, tau_j> / (||tau_i|| ||tau_j|| + 1e-8), clamped to [-1, 1];
  angle  = the mean over the N (N - 1) / 2 pairs of arccos(cos_ij);
  t      = N cos(angle) / ((N - 1) cos(angle) + 1 + 1e-8);
  theta  = t * mean_t theta_t + (1 - t) * theta_0.
Every floating tensor has its own t (matrices, biases, norms, embeddings); a tensor that no task
changed has cos = 0, so t = 0 and it stays theta_0. Integer tensors come from theta_0. The
reference's `ignore_keys` (which then take the plain average) name text-tower tensors of a whole
CLIP (token embedding, ln_final, text_projection, ...); the image encoders mima merges have none of
them, so nothing is ignored. t is not clamped (the reference does not clamp it either): tasks at
more than 90 degrees give t < 0. No hyperparameters and no scaling coefficient.

Deliberate difference: inner products and norms are accumulated in float64 (the reference: in
float32), which changes t only by rounding.
Streams one key at a time (the N models' tensor of that key).
"""

from __future__ import annotations

import itertools
import math

import torch

from mima.core.linalg import require_finite
from mima.merging.common import task_vectors_by_key, tensor_step
from mima.merging.registry import MergeMethod, StreamingMerge, register

EPS = 1e-8  # the reference's guard in the cosine's and the ratio's denominators


def pair_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """<a, b> / (||a|| ||b|| + 1e-8), clamped to [-1, 1] (in float64)."""
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    norms = math.sqrt(float(a @ a) * float(b @ b))
    return min(1.0, max(-1.0, float(a @ b) / (norms + EPS)))


def interpolation_ratio(taus: list[torch.Tensor]) -> float:
    """Model Stock's t for one tensor: N cos(mean pairwise angle) / ((N - 1) cos + 1 + 1e-8)."""
    count = len(taus)
    angles = [math.acos(pair_cosine(a, b)) for a, b in itertools.combinations(taus, 2)]
    cosine = math.cos(sum(angles) / len(angles))
    return count * cosine / ((count - 1) * cosine + 1 + EPS)


def model_stock(models, base):
    """(key, merged tensor) per key of `base`; the pairwise angles need the 2 models at least that
    MergeMethod.check asks of every method."""
    for key, anchor, taus in task_vectors_by_key(models, base):
        if taus is None:
            yield key, anchor.clone()
            continue
        with tensor_step(key, models, base):  # one NaN would decide the whole tensor's angle
            for tau in taus:
                require_finite(tau, "angle between the task vectors")
        ratio = interpolation_ratio(taus)
        # t * mean_t theta_t + (1 - t) * theta_0 = theta_0 + t * mean_t tau_t
        mean_tau = torch.stack(taus).mean(dim=0)
        yield key, (anchor.float() + ratio * mean_tau).to(anchor.dtype)


register(
    StreamingMerge(
        name="model_stock",
        stream_fn=model_stock,
    )
)
