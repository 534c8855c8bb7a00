"""ACE-Merging: data-free merging by adaptive covariance estimation; theta = theta_0 + lam * merged.

Xu et al. 2026 (CVPR), "ACE-Merging: Data-Free Model Merging with Adaptive Covariance Estimation",
https://arxiv.org/abs/2603.02945, as the authors' code: unravel-xu/ACE-Merging,
src/merge/strategy.py, `MergeStrategy.ace_merging` (applied by src/steps/step3.py with the
`scaling_coefficient` of control/config.py). The least-squares merge of linear layers whose inputs
have covariances Sigma_t is W = (sum_t W_t Sigma_t)(sum_t Sigma_t)^-1; ACE estimates each Sigma_t
from the task vector itself (its rows seen as samples). Per 2-D tensor (out x in), task vectors W_t:

  heterogeneity  n_t = ||W_t||_F^2, l_t = log(n_t + 1e-12); the layer is heterogeneous when
                 var(l) / (mean(l)^2 + 1e-12) > 0.3 (unbiased variance over the T tasks)
  covariances    C_t = W_t minus the mean of its rows; S_t = C_t^T C_t, divided by tr(S_t) + 1e-12 in
                 a heterogeneous layer; ridge e_t = eps (eps / (tr(S_t) + 1e-12) when heterogeneous)
  prior          c = the column means of sum_t S_t, a 1 x in row (divided by mean_t n_t + 1e-12 when
                 heterogeneous), added to every row of the system matrix (torch broadcasting, as the
                 reference adds its keepdim row)
  closed form    W_0 = (sum_t C_t (S_t + e_t I)) (sum_t (S_t + e_t I) + 1 c)^-1
  refinement     heterogeneous layers only: R = sum_t W_t (S_t - mean_t (S_t + e_t I)) + W_0 (W_t not
                 centred here, as in the reference), SVD R = U diag(s) V^T, k = int(rank_fraction *
                 min(out, in)); merged = W_0 + mean(s_1 .. s_k) U_k V_k^T (an isotropic boost of R's top
                 directions)

Every other floating tensor (biases, norms, class embedding, convolutions) and any `text_projection`
takes mean_t tau_t (the reference's 1-D rule); integer tensors come from theta_0. `matrix_keys`
narrows the matrices (default: every 2-D tensor but text_projection, the reference's rule).

Hyperparameters: the reference's defaults, eps = 1e-2 (`ace_epsilon`), k_frac = 0.3
(`ace_rank_fraction`), scaling coefficient lam = 1.0; the 0.3 heterogeneity threshold is fixed in
the reference and here. The method is hyperparameter-free and its authors search nothing, so there is
no grid: `--select-on val` scores the defaults.

Deliberate differences, none of which changes a well-posed result:
  * computed in float64 (the reference: the checkpoints' float32) and W_0 by a linear solve, not an
    explicit inverse; a singular system takes the pseudo-inverse, the reference's fallback;
  * k = 0 (a matrix with min(out, in) < 1 / rank_fraction): the reference's mean of no singular
    values is NaN, which poisons the layer; here the refinement is then empty;
  * the sums over tasks are accumulated one task at a time (no list of T in x in covariances).
Streams one key at a time: the T task vectors of one tensor and a few in x in accumulators.
"""

from __future__ import annotations

import torch

from mima.core import linalg
from mima.merging.catalogue import DEFAULT_ACE_MATRIX_KEYS
from mima.merging.common import matrices_merged
from mima.merging.registry import ScaledMerge, register

# The reference's fixed threshold on the spread of the tasks' log squared norms.
HETEROGENEITY_THRESHOLD = 0.3
# The reference's guards against log(0) and division by zero.
TINY = 1e-12


def is_heterogeneous(taus: list[torch.Tensor]) -> bool:
    """Whether the tasks' update energies differ enough (relative variance of log ||W_t||_F^2) that
    each covariance is normalised by its trace and the layer gets the spectral refinement."""
    logs = torch.log(torch.stack([tau.square().sum() for tau in taus]) + TINY)
    spread = logs.var() / (logs.mean().square() + TINY)
    return bool(spread > HETEROGENEITY_THRESHOLD)


