"""The merges that work on each matrix's singular value decomposition (TSV, Iso-C, Iso-CTS, WUDI, ACE,
SVC), each against a hand-worked example or the reference code's steps written again here (numpy, loop
by loop, or torch autograd for WUDI; ACE: unravel-xu/ACE-Merging src/merge/strategy.py `ace_merging`;
SVC: the paper's eqs. 4 and 8 as lyymuwu/SVC merge_func.py and FusionBench's utils.py compute them, with
the merged matrix's singular vectors), one-line refusals, and `mima merge`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from mima.cli import main
from mima.core.errors import MimaError
from mima.core.safetensors_io import load_state_dict
from mima.merging import get_method
from mima.merging.iso_cts import subspace_sizes
from tests.helpers import (CONV_KERNEL, MLP_BIAS, MLP_MATRIX, WIDE_MATRIX, assert_merge_flags_refused,
                           assert_streamed_merge_matches, matrix_models, merged_from_files, perturbed_models, save_models,
                           task_vectors)


# --------------------------------------------------------------------------------------------- TSV
def _numpy_tsv(taus: list[np.ndarray]) -> np.ndarray:
    """The official compute_and_sum_svd_mem_reduction for one matrix, written again in numpy."""
    svds = [np.linalg.svd(t, full_matrices=False) for t in taus]
    k = int(svds[0][1].shape[0] / len(taus))
    u_all = np.zeros_like(svds[0][0]); s_all = np.zeros_like(svds[0][1]); v_all = np.zeros_like(svds[0][2])
    for i, (u, s, v) in enumerate(svds):
        u_all[:, i * k:(i + 1) * k] = u[:, :k]; s_all[i * k:(i + 1) * k] = s[:k]; v_all[i * k:(i + 1) * k] = v[:k]
    uu, _, vu = np.linalg.svd(u_all, full_matrices=False)
    uv, _, vv = np.linalg.svd(v_all, full_matrices=False)
    return uu @ vu @ np.diag(s_all) @ uv @ vv


def test_tsv_matches_a_numpy_implementation_of_the_official_algorithm():
    base, models = perturbed_models(3, seed=5)
    merged = get_method("tsv")(models, base, lam=0.7)
    for key in (MLP_MATRIX, "proj"):
        taus = [m[key].double().numpy() - base[key].double().numpy() for m in models]
        np.testing.assert_allclose(merged[key].numpy(), base[key].numpy() + 0.7 * _numpy_tsv(taus), rtol=1e-4, atol=1e-4)
    expected_ln = base["ln.weight"] + 0.7 * torch.stack([m["ln.weight"] - base["ln.weight"] for m in models]).mean(0)
    torch.testing.assert_close(merged["ln.weight"], expected_ln)  # non-matrix: mean of task vectors


def test_tsv_on_orthogonal_task_vectors_is_task_arithmetic():
    # 9 x 6 matrices, T = 3: TSV keeps k = int(6 / 3) = 2 singular triplets per task. Each task
    # vector has exactly rank 2, on left and right singular vectors orthogonal to the other tasks'.
    g = torch.Generator().manual_seed(6)
    left, _ = torch.linalg.qr(torch.randn(9, 6, generator=g))
    right, _ = torch.linalg.qr(torch.randn(6, 6, generator=g))
    base = {MLP_MATRIX: torch.randn(9, 6, generator=g)}

    def task_vector(t: int) -> torch.Tensor:
        cols = [2 * t, 2 * t + 1]
        return left[:, cols] @ torch.diag(torch.tensor([3.0 + t, 1.0 + t])) @ right[:, cols].T

    models = [{MLP_MATRIX: base[MLP_MATRIX] + task_vector(t)} for t in range(3)]
    tsv = get_method("tsv")(models, base, lam=1.0)
    ta = get_method("task_arithmetic")(models, base, lam=1.0)
    torch.testing.assert_close(tsv[MLP_MATRIX], ta[MLP_MATRIX], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- Iso-C
def _polar(matrix: np.ndarray) -> np.ndarray:
    u, _, vt = np.linalg.svd(matrix, full_matrices=False)
    return u @ vt


def test_iso_c_hand_worked():
    # tau_1 = diag(3, 0), tau_2 = diag(0, 1): the sum has singular values 3 and 1, flattened to 2 -> 2 I.
    base = {"w": torch.zeros(2, 2), "b": torch.tensor([1.0, 1.0])}
    models = [{"w": torch.diag(torch.tensor([3.0, 0.0])), "b": torch.tensor([3.0, 1.0])},
              {"w": torch.diag(torch.tensor([0.0, 1.0])), "b": torch.tensor([1.0, 5.0])}]
    merged = get_method("iso_c")(models, base, lam=0.5)
    torch.testing.assert_close(merged["w"], 0.5 * 2 * torch.eye(2))
    torch.testing.assert_close(merged["b"], torch.tensor([1.0, 1.0]) + 0.5 * torch.tensor([1.0, 2.0]))  # mean of (2, 0), (0, 4)


def _numpy_iso_c(taus: list[np.ndarray]) -> np.ndarray:
    """FusionBench's iso_c for one 2-D tensor: SVD of the sum, singular values replaced by their mean."""
    u, s, vt = np.linalg.svd(sum(taus), full_matrices=False)
    return u @ np.diag(np.full_like(s, s.mean())) @ vt


