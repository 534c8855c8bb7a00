"""The strategies beyond the foundation four, each against an independent computation."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from mima.core.errors import MimaError
from mima.core.safetensors_io import load_state_dict, save_state_dict
from mima.merging import get_method
from mima.merging.breadcrumbs import breadcrumb_mask
from mima.merging.common import pack, unpack
from mima.merging.dare import dare
from mima.merging.engine import merge_to_file, open_inputs
from mima.merging.regmean import regmean_weight
from tests.helpers import MLP_MATRIX as MATRIX
from tests.helpers import numpy_ties, perturbed_models


# ---------------------------------------------------------------------------------- DARE
def test_dare_with_no_drop_is_task_arithmetic_and_ties():
    base, models = perturbed_models(3)
    for dare_name, plain, hp in (("dare_task_arithmetic", "task_arithmetic", {"lam": 0.3}), ("dare_ties", "ties", {"lam": 1.2})):
        dared = get_method(dare_name)(models, base, drop=0.0, **hp)
        reference = get_method(plain)(models, base, **hp)
        assert all(torch.equal(dared[k], reference[k]) for k in reference)


def test_dare_drops_and_rescales_reproducibly():
    tau = torch.randn(200, 50, generator=torch.Generator().manual_seed(1))
    dropped = dare(tau, 0.3, seed=4, task=1, key="w")
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept], tau[kept] / 0.7)  # survivors rescaled by 1 / (1 - p)
    assert abs(float(kept.float().mean()) - 0.7) < 0.02  # about 1 - p of 10000 entries survive
    assert torch.equal(dropped, dare(tau, 0.3, seed=4, task=1, key="w"))
    assert not torch.equal(dropped, dare(tau, 0.3, seed=5, task=1, key="w"))
    assert not torch.equal(dropped, dare(tau, 0.3, seed=4, task=2, key="w"))


def _reference_keep(seed: int, task: int, key: str, shape, drop: float) -> np.ndarray:
    """DARE's documented mask, written again: Bernoulli keep masks from torch.rand seeded by
    sha256('dare/<seed>/<task>/<key>') (first 8 bytes, little endian, 63 bits)."""
    digest = hashlib.sha256(f"dare/{seed}/{task}/{key}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return (torch.rand(tuple(shape), generator=generator) >= drop).numpy()


def _dropped(base, models, key, drop, seed) -> np.ndarray:
    """[T, ...] task vectors (float32 as the code subtracts) with DARE's drop and rescale applied."""
    taus = np.stack([m[key].numpy() - base[key].numpy() for m in models])
    keeps = np.stack([_reference_keep(seed, t, key, base[key].shape, drop) for t in range(len(models))])
    return taus.astype(np.float64) * keeps / (1 - drop)


@pytest.mark.parametrize("drop, seed", [(0.3, 4), (0.3, 5), (0.8, 0)])
def test_dare_task_arithmetic_with_drop_matches_an_independent_reimplementation(drop, seed):
    base, models = perturbed_models(3, seed=11)
    merged = get_method("dare_task_arithmetic")(models, base, lam=0.7, drop=drop, seed=seed)
    for key in (MATRIX, "ln.weight", "proj"):
        expected = base[key].numpy() + 0.7 * _dropped(base, models, key, drop, seed).sum(0)
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-5, atol=1e-5)
    assert int(merged["counter"]) == 7