def ace_matrix(taus: list[torch.Tensor], epsilon: float, rank_fraction: float) -> torch.Tensor:
    """The ACE merge of T task matrices (out x in), returned in float32."""
    taus = [tau.double() for tau in taus]
    count, width = len(taus), taus[0].shape[1]
    heterogeneous = is_heterogeneous(taus)
    covariance_sum = torch.zeros(width, width, dtype=torch.float64, device=taus[0].device)  # sum_t S_t (no ridge)
    ridge_sum = 0.0  # sum_t e_t
    weighted = torch.zeros_like(taus[0])  # sum_t C_t (S_t + e_t I)
    moved = torch.zeros_like(taus[0])  # sum_t W_t S_t (the refinement's, uncentred)
    for tau in taus:
        centred = tau - tau.mean(dim=0, keepdim=True)
        covariance = centred.T @ centred
        scale = 1.0
        if heterogeneous:  # trace-normalised, so a task with a large update does not dominate
            scale = 1.0 / (float(torch.trace(covariance)) + TINY)
        covariance_sum += scale * covariance
        ridge_sum += scale * epsilon
        # C S = C C^T C: multi_dot multiplies the narrow side first (C C^T when out < in), cheaper than C @ S
        weighted += scale * (torch.linalg.multi_dot([centred, centred.T, centred]) + epsilon * centred)
        if heterogeneous:
            moved += scale * torch.linalg.multi_dot([tau, centred.T, centred])
    system = covariance_sum + ridge_sum * torch.eye(width, dtype=torch.float64, device=taus[0].device)
    prior = covariance_sum.mean(dim=0, keepdim=True)  # a row, broadcast over the system's rows
    if heterogeneous:
        prior = prior / (float(torch.stack([tau.square().sum() for tau in taus]).mean()) + TINY)
    merged = solve_right(weighted, system + prior)
    if heterogeneous:
        residual = moved - sum(taus) @ (system / count)
        merged = merged + isotropic_refinement(residual + merged, rank_fraction)
    return merged.float()


def right_solve(system: torch.Tensor, right: torch.Tensor, prior: torch.Tensor | None) -> torch.Tensor:
    """right @ system^-1 by LAPACK's solve (x system = right)."""
    return torch.linalg.solve(system, right, left=False)


def right_pseudo_inverse(system: torch.Tensor, right: torch.Tensor, prior: torch.Tensor | None) -> torch.Tensor:
    """right @ pinv(system): the reference's answer to a singular system."""
    return right @ torch.linalg.pinv(system)


# The reference's routes (float64 throughout), as mima.core.linalg.solve takes them: a solve, and the
# pseudo-inverse where the system is singular.
ACE_SOLVE_ROUTES = (("float64", right_solve), ("pseudo-inverse", right_pseudo_inverse))


def solve_right(right: torch.Tensor, system: torch.Tensor) -> torch.Tensor:
    """right @ system^-1; the pseudo-inverse when the system is singular (the reference's fallback).
    NaN or Inf in either, or both routes failing, is mima.core.linalg's one-line refusal."""
    return linalg.solve(system, right, routes=ACE_SOLVE_ROUTES)


def isotropic_refinement(fused: torch.Tensor, rank_fraction: float) -> torch.Tensor:
    """mean(s_1 .. s_k) U_k V_k^T of the SVD of `fused`, k = int(rank_fraction * rank); zero for k = 0."""
    decomposition = linalg.svd(fused, dtype=torch.float64)
    u, s, vh = decomposition.u, decomposition.s, decomposition.vh
    kept = int(s.numel() * rank_fraction)
    if kept == 0:
        return torch.zeros_like(fused)
    return s[:kept].mean() * (u[:, :kept] @ vh[:kept])


def ace(models, base, ace_epsilon: float, ace_rank_fraction: float, matrix_keys: str = DEFAULT_ACE_MATRIX_KEYS):
    """(key, theta_0, ACE merged task vector or None) per key."""
    return matrices_merged(models, base, matrix_keys, lambda taus: ace_matrix(taus, ace_epsilon, ace_rank_fraction))


register(
    ScaledMerge(
        name="ace",
        scaled_fn=ace,
    )
)
