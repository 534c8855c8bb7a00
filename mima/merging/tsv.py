"""TSV-Merge: task singular vectors, decorrelated across tasks.

Gargiulo et al. 2025, "Task Singular Vectors: Reducing Task Interference in Model Merging",
https://arxiv.org/abs/2412.00081, as the official code (compute_and_sum_svd_mem_reduction):
for each 2-D tensor except `text_projection` (`matrix_keys` overrides which), every task vector
tau_t = U_t S_t V_t^T keeps its top k = int(min(m, n) / T) singular triplets; the kept U and V
columns of all tasks are placed side by side and each block is replaced by its polar factor
(U -> P Q^T from the SVD P S Q^T), which makes the tasks' singular vectors orthonormal; the merged
matrix is U_perp diag(S) V_perp^T. Other tensors take the mean of the task vectors.
theta = theta_0 + lam * merged; lam = 1 (FusionBench's default), searched on validation over
0.1 .. 3.0 (the official sweep). With tasks whose singular vectors are already orthogonal this is
task arithmetic with lam = 1 on those matrices.
"""

from __future__ import annotations

import torch

from mima.core.linalg import polar_factor, svd
from mima.merging.common import per_matrix
from mima.merging.registry import ScaledMerge, register


def tsv_matrix(taus: list[torch.Tensor]) -> torch.Tensor:
    """The TSV merge of T task matrices (float32)."""
    count = len(taus)
    decompositions = [svd(tau) for tau in taus]
    k = int(decompositions[0].full_rank / count)
    u_blocks = torch.zeros_like(decompositions[0].u)
    s_blocks = torch.zeros_like(decompositions[0].s)
    v_blocks = torch.zeros_like(decompositions[0].vh)
    for index, d in enumerate(decompositions):
        u_blocks[:, index * k : (index + 1) * k] = d.u[:, :k]
        s_blocks[index * k : (index + 1) * k] = d.s[:k]
        v_blocks[index * k : (index + 1) * k, :] = d.vh[:k, :]
    return polar_factor(u_blocks) @ torch.diag(s_blocks) @ polar_factor(v_blocks)


register(
    ScaledMerge(
        name="tsv",
        scaled_fn=per_matrix(tsv_matrix),
    )
)
