"""Iso-C: isotropic merging in the common subspace; theta = theta_0 + lam * merged.

Marczak et al. 2025, "No Task Left Behind: Isotropic Model Merging with Common and Task-Specific
Subspaces", https://arxiv.org/abs/2502.04959, as FusionBench's `iso_c`
(fusion_bench/method/isotropic_merging/iso_utils.py), which is the authors' code:
  * each 2-D tensor: the task-arithmetic sum S = sum_t tau_t, its thin SVD S = U diag(s) V^T, and
    the spectrum flattened to its mean: merged = U diag(mean(s) * 1) V^T (mean over all min(m, n)
    singular values, including the near-zero ones);
  * every other floating tensor (biases, norms, class embedding, 4-D convolutions): mean_t tau_t;
  * integer tensors come from theta_0.
"2-D" is the reference's rule: every 2-D tensor (its `exclude_keys` is empty by default), so on
open_clip also the positional embedding and the output projection; `matrix_keys` (a regular
expression searched in the key) narrows it, as `exclude_keys` does there. On open_clip the
attention's q, k and v weights are one fused `in_proj_weight` matrix, decomposed as one matrix
(as the authors' open_clip code does; FusionBench's transformers CLIP has three).
lam (the paper's alpha) is 1.0 without validation (FusionBench's `scaling_factor`); the authors
search it on validation over 0.1, 0.2, .., 3.0 (np.linspace(0, 3, 31)[1:]) with early stopping
after 3 non-improving points; mima scores the whole grid (no early stopping).

Streams one key at a time: the T task vectors of one tensor and one SVD.
"""

from __future__ import annotations

import torch

from mima.core.linalg import svd
from mima.merging.common import per_matrix
from mima.merging.registry import ScaledMerge, register


def iso_c_matrix(taus: list[torch.Tensor]) -> torch.Tensor:
    """U diag(mean(s)) V^T of the SVD of sum_t tau_t (float32)."""
    decomposition = svd(torch.stack(taus).sum(dim=0))
    flat = decomposition.s.mean()
    return (decomposition.u * flat) @ decomposition.vh


register(
    ScaledMerge(
        name="iso_c",
        scaled_fn=per_matrix(iso_c_matrix),
    )
)
