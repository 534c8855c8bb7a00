"""Iso-CTS: isotropic merging in the common and task-specific subspaces; theta = theta_0 + lam * merged.

Marczak et al. 2025, "No Task Left Behind: Isotropic Model Merging with Common and Task-Specific
Subspaces", https://arxiv.org/abs/2502.04959, as FusionBench's `iso_cts`
(fusion_bench/method/isotropic_merging/iso_utils.py), which is the authors' code. For each 2-D
tensor (m x n, rank k = min(m, n)) with T task vectors:
  1. sizes: c0 = int(k * common_space_fraction); each task gets d = round((k - c0) / T) directions
     (Python's round, half to even) and the common subspace the rest, c = k - T * d;
  2. common subspace: the top c singular triplets (U_c, s_c, V_c) of S = sum_t tau_t;
  3. task subspaces: each task's residual tau_t - U_c U_c^T tau_t gives its top d triplets;
  4. the T * d task columns (task 1 first) and then the c common columns are placed side by side,
     U and V^T are each replaced by their polar factor (nearest orthonormal columns / rows), and the
     spectrum is flat at the mean of all k stacked singular values: merged = U' diag(mean) V'^T.
Every other floating tensor takes mean_t tau_t; integer tensors come from theta_0. Which tensors are
matrices (`matrix_keys`, every 2-D tensor by default), lam's default 1.0 and its grid 0.1 .. 3.0:
as Iso-C (see mima.merging.iso_c). common_space_fraction: 0.8 (the authors' and FusionBench's
default, not tuned on validation).

Deliberate difference: when the rounding in step 1 asks for more task directions than the rank
(T * d > k, e.g. T = 8 tasks on a matrix of rank 5; the reference then fails on a negative size),
each task gets d = floor(k / T) directions and the common subspace the remaining k - T * d.
Streams one key at a time: the T task vectors of one tensor and T + 3 SVDs.
"""

from __future__ import annotations

import torch

from mima.core.linalg import polar_factor, svd
from mima.merging.catalogue import EVERY_MATRIX
from mima.merging.common import matrices_merged
from mima.merging.registry import ScaledMerge, register


def subspace_sizes(rank: int, tasks: int, common_space_fraction: float) -> tuple[int, int]:
    """(common directions c, directions per task d) with c + tasks * d = rank, as the reference
    rounds them (see the module docstring for the case where it cannot)."""
    common = int(rank * common_space_fraction)
    per_task = round((rank - common) / tasks)
    if per_task * tasks > rank:  # the reference would make c negative and fail
        per_task = rank // tasks
    return rank - per_task * tasks, per_task


def iso_cts_matrix(taus: list[torch.Tensor], common_space_fraction: float) -> torch.Tensor:
    """The Iso-CTS merge of T task matrices (float32)."""
    tasks = len(taus)
    total = svd(torch.stack(taus).sum(dim=0))
    common, per_task = subspace_sizes(total.full_rank, tasks, common_space_fraction)
    common_u = total.u[:, :common]
    u_columns, singular_values, v_rows = [], [], []
    for tau in taus:
        residual = svd(tau.float() - common_u @ (common_u.T @ tau.float()))
        u_columns.append(residual.u[:, :per_task])
        singular_values.append(residual.s[:per_task])
        v_rows.append(residual.vh[:per_task])
    u_columns.append(common_u)
    singular_values.append(total.s[:common])
    v_rows.append(total.vh[:common])
    flat = torch.cat(singular_values).mean()
    return (polar_factor(torch.cat(u_columns, dim=1)) * flat) @ polar_factor(torch.cat(v_rows, dim=0))


def iso_cts(models, base, common_space_fraction: float, matrix_keys: str = EVERY_MATRIX):
    """(key, theta_0, Iso-CTS merged task vector or None) per key."""
    return matrices_merged(models, base, matrix_keys, lambda taus: iso_cts_matrix(taus, common_space_fraction))


register(
    ScaledMerge(
        name="iso_cts",
        scaled_fn=iso_cts,
    )
)