def test_iso_c_matches_the_reference_steps_and_keeps_integers():
    base, models = matrix_models(3, seed=1)
    merged = get_method("iso_c")(models, base, lam=0.8)
    for key in (MLP_MATRIX, WIDE_MATRIX):
        expected = base[key].numpy() + 0.8 * _numpy_iso_c(task_vectors(base, models, key))
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-5, atol=1e-5)
        spectrum = np.linalg.svd(merged[key].double().numpy() - base[key].double().numpy(), compute_uv=False)
        np.testing.assert_allclose(spectrum, spectrum[0], rtol=1e-4)  # isotropic
    for key in (MLP_BIAS, CONV_KERNEL):  # not matrices: the mean task vector
        np.testing.assert_allclose(merged[key].numpy(), base[key].numpy() + 0.8 * np.mean(task_vectors(base, models, key), axis=0),
                                   rtol=1e-5, atol=1e-6)
    assert int(merged["counter"]) == 7
    # matrix_keys narrows the matrices: the wide one is then averaged
    narrowed = get_method("iso_c")(models, base, lam=0.8, matrix_keys="c_fc")
    torch.testing.assert_close(narrowed[MLP_MATRIX], merged[MLP_MATRIX])
    np.testing.assert_allclose(narrowed[WIDE_MATRIX].numpy(), base[WIDE_MATRIX].numpy() + 0.8 * np.mean(task_vectors(base, models, WIDE_MATRIX), axis=0),
                               rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------- Iso-CTS
@pytest.mark.parametrize("rank, tasks, fraction, expected", [
    (8, 3, 0.8, (5, 1)),      # c0 = 6, round(2 / 3) = 1 per task, common 8 - 3
    (768, 8, 0.8, (616, 19)),  # ViT-B: c0 = 614, round(154 / 8) = 19
    (8, 4, 0.5, (4, 1)),       # round(4 / 4) = 1
    (10, 4, 0.8, (10, 0)),     # round(2 / 4) = round(0.5) = 0 (half to even, as Python)
    (8, 3, 1.0, (8, 0)),       # everything common
    (8, 3, 0.0, (2, 2)),       # round(8 / 3) = 3 would need 9 > 8 directions: floor(8 / 3) = 2 each
])
def test_iso_cts_subspace_sizes(rank, tasks, fraction, expected):
    assert subspace_sizes(rank, tasks, fraction) == expected


def _numpy_iso_cts(taus: list[np.ndarray], fraction: float) -> np.ndarray:
    """FusionBench's iso_cts for one 2-D tensor, step by step (sizes as in the reference)."""
    k, count = min(taus[0].shape), len(taus)
    common = int(k * fraction)
    common = k - round((k - common) / count) * count
    per_task = int((k - common) / count)
    u, s, vt = np.linalg.svd(sum(taus), full_matrices=False)
    cu, cs, cv = u[:, :common], s[:common], vt[:common]
    stacked_u, stacked_s, stacked_v = np.zeros_like(u), np.zeros_like(s), np.zeros_like(vt)
    for i, tau in enumerate(taus):
        ut, st, vtt = np.linalg.svd(tau - cu @ cu.T @ tau, full_matrices=False)
        stacked_u[:, i * per_task:(i + 1) * per_task] = ut[:, :per_task]
        stacked_s[i * per_task:(i + 1) * per_task] = st[:per_task]
        stacked_v[i * per_task:(i + 1) * per_task] = vtt[:per_task]
    start = count * per_task
    stacked_u[:, start:start + common], stacked_s[start:start + common], stacked_v[start:start + common] = cu, cs, cv
    return _polar(stacked_u) @ np.diag(np.full_like(stacked_s, stacked_s.mean())) @ _polar(stacked_v)


@pytest.mark.parametrize("fraction", [0.8, 0.5, 0.3])
def test_iso_cts_matches_the_reference_steps(fraction):
    base, models = matrix_models(3, seed=2)
    merged = get_method("iso_cts")(models, base, lam=1.3, common_space_fraction=fraction)
    for key in (MLP_MATRIX, WIDE_MATRIX):
        expected = base[key].numpy() + 1.3 * _numpy_iso_cts(task_vectors(base, models, key), fraction)
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(merged[MLP_BIAS].numpy(), base[MLP_BIAS].numpy() + 1.3 * np.mean(task_vectors(base, models, MLP_BIAS), axis=0),
                               rtol=1e-5, atol=1e-6)
    assert int(merged["counter"]) == 7


def test_iso_cts_with_no_task_directions_is_iso_c():
    base, models = matrix_models(3, seed=3)
    cts = get_method("iso_cts")(models, base, lam=1.0, common_space_fraction=1.0)
    iso = get_method("iso_c")(models, base, lam=1.0)
    for key in (MLP_MATRIX, WIDE_MATRIX, MLP_BIAS):
        torch.testing.assert_close(cts[key], iso[key], rtol=1e-4, atol=1e-4)


def test_iso_cts_with_more_tasks_than_the_rank_allows_still_merges():
    # rank 5, T = 8, fraction 0: the reference's round(5 / 8) = 1 direction per task needs 8 > 5.
    base, models = matrix_models(8, seed=4, shapes=((WIDE_MATRIX, (5, 9)),))
    merged = get_method("iso_cts")(models, base, lam=1.0, common_space_fraction=0.0)
    expected = base[WIDE_MATRIX].numpy() + _numpy_iso_c(task_vectors(base, models, WIDE_MATRIX))  # 0 per task: all common, as Iso-C
    np.testing.assert_allclose(merged[WIDE_MATRIX].numpy(), expected, rtol=1e-4, atol=1e-4)


# -------------------------------------------------------------------------------------------- WUDI
def test_wudi_one_adam_step_hand_worked():
    # 1 x 2 matrices tau_1 = (1, 0), tau_2 = (1, 1); start X = (2, 1).
    # dL/dX = 2 (X - tau_1) tau_1^T tau_1 / 1 + 2 (X - tau_2) tau_2^T tau_2 / 2 = 2 (1)(1, 0) + (1)(1, 1) = (3, 1);
    # Adam's first step moves each entry by lr * g / (|g| + 1e-8), i.e. by lr against the gradient's sign.
    base = {"w": torch.zeros(1, 2), "b": torch.zeros(2)}
    models = [{"w": torch.tensor([[1.0, 0.0]]), "b": torch.tensor([1.0, 2.0])},
              {"w": torch.tensor([[1.0, 1.0]]), "b": torch.tensor([3.0, 0.0])}]
    merged = get_method("wudi")(models, base, steps=1, lr=0.1)
    torch.testing.assert_close(merged["w"], torch.tensor([[1.9, 0.9]]))
    torch.testing.assert_close(merged["b"], torch.tensor([2.0, 1.0]))  # not a matrix: the mean task vector


def _reference_wudi(taus: list[torch.Tensor], steps: int, lr: float) -> torch.Tensor:
    """FusionBench's wudi_merging for one 2-D tensor: autograd through the T products, Adam from the sum."""
    stacked = torch.stack(taus).float()
    merged = torch.nn.Parameter(stacked.sum(dim=0))
    optimizer = torch.optim.Adam([merged], lr=lr, weight_decay=0)
    squared_norms = stacked.reshape(len(taus), -1).norm(dim=-1).square()
    for _ in range(steps):
        product = torch.matmul(merged.unsqueeze(0) - stacked, stacked.transpose(1, 2))
        loss = torch.sum(product.square() / squared_norms[:, None, None])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return merged.detach()


def _wudi_loss(x: np.ndarray, taus: list[np.ndarray]) -> float:
    return sum(np.sum(((x - t) @ t.T) ** 2) / np.sum(t ** 2) for t in taus)


@pytest.mark.parametrize("steps, lr", [(300, 1e-5), (40, 1e-2)])
def test_wudi_matches_the_reference_optimisation(steps, lr):
    base, models = matrix_models(3, seed=5)
    merged = get_method("wudi")(models, base, steps=steps, lr=lr)
    for key in (MLP_MATRIX, WIDE_MATRIX):
        taus = [m[key] - base[key] for m in models]
        expected = base[key] + _reference_wudi(taus, steps, lr)
        torch.testing.assert_close(merged[key], expected, rtol=1e-5, atol=1e-5)
        moved = merged[key] - base[key] - sum(taus)
        assert float(moved.abs().max()) > 0.5 * min(steps * lr, 1e-2)  # Adam moved away from the sum
        numpy_taus = [t.double().numpy() for t in taus]
        assert _wudi_loss((merged[key] - base[key]).double().numpy(), numpy_taus) < _wudi_loss(sum(numpy_taus), numpy_taus)
    for key in (MLP_BIAS, CONV_KERNEL):
        np.testing.assert_allclose(merged[key].numpy(), base[key].numpy() + np.mean(task_vectors(base, models, key), axis=0),
                                   rtol=1e-5, atol=1e-6)
    assert int(merged["counter"]) == 7


def test_wudi_skips_a_task_that_did_not_change_a_matrix():
    base, models = matrix_models(2, seed=6)
    unchanged = {k: v.clone() for k, v in base.items()}  # tau = 0: the reference would divide 0 by 0
    with_idle = get_method("wudi")([*models, unchanged], base, steps=20, lr=1e-3)
    without = get_method("wudi")(models, base, steps=20, lr=1e-3)
    for key in (MLP_MATRIX, WIDE_MATRIX):
        assert bool(torch.isfinite(with_idle[key]).all())
        torch.testing.assert_close(with_idle[key], without[key])


# --------------------------------------------------------------------------------------------- ACE
TEXT_PROJECTION = "text_projection"
EMBEDDING = "positional_embedding"
CALIBRATION_SHAPES = ((MLP_MATRIX, (12, 8)), (WIDE_MATRIX, (5, 9)), (TEXT_PROJECTION, (6, 4)), (EMBEDDING, (7, 4)), (MLP_BIAS, (12,)))


def _calibration_models(count: int, seed: int = 0, scales: tuple[float, ...] | None = None):
    """theta_0 (with an integer tensor) and `count` models; `scales` multiplies each model's task vector."""
    base, models = perturbed_models(count, seed, CALIBRATION_SHAPES)
    if scales is not None:
        models = [{k: base[k] + scale * (v - base[k]) if v.is_floating_point() else v for k, v in m.items()}
                  for m, scale in zip(models, scales)]
    return base, models


def _reference_ace(taus: list[np.ndarray], eps: float = 1e-2, k_frac: float = 0.3) -> tuple[np.ndarray, bool]:
    """`ace_merging` for one 2-D layer, step by step (the list of covariances, an explicit inverse)."""
    count, in_dim = len(taus), taus[0].shape[1]
    traces = np.array([np.trace(w.T @ w) for w in taus])
    log_traces = np.log(traces + 1e-12)
    gamma = np.var(log_traces, ddof=1) / (np.mean(log_traces) ** 2 + 1e-12)  # torch.var is unbiased
    flag = gamma > 0.3
    avg_trace = traces.mean()
    sigmas, w_sigma_sum, sigma_sum = [], np.zeros_like(taus[0]), np.zeros((in_dim, in_dim))
    for w in taus:
        w = w - w.mean(axis=0, keepdims=True)
        sigma_raw = w.T @ w
        tr = np.trace(sigma_raw) + 1e-12
        sigma_t, eps_t = (sigma_raw / tr, eps / tr) if flag else (sigma_raw, eps)
        sigmas.append(sigma_t)
        sigma_t = sigma_t + eps_t * np.eye(in_dim)
        w_sigma_sum += w @ sigma_t
        sigma_sum += sigma_t
    c_agg = np.mean(sum(sigmas), axis=0, keepdims=True)
    if flag:
        c_agg = c_agg / (avg_trace + 1e-12)
    w_0 = w_sigma_sum @ np.linalg.inv(sigma_sum + c_agg)
    merged = w_0.copy()
    if flag:
        sigma_mean = sigma_sum / count
        delta_res = np.zeros_like(taus[0])
        for w, s_t in zip(taus, sigmas):
            delta_res += w @ (s_t - sigma_mean)
        u, s, vh = np.linalg.svd(delta_res + w_0, full_matrices=False)
        k = int(s.size * k_frac)
        merged += s[:k].mean() * (u[:, :k] @ vh[:k])
    return merged, bool(flag)


@pytest.mark.parametrize("scales, heterogeneous", [
    (None, False),               # similar update energies: the plain closed form
    ((0.01, 1.0, 30.0), True),   # energies far apart: trace-normalised covariances and the refinement
])
def test_ace_matches_the_reference_steps(scales, heterogeneous):
    base, models = _calibration_models(3, seed=1, scales=scales)
    merged = get_method("ace")(models, base, lam=0.7)
    for key in (MLP_MATRIX, WIDE_MATRIX):
        expected, flag = _reference_ace(task_vectors(base, models, key))
        assert flag is heterogeneous
        np.testing.assert_allclose(merged[key].double().numpy(), base[key].double().numpy() + 0.7 * expected,
                                   rtol=1e-4, atol=1e-5)
    for key in (MLP_BIAS, TEXT_PROJECTION):  # not matrices (the reference's rule): the mean task vector
        np.testing.assert_allclose(merged[key].numpy(), base[key].numpy() + 0.7 * np.mean(task_vectors(base, models, key), axis=0),
                                   rtol=1e-5, atol=1e-5)
    assert int(merged["counter"]) == 7


@pytest.mark.parametrize("eps, k_frac", [(0.5, 0.3), (1e-2, 0.6), (0.0, 1.0)])
def test_ace_hyperparameters_follow_the_reference(eps, k_frac):
    base, models = _calibration_models(4, seed=2, scales=(0.02, 1.0, 3.0, 50.0))
    merged = get_method("ace")(models, base, ace_epsilon=eps, ace_rank_fraction=k_frac)  # lam 1, the reference's
    expected, flag = _reference_ace(task_vectors(base, models, MLP_MATRIX), eps, k_frac)
    assert flag
    np.testing.assert_allclose(merged[MLP_MATRIX].double().numpy(), base[MLP_MATRIX].double().numpy() + expected, rtol=1e-4, atol=1e-5)


def test_ace_without_refinement_rank_is_the_closed_form():
    # 3 x 3 matrices keep int(0.3 * 3) = 0 directions: the reference's mean of no values is NaN there;
    # here the refinement is empty, which is rank fraction 0.
    base, models = _calibration_models(3, seed=3, scales=(0.01, 1.0, 30.0))
    key = "small"
    g = torch.Generator().manual_seed(4)
    base[key] = torch.randn(3, 3, generator=g)
    for index, model in enumerate(models):
        model[key] = base[key] + (0.01, 1.0, 30.0)[index] * torch.randn(3, 3, generator=g)
    merged = get_method("ace")(models, base)
    assert bool(torch.isfinite(merged[key]).all())
    torch.testing.assert_close(merged[key], get_method("ace")(models, base, ace_rank_fraction=0.0)[key])
    assert not torch.equal(merged[MLP_MATRIX], get_method("ace")(models, base, ace_rank_fraction=0.0)[MLP_MATRIX])


def test_ace_matrix_keys_narrow_the_matrices():
    base, models = _calibration_models(2, seed=5)
    narrowed = get_method("ace")(models, base, matrix_keys="c_fc")
    full = get_method("ace")(models, base)
    torch.testing.assert_close(narrowed[MLP_MATRIX], full[MLP_MATRIX])
    np.testing.assert_allclose(narrowed[WIDE_MATRIX].numpy(), base[WIDE_MATRIX].numpy() + np.mean(task_vectors(base, models, WIDE_MATRIX), axis=0),
                               rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------- SVC
def _reference_svc(merged_tau: np.ndarray, taus: list[np.ndarray], alpha: float) -> np.ndarray:
    """The calibration of one 2-D task vector, direction by direction and task by task."""
    u, s, vt = np.linalg.svd(merged_tau, full_matrices=False)
    gammas = []
    for r in range(s.size):
        merged_response = u[:, r] @ merged_tau  # a_r = u_r^T tau_m
        total = 0.0
        for tau in taus:
            task_response = u[:, r] @ tau  # a_r^i = u_r^T tau_i
            coefficient = merged_response @ task_response / max(task_response @ task_response, 1e-12)
            total += max(alpha, coefficient)
        gammas.append(len(taus) / total)  # FusionBench's gamma_r = K / sum_i max(alpha, s_r^i)
    return u @ np.diag(np.array(gammas) * s) @ vt


def test_svc_hand_worked():
    # Two equal tasks diag(2, 1): task arithmetic doubles them; both coefficients are 2 on both
    # directions, so SVC divides the doubling back out.
    base = {"w": torch.zeros(2, 2), "b": torch.zeros(2), "n": torch.tensor(4)}
    same = {"w": torch.diag(torch.tensor([2.0, 1.0])), "b": torch.ones(2), "n": torch.tensor(4)}
    merged = get_method("svc")([same, same], base, inner_hparams="lam=1", matrix_keys=".*")
    torch.testing.assert_close(merged["w"], torch.diag(torch.tensor([2.0, 1.0])))
    torch.testing.assert_close(merged["b"], 2 * torch.ones(2))  # not a matrix: task arithmetic's value
    assert int(merged["n"]) == 4
    # Orthogonal tasks diag(3, 0), diag(0, 1): on each direction one task has coefficient 1, the other
    # no response (0, floored to alpha): s_r / ((1 + alpha) / 2).
    models = [{"w": torch.diag(torch.tensor([3.0, 0.0])), "b": torch.zeros(2), "n": torch.tensor(4)},
              {"w": torch.diag(torch.tensor([0.0, 1.0])), "b": torch.zeros(2), "n": torch.tensor(4)}]
    merged = get_method("svc")(models, base, inner_hparams="lam=1", svc_alpha=0.5, matrix_keys=".*")
    torch.testing.assert_close(merged["w"], torch.diag(torch.tensor([4.0, 4.0 / 3.0])))
    merged = get_method("svc")(models, base, inner_hparams="lam=1", svc_alpha=1.0, matrix_keys=".*")
    torch.testing.assert_close(merged["w"], torch.diag(torch.tensor([3.0, 1.0])))


@pytest.mark.parametrize("alpha", [0.1, 0.125, 1.0])
def test_svc_after_task_arithmetic_matches_the_reference_steps(alpha):
    base, models = _calibration_models(3, seed=6)
    g = torch.Generator().manual_seed(7)
    shared = {k: torch.randn(v.shape, generator=g) for k, v in base.items() if v.is_floating_point()}
    models = [{k: v + shared[k] if k in shared else v for k, v in m.items()} for m in models]  # a shared direction
    merged = get_method("svc")(models, base, inner_hparams="lam=0.3", svc_alpha=alpha)
    for key in (MLP_MATRIX, WIDE_MATRIX):
        taus = task_vectors(base, models, key)
        expected = base[key].double().numpy() + _reference_svc(0.3 * sum(taus), taus, alpha)
        np.testing.assert_allclose(merged[key].double().numpy(), expected, rtol=1e-4, atol=1e-5)
    for key in (TEXT_PROJECTION, EMBEDDING, MLP_BIAS):  # the authors' rule: task arithmetic's values
        np.testing.assert_allclose(merged[key].numpy(), base[key].numpy() + 0.3 * np.sum(task_vectors(base, models, key), axis=0),
                                   rtol=1e-5, atol=1e-5)
    assert int(merged["counter"]) == 7


def test_svc_on_top_of_lines_calibrates_its_result():
    base, models = _calibration_models(3, seed=8)
    keys = r"resblocks\.(\d+)\."
    lines = get_method("lines")(models, base, base_merge="ties", lines_beta=0.8, block_keys=keys)
    merged = get_method("svc")(models, base, inner_merge="lines", inner_hparams=f"base_merge=ties,lines_beta=0.8,block_keys={keys}",
                               matrix_keys=".*")
    for key in (MLP_MATRIX, WIDE_MATRIX, TEXT_PROJECTION, EMBEDDING):
        expected = base[key].double().numpy() + _reference_svc(lines[key].double().numpy() - base[key].double().numpy(),
                                                               task_vectors(base, models, key), 0.1)
        np.testing.assert_allclose(merged[key].double().numpy(), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(merged[MLP_BIAS], lines[MLP_BIAS])
    # the Python API also takes the inner setting as a mapping
    mapped = get_method("svc")(models, base, inner_merge="lines", matrix_keys=".*",
                               inner_hparams={"base_merge": "ties", "lines_beta": 0.8, "block_keys": keys})
    assert all(torch.equal(mapped[k], merged[k]) for k in merged)


def test_svc_defaults_follow_the_references():
    assert get_method("svc").defaults == {"inner_merge": "task_arithmetic", "inner_hparams": "", "svc_alpha": 0.1,
                                          "matrix_keys": r"^(?!.*(?:text_projection|embedding)).*$"}
    assert get_method("ace").defaults == {"lam": 1.0, "ace_epsilon": 1e-2, "ace_rank_fraction": 0.3,
                                          "matrix_keys": r"^(?!.*text_projection).*$"}
    assert not get_method("svc").grid and not get_method("ace").grid  # neither reference searches anything
    base, models = _calibration_models(2, seed=9)
    default = get_method("svc")(models, base)  # task arithmetic at its own default lam 0.4
    explicit = get_method("svc")(models, base, inner_hparams="lam=0.4")
    assert all(torch.equal(default[k], explicit[k]) for k in default)


# ---------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("method, given, message", [
    ("iso_cts", {"common_space_fraction": 1.5}, "common_space_fraction must be a fraction of the rank, in [0, 1], got 1.5"),
    ("iso_c", {"lam": float("nan")}, "lam must be a finite number"),
    ("wudi", {"steps": 0}, "steps must be a positive whole number"),
    ("wudi", {"lr": -1e-5}, "lr must be a positive number"),
    ("wudi", {"lam": 1.0}, "takes no hyperparameter 'lam'"),
    ("ace", {"ace_epsilon": -1.0}, "merge method 'ace': ace_epsilon must be a non-negative number, got -1.0"),
    ("ace", {"ace_rank_fraction": 1.5}, "merge method 'ace': ace_rank_fraction must be a fraction of the rank, in [0, 1], got 1.5"),
    ("ace", {"alpha": 0.5}, "merge method 'ace' takes no hyperparameter 'alpha'"),
    ("svc", {"svc_alpha": 0.0}, "merge method 'svc': svc_alpha must be a positive number, got 0.0"),
    ("svc", {"inner_merge": "avg"}, "merge method 'svc': inner_merge must be the name of a registered merge method, got 'avg'"),
    ("svc", {"inner_merge": "adamerging"}, "merge method 'svc': inner_merge 'adamerging' needs task data; SVC calibrates "
                                           "one data-free merge, one of: ace, "),
    ("svc", {"inner_merge": "tall"}, "merge method 'svc': inner_merge 'tall' keeps one model per task;"),
    ("svc", {"inner_merge": "svc"}, "merge method 'svc': inner_merge 'svc' is SVC itself;"),
    ("svc", {"inner_hparams": "lam"}, "merge method 'svc': inner_hparams must be '' or comma-separated name=value pairs"),
    ("svc", {"inner_hparams": "k=20"}, "merge method 'svc': inner_hparams names 'k', which inner merge 'task_arithmetic' "
                                       "does not take (it takes: lam)"),
    ("svc", {"inner_hparams": "lam=big"}, "merge method 'svc': inner_hparams lam=big: lam must be a finite number"),
    ("svc", {"inner_hparams": "lam=1,lam=2"}, "merge method 'svc': inner_hparams gives 'lam' twice"),
    ("svc", {"inner_merge": "ties", "inner_hparams": "k=500"},
     "merge method 'svc': inner merge 'ties': inner_hparams k must be a percentage of entries kept, in (0, 100], got 500.0"),
    ("svc", {"inner_merge": "consensus", "inner_hparams": "min_tasks=3"},
     "merge method 'svc': inner merge 'consensus': min_tasks (--min-tasks) must be at most the 2 models given, got 3"),
    ("svc", {"lam": 0.3}, "merge method 'svc' takes no hyperparameter 'lam'"),
])
def test_bad_hyperparameters_are_one_line_errors(method, given, message):
    base, models = _calibration_models(2, seed=10)
    with pytest.raises(MimaError) as error:
        get_method(method)(models, base, **given)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize("method", ["ace", "svc"])
def test_non_finite_weights_are_refused_in_one_line(method):
    base, models = _calibration_models(3, seed=12)
    models[1][MLP_MATRIX][0, 0] = float("nan")
    with pytest.raises(MimaError) as error:
        get_method(method)(models, base)
    assert str(error.value) == (f"models[1]: tensor '{MLP_MATRIX}' holds NaN or Inf values; a merge needs finite weights "
                                "(`mima merge --allow-non-finite`, or allow_non_finite=True, merges them as they are)")
    # allowed through, they reach ACE's solve or the calibration's SVD, which refuse them in one line
    with pytest.raises(MimaError) as allowed:
        get_method(method)(models, base, allow_non_finite=True)
    step = "solve" if method == "ace" else "SVD"
    assert str(allowed.value) == (f"{method}: tensor '{MLP_MATRIX}' holds NaN or Inf values, which allow_non_finite "
                                  f"(--allow-non-finite) let through; its {step} cannot take them")


@pytest.mark.parametrize("argv, fragment", [
    (["--method", "iso_cts", "--common-space-fraction", "1.5"], "--common-space-fraction must be a fraction of the rank, in [0, 1]"),
    (["--method", "wudi", "--steps", "0"], "--steps must be a positive whole number"),
    (["--method", "wudi", "--lam", "0.5"], "--lam does not apply to merge method 'wudi'"),
    (["--method", "ace", "--ace-rank-fraction", "2"], "merge method 'ace': --ace-rank-fraction must be a fraction of the rank"),
    (["--method", "ace", "--lam", "nan"], "merge method 'ace': --lam must be a finite number"),
    (["--method", "svc", "--inner-merge", "fisher"], "merge method 'svc': --inner-merge 'fisher' needs task data"),
    (["--method", "svc", "--inner-hparams", "lam=oops"], "merge method 'svc': --inner-hparams lam=oops: lam must be a finite number"),
    (["--method", "svc", "--inner-merge", "ties", "--inner-hparams", "k=0"],
     "merge method 'svc': inner merge 'ties': --inner-hparams k must be a percentage of entries kept"),
    (["--method", "svc", "--lam", "0.3"], "--lam does not apply to merge method 'svc'"),
])
def test_bad_flags_are_one_line(argv, fragment, tmp_path, capsys):
    assert_merge_flags_refused(tmp_path, capsys, argv, fragment)


def test_iso_and_wudi_defaults_and_grids_follow_the_references():
    assert get_method("iso_c").defaults["lam"] == 1.0 and get_method("iso_cts").defaults["lam"] == 1.0
    assert get_method("iso_cts").defaults["common_space_fraction"] == 0.8
    assert get_method("iso_c").grid["lam"] == tuple(np.round(np.linspace(0, 3, 31)[1:], 1))
    assert get_method("wudi").defaults["steps"] == 300 and get_method("wudi").defaults["lr"] == 1e-5
    assert not get_method("wudi").grid


# -------------------------------------------------------------------------------------- mima merge
@pytest.mark.parametrize("name", ["tsv"])
def test_streamed_file_merge_matches_the_formula(tmp_path, name):
    def formula(base, models):  # lam 1; every 2-D tensor gets TSV, others the mean task vector
        keys = (MLP_MATRIX, "ln.weight", "proj")
        taus = {key: np.stack([m[key].numpy() - base[key].numpy() for m in models]).astype(np.float64) for key in keys}
        return {key: base[key].double().numpy() + (_numpy_tsv(list(taus[key])) if taus[key].ndim == 3 else taus[key].mean(0))
                for key in keys}

    assert_streamed_merge_matches(tmp_path, name, formula)


@pytest.mark.parametrize("method, flags, hparams", [
    ("iso_c", ["--lam", "0.7", "--matrix-keys", "c_fc"], {"lam": 0.7, "matrix_keys": "c_fc"}),
    ("iso_cts", ["--common-space-fraction", "0.5", "--lam", "1.2"], {"common_space_fraction": 0.5, "lam": 1.2}),
    ("wudi", ["--steps", "5", "--lr", "0.01"], {"steps": 5, "lr": 0.01}),
])
def test_mima_merge_from_safetensors_files(method, flags, hparams, tmp_path, capsys):
    base, models, written = merged_from_files(tmp_path, method, flags)
    for key, value in _reference_merge(method, hparams, base, models).items():
        np.testing.assert_allclose(written[key].double().numpy(), value, rtol=1e-4, atol=1e-4, err_msg=key)
    assert f"mima merge: {method}" in capsys.readouterr().out


def _reference_merge(method: str, hparams: dict, base, models) -> dict[str, np.ndarray]:
    """Each floating tensor as the reference steps above compute it (not the strategies' code): the
    2-D tensors that --matrix-keys selects (default: all) get the method's matrix rule, the others the
    mean task vector."""
    selected = hparams.get("matrix_keys", "")
    expected = {}
    for key in (MLP_MATRIX, WIDE_MATRIX, MLP_BIAS, CONV_KERNEL):
        theta_0, taus = base[key].double().numpy(), task_vectors(base, models, key)
        matrix = base[key].ndim == 2 and selected in key
        if method == "iso_c":
            expected[key] = theta_0 + hparams["lam"] * (_numpy_iso_c(taus) if matrix else np.mean(taus, axis=0))
        elif method == "iso_cts":
            rule = _numpy_iso_cts(taus, hparams["common_space_fraction"]) if matrix else np.mean(taus, axis=0)
            expected[key] = theta_0 + hparams["lam"] * rule
        else:
            torch_taus = [m[key] - base[key] for m in models]
            rule = _reference_wudi(torch_taus, hparams["steps"], hparams["lr"]).double().numpy() if matrix else np.mean(taus, axis=0)
            expected[key] = theta_0 + rule
    return expected


@pytest.mark.parametrize("method, flags, hparams", [
    ("ace", ["--ace-epsilon", "0.1", "--lam", "0.9"], {"ace_epsilon": 0.1, "lam": 0.9}),
    ("svc", ["--inner-merge", "ties", "--inner-hparams", "k=30,lam=0.8", "--svc-alpha", "0.2"],
     {"inner_merge": "ties", "inner_hparams": "k=30,lam=0.8", "svc_alpha": 0.2}),
])
def test_mima_merge_streams_from_safetensors_files(method, flags, hparams, tmp_path, capsys):
    base, models = _calibration_models(3, seed=11, scales=(0.05, 1.0, 20.0))
    base_path, paths = save_models(tmp_path, base, models)
    out = tmp_path / f"{method}.safetensors"
    argv = ["merge", "--method", method, "--base", str(base_path), "--models", *map(str, paths), "--output", str(out), *flags]
    assert main(argv) == 0
    written = load_state_dict(out)
    expected = get_method(method)(models, base, **hparams)
    assert sorted(written) == sorted(base)
    for key, value in expected.items():
        torch.testing.assert_close(written[key], value, rtol=1e-6, atol=1e-6)
    assert f"mima merge: {method}" in capsys.readouterr().out


def test_ace_select_on_val_from_files(tmp_path, small_clip, capsys):
    """`mima merge --method ace --select-on val` on a small CLIP: the defaults (ACE has no grid) are
    scored on validation, reported, and the merge written is ACE's at the defaults."""
    from mima.pools import task_pool

    config = {"model": {"clip": small_clip, "pretrained": None}, "data": {"suite": "digits", "tasks": ["rot90", "mirror"]}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    base = {k: v.detach().clone() for k, v in task_pool(config).encoder.state_dict().items()}
    models = []
    for seed, scale in ((1, 0.05), (2, 0.2)):
        g = torch.Generator().manual_seed(seed)
        models.append({k: v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in base.items()})
    base_path, paths = save_models(tmp_path, base, models)
    out = tmp_path / "ace.safetensors"
    assert main(["merge", "--method", "ace", "--base", str(base_path), "--models", *map(str, paths),
                 "--config", str(tmp_path / "config.yaml"), "--output", str(out), "--select-on", "val"]) == 0
    report = json.loads((tmp_path / "ace.safetensors.results.json").read_text())
    assert report["method"] == "ace" and report["selected_on"] == "val"
    assert report["hparams"] == {"lam": 1.0, "ace_epsilon": 0.01, "ace_rank_fraction": 0.3}
    assert len(report["trials"]) == 1 and report["validation_accuracy"] == report["trials"][0]["score"]
    assert set(report["test_accuracy"]) == {"rot90", "mirror", "mean"}
    written = load_state_dict(out)
    expected = get_method("ace")(models, base)
    for key, value in expected.items():
        torch.testing.assert_close(written[key], value)
    two_d = [k for k, v in base.items() if v.ndim == 2]
    assert two_d and any(not torch.allclose(written[k], base[k] + sum(m[k] - base[k] for m in models) / 2) for k in two_d)
    capsys.readouterr()
