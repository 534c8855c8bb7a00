"""The strategies beyond the foundation four, each against an independent computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mima.merging import get_method
from mima.merging.breadcrumbs import breadcrumb_mask
from mima.merging.dare import dare
from mima.merging.engine import merge_to_file, open_inputs
from mima.merging.regmean import regmean_weight
from mima.merging.tall import pack, unpack
from mima.safetensors_io import load_state_dict, save_state_dict

MATRIX = "transformer.resblocks.0.mlp.c_fc.weight"


def _models(count: int, seed: int = 0, shapes=((MATRIX, (12, 8)), ("ln.weight", (8,)), ("proj", (8, 4)))):
    g = torch.Generator().manual_seed(seed)
    base = {key: torch.randn(shape, generator=g) for key, shape in shapes}
    base["counter"] = torch.tensor(7)
    models = [
        {k: (v + 0.5 * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v.clone() for k, v in base.items()}
        for _ in range(count)
    ]
    return base, models


# ---------------------------------------------------------------------------------- DARE
def test_dare_with_no_drop_is_task_arithmetic_and_ties():
    base, models = _models(3)
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


# --------------------------------------------------------------------------- breadcrumbs
def test_breadcrumb_mask_hand_worked():
    # width 5: gamma 0.2 removes int(1.0) = 1 largest (5), density 0.4 keeps the next int(2.0) = 2 (4 and -3)
    row = torch.tensor([[5.0, -1.0, -3.0, 0.5, 4.0], [0.1, 0.2, 0.3, 0.4, 0.5]])
    expected = torch.tensor([[False, False, True, False, True], [False, False, True, True, False]])
    assert torch.equal(breadcrumb_mask(row, density=0.4, gamma=0.2), expected)
    # ties in magnitude go to the earlier position; scalars are kept
    assert torch.equal(breadcrumb_mask(torch.tensor([2.0, -2.0, 2.0, 1.0]), 0.5, 0.0), torch.tensor([True, True, False, False]))
    assert bool(breadcrumb_mask(torch.tensor(3.0), 0.1, 0.5))


def test_breadcrumbs_merge_formula():
    base, models = _models(2, seed=2)
    merged = get_method("breadcrumbs")(models, base, lam=0.5, density=0.5, gamma=0.25)
    for key in (MATRIX, "ln.weight", "proj"):
        taus = [m[key] - base[key] for m in models]
        expected = base[key] + 0.5 * sum(t * breadcrumb_mask(t, 0.5, 0.25) for t in taus)
        torch.testing.assert_close(merged[key], expected)


# ----------------------------------------------------------------------------- consensus
def _numpy_masks(base, models, key, lam):
    taus = np.stack([m[key].numpy() - base[key].numpy() for m in models])
    total = taus.sum(0)
    return np.abs(taus) > lam * np.abs(total - taus), total


def test_consensus_with_k1_keeps_the_union_and_k_above_t_keeps_nothing():
    base, models = _models(3, seed=3)
    union = get_method("consensus")(models, base, lam=1.0, mask_lam=0.4, min_tasks=1)
    nothing = get_method("consensus")(models, base, lam=1.0, mask_lam=0.4, min_tasks=4)
    for key in (MATRIX, "ln.weight", "proj"):
        masks, total = _numpy_masks(base, models, key, 0.4)
        np.testing.assert_allclose(union[key].numpy(), base[key].numpy() + total * masks.any(0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(nothing[key], base[key])
    assert int(union["counter"]) == 7


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
    base, models = _models(3, seed=5)
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
    base, models = _models(3, seed=7)
    method = get_method("cart_indexing")
    index = method(models, rank_ratio=0.25)  # 12 x 8 matrix: rank max(1, floor(0.25 * 8)) = 2
    average = {k: torch.stack([m[k].double() for m in models]).mean(0) for k in (MATRIX, "ln.weight", "proj")}
    for t, model in enumerate(models):
        rebuilt = method.reconstruct_fn(index, t)
        u, s, vh = np.linalg.svd((model[MATRIX].double() - average[MATRIX]).numpy(), full_matrices=False)
        expected = average[MATRIX].numpy() + (u[:, :2] * s[:2]) @ vh[:2]
        np.testing.assert_allclose(rebuilt[MATRIX].numpy(), expected, rtol=1e-4, atol=1e-5)
        for key in ("ln.weight", "proj"):  # not an attention/MLP weight: kept exactly
            torch.testing.assert_close(rebuilt[key], model[key], rtol=1e-6, atol=1e-6)
        assert int(rebuilt["counter"]) == 7


def test_tall_masks_reconstruct_theta0_plus_mask_times_the_sum():
    base, models = _models(3, seed=8)
    method = get_method("tall")
    index = method(models, base, mask_lam=[0.2, 0.4, 0.6])
    for t, lam in enumerate((0.2, 0.4, 0.6)):
        rebuilt = method.reconstruct_fn(index, t)
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
@pytest.mark.parametrize("name", ["uniform", "task_arithmetic", "ties", "cart", "dare_ties", "breadcrumbs", "consensus", "tsv"])
def test_streamed_file_merge_equals_the_in_memory_merge(tmp_path, name):
    base, models = _models(3, seed=10)
    save_state_dict(tmp_path / "base.safetensors", base)
    paths = []
    for index, model in enumerate(models):
        paths.append(tmp_path / f"m{index}.safetensors")
        save_state_dict(paths[-1], model)
    method = get_method(name)
    with open_inputs(paths, tmp_path / "base.safetensors") as inputs:
        merge_to_file(method, inputs, tmp_path / "out.safetensors", {}, {"method": name})
    streamed = load_state_dict(tmp_path / "out.safetensors")
    in_memory = method(models, base)
    assert set(streamed) == set(in_memory)
    for key in in_memory:
        torch.testing.assert_close(streamed[key], in_memory[key], rtol=0, atol=0)