def test_dare_ties_with_drop_is_numpy_ties_on_the_dropped_vectors():
    base, models = perturbed_models(3, seed=12)
    merged = get_method("dare_ties")(models, base, lam=1.3, drop=0.4, seed=2, k=30)
    keys = (MATRIX, "ln.weight", "proj")
    expected = numpy_ties({key: _dropped(base, models, key, 0.4, 2) for key in keys}, k=30)
    for key in keys:
        np.testing.assert_allclose(merged[key].numpy(), base[key].numpy() + 1.3 * expected[key], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- breadcrumbs
def test_breadcrumb_mask_hand_worked():
    # width 5: gamma 0.2 removes int(1.0) = 1 largest (5), density 0.4 keeps the next int(2.0) = 2 (4 and -3)
    row = torch.tensor([[5.0, -1.0, -3.0, 0.5, 4.0], [0.1, 0.2, 0.3, 0.4, 0.5]])
    expected = torch.tensor([[False, False, True, False, True], [False, False, True, True, False]])
    assert torch.equal(breadcrumb_mask(row, density=0.4, gamma=0.2), expected)
    # ties in magnitude go to the earlier position; scalars are kept
    assert torch.equal(breadcrumb_mask(torch.tensor([2.0, -2.0, 2.0, 1.0]), 0.5, 0.0), torch.tensor([True, True, False, False]))
    assert bool(breadcrumb_mask(torch.tensor(3.0), 0.1, 0.5))


def _numpy_breadcrumbs(tau: np.ndarray, density: float, gamma: float) -> np.ndarray:
    """Per row (last dimension): drop the int(n gamma) largest magnitudes, keep the next int(n density)
    (earlier position first among equal magnitudes), zero the rest."""
    rows = tau.reshape(-1, tau.shape[-1])
    width = rows.shape[1]
    top, keep = int(width * gamma), int(width * density)
    kept = np.zeros_like(rows)
    for r, row in enumerate(rows):
        order = np.argsort(-np.abs(row), kind="stable")
        kept[r, order[top : top + keep]] = row[order[top : top + keep]]
    return kept.reshape(tau.shape)


def test_breadcrumbs_merge_formula():
    base, models = perturbed_models(2, seed=2)
    merged = get_method("breadcrumbs")(models, base, lam=0.5, density=0.5, gamma=0.25)
    for key in (MATRIX, "ln.weight", "proj"):  # widths 8, 8, 4: drop the top 2, 2, 1 and keep 4, 4, 2 per row
        taus = [m[key].numpy() - base[key].numpy() for m in models]
        expected = base[key].numpy() + 0.5 * sum(_numpy_breadcrumbs(t, 0.5, 0.25) for t in taus)
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- consensus
def _numpy_masks(base, models, key, lam):
    taus = np.stack([m[key].numpy() - base[key].numpy() for m in models])
    total = taus.sum(0)
    return np.abs(taus) > lam * np.abs(total - taus), total


def test_consensus_with_k1_keeps_the_union_and_k_above_t_is_refused():
    base, models = perturbed_models(3, seed=3)
    union = get_method("consensus")(models, base, lam=1.0, mask_lam=0.4, min_tasks=1)
    for key in (MATRIX, "ln.weight", "proj"):
        masks, total = _numpy_masks(base, models, key, 0.4)
        np.testing.assert_allclose(union[key].numpy(), base[key].numpy() + total * masks.any(0), rtol=1e-5, atol=1e-6)
    assert int(union["counter"]) == 7
    # k above T would keep nothing but theta_0: refused, as `mima merge --min-tasks` is
    with pytest.raises(MimaError, match=r"min_tasks \(--min-tasks\) must be at most the 3 models given, got 4"):
        get_method("consensus")(models, base, lam=1.0, mask_lam=0.4, min_tasks=4)


# ----------------------------------------------------------------------------------- TSV
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
    for key in (MATRIX, "proj"):
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
    base = {MATRIX: torch.randn(9, 6, generator=g)}

    def task_vector(t: int) -> torch.Tensor:
        cols = [2 * t, 2 * t + 1]
        return left[:, cols] @ torch.diag(torch.tensor([3.0 + t, 1.0 + t])) @ right[:, cols].T

    models = [{MATRIX: base[MATRIX] + task_vector(t)} for t in range(3)]
    tsv = get_method("tsv")(models, base, lam=1.0)
    ta = get_method("task_arithmetic")(models, base, lam=1.0)
    torch.testing.assert_close(tsv[MATRIX], ta[MATRIX], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ per-task compressions
def test_cart_indexing_reconstructs_each_task_from_its_truncated_centered_vector():
    base, models = perturbed_models(3, seed=7)
    method = get_method("cart_indexing")
    index = method(models, rank_ratio=0.25)  # 12 x 8 matrix: rank max(1, floor(0.25 * 8)) = 2
    average = {k: torch.stack([m[k].double() for m in models]).mean(0) for k in (MATRIX, "ln.weight", "proj")}
    for t, model in enumerate(models):
        rebuilt = method.reconstruct(index, t)
        u, s, vh = np.linalg.svd((model[MATRIX].double() - average[MATRIX]).numpy(), full_matrices=False)
        expected = average[MATRIX].numpy() + (u[:, :2] * s[:2]) @ vh[:2]
        np.testing.assert_allclose(rebuilt[MATRIX].numpy(), expected, rtol=1e-4, atol=1e-5)
        for key in ("ln.weight", "proj"):  # not an attention/MLP weight: kept exactly
            torch.testing.assert_close(rebuilt[key], model[key], rtol=1e-6, atol=1e-6)
        assert int(rebuilt["counter"]) == 7


def test_tall_masks_reconstruct_theta0_plus_mask_times_the_sum():
    base, models = perturbed_models(3, seed=8)
    method = get_method("tall")
    index = method(models, base, mask_lam=[0.2, 0.4, 0.6])
    for t, lam in enumerate((0.2, 0.4, 0.6)):
        rebuilt = method.reconstruct(index, t)
        for key in (MATRIX, "ln.weight", "proj"):
            masks, total = _numpy_masks(base, models, key, lam)
            np.testing.assert_allclose(rebuilt[key].numpy(), base[key].numpy() + masks[t] * total, rtol=1e-5, atol=1e-6)
    mask = torch.rand(5, 7) > 0.5
    assert torch.equal(unpack(pack(mask), mask.shape), mask)


# ------------------------------------------------------------------------------- RegMean
def test_regmean_weight_is_the_least_squares_fit_of_all_models_outputs():
    g = torch.Generator().manual_seed(9)
    inputs = [torch.randn(40, 6, generator=g) for _ in range(3)]
    weights = [torch.randn(4, 6, generator=g) for _ in range(3)]
    grams = [x.T @ x for x in inputs]
    merged = regmean_weight(grams, weights, alpha=1.0)
    stacked_x = np.concatenate([x.numpy() for x in inputs])
    stacked_y = np.concatenate([(x @ w.T).numpy() for x, w in zip(inputs, weights)])
    solution, *_ = np.linalg.lstsq(stacked_x, stacked_y, rcond=None)
    np.testing.assert_allclose(merged.numpy(), solution.T, rtol=1e-4, atol=1e-4)
    # alpha = 0 keeps only the diagonals: a per-input-feature weighted average of the weights
    diagonal = regmean_weight(grams, weights, alpha=0.0)
    d = torch.stack([gram.diagonal() for gram in grams])
    expected = sum(w * dg for w, dg in zip(weights, d)) / d.sum(0)
    torch.testing.assert_close(diagonal, expected, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ streaming
def _numpy_cart(models, key, ratio=0.08, lam=1.0):
    stacked = np.stack([m[key].double().numpy() for m in models])
    average = stacked.mean(0)
    if key != MATRIX:  # only attention/MLP weights are low-rank; the rest is the average
        return average
    rank = max(1, int(np.floor(ratio * min(average.shape))))
    total = 0
    for t in stacked:
        u, s, vh = np.linalg.svd(t - average, full_matrices=False)
        total = total + (u[:, :rank] * s[:rank]) @ vh[:rank]
    return average + lam * total


def _numpy_defaults(name: str, base, models) -> dict[str, np.ndarray]:
    """Each streamable strategy at its documented defaults, written again with numpy."""
    keys = (MATRIX, "ln.weight", "proj")
    b = {key: base[key].double().numpy() for key in keys}
    taus = {key: np.stack([m[key].numpy() - base[key].numpy() for m in models]).astype(np.float64) for key in keys}
    if name == "uniform":
        return {key: np.mean([m[key].double().numpy() for m in models], axis=0) for key in keys}
    if name == "task_arithmetic":  # lam 0.4
        return {key: b[key] + 0.4 * taus[key].sum(0) for key in keys}
    if name == "ties":  # lam 1, k 20, global trim
        merged = numpy_ties(taus, k=20)
        return {key: b[key] + merged[key] for key in keys}
    if name == "dare_ties":  # drop 0.5, seed 0, then ties at lam 1, k 20
        merged = numpy_ties({key: _dropped(base, models, key, 0.5, 0) for key in keys}, k=20)
        return {key: b[key] + merged[key] for key in keys}
    if name == "cart":  # rank 8%, lam 1
        return {key: _numpy_cart(models, key) for key in keys}
    if name == "breadcrumbs":  # density 0.15, gamma 0.006, lam 0.2
        return {key: b[key] + 0.2 * sum(_numpy_breadcrumbs(t, 0.15, 0.006) for t in taus[key]) for key in keys}
    if name == "consensus":  # mask_lam 0.4, min_tasks 2, lam 0.4
        out = {}
        for key in keys:
            masks, total = _numpy_masks(base, models, key, 0.4)
            out[key] = b[key] + 0.4 * total * (masks.sum(0) >= 2)
        return out
    if name == "tsv":  # lam 1; every 2-D tensor gets TSV, others the mean task vector
        return {key: b[key] + (_numpy_tsv(list(taus[key])) if taus[key].ndim == 3 else taus[key].mean(0)) for key in keys}
    raise KeyError(name)


@pytest.mark.parametrize("name", ["uniform", "task_arithmetic", "ties", "cart", "dare_ties", "breadcrumbs", "consensus", "tsv"])
def test_streamed_file_merge_matches_the_formula(tmp_path, name):
    base, models = perturbed_models(3, seed=10)
    save_state_dict(tmp_path / "base.safetensors", base)
    paths = []
    for index, model in enumerate(models):
        paths.append(tmp_path / f"m{index}.safetensors")
        save_state_dict(paths[-1], model)
    with open_inputs(paths, tmp_path / "base.safetensors") as inputs:
        merge_to_file(get_method(name), inputs, tmp_path / "out.safetensors", {}, {"method": name})
    streamed = load_state_dict(tmp_path / "out.safetensors")
    assert set(streamed) == set(base)  # every key
    for key, expected in _numpy_defaults(name, base, models).items():
        assert streamed[key].dtype == base[key].dtype
        np.testing.assert_allclose(streamed[key].numpy(), expected, rtol=1e-5, atol=1e-5, err_msg=key)
    assert int(streamed["counter"]) == 7


def test_consensus_and_tall_check_the_number_of_mask_lambdas():
    base, models = perturbed_models(3, seed=13)
    for name in ("consensus", "tall"):
        with pytest.raises(MimaError, match="mask_lam: 2 values for 3 tasks"):
            get_method(name)(models, base, mask_lam=[0.2, 0.4])
