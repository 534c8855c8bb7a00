"""The merges that trim, drop or mask task-vector entries and elect signs (TIES, DARE, Breadcrumbs,
DELLA, Consensus, TALL masks, EMR), each against a hand-worked example or the reference's rule written
again here with numpy, and through `mima merge`."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from mima.cli import main
from mima.core.errors import MimaError
from mima.core.safetensors_io import load_state_dict
from mima.merging import get_method
from mima.merging.breadcrumbs import breadcrumb_mask
from mima.merging.common import pack, unpack
from mima.merging.dare import dare
from mima.merging.della import keep_probabilities, magprune
from tests.helpers import assert_merge_flags_refused
from tests.helpers import (BLOCK_SHAPES, MLP_MATRIX, assert_streamed_merge_matches, block_models, block_task_vectors, merge_files,
                           numpy_ties, perturbed_models, save_models)


# -------------------------------------------------------------------------------------------- TIES
# Three task vectors over two tensors (10 entries in all), k = 40: kth = 10 - int(10 * 0.4) = 6, so
# every entry at least as large as the 6th smallest magnitude survives (5 entries without ties, as
# in the official code; more when magnitudes tie at the threshold).
TAU = [
    {"a": [[4, -1, 0.5], [2, -3, 1]], "b": [1, -2, 3, 5]},  # magnitudes ... 6th smallest = 2: keeps 4,2,-3,-2,3,5 (tie at 2)
    {"a": [[-5, 1, 1], [-1, 3, 0.2]], "b": [-1, 2, -3, 0.3]},  # 6th smallest = 1: keeps every |x| >= 1 (8 entries)
    {"a": [[1, 2, -2], [0, -1, 0.5]], "b": [2, 0, -1, 0]},  # 6th smallest = 1: keeps 1,2,-2,-1,2,-1
]


# Trimmed sums: a = [[0, 3, -1], [1, -1, 0]], b = [1, 0, -1, 5] -> elected signs with zeros at a[0,0],
# a[1,2], b[1]; the signs sum to +1 over the model, so the majority sign + fills the zeros.
# Disjoint means of the trimmed entries that agree with the elected sign:
#   a[0,0] +: (4 + 1) / 2 = 2.5   a[0,1] +: (1 + 2) / 2 = 1.5   a[0,2] -: -2    a[1,0] +: 2
#   a[1,1] -: (-3 - 1) / 2 = -2   a[1,2] +: nothing agrees -> 0  b = [2, 2, (-3 - 1) / 2, 5]
TIES_EXPECTED = {"a": [[2.5, 1.5, -2.0], [2.0, -2.0, 0.0]], "b": [2.0, 2.0, -2.0, 5.0]}


def _ties_inputs():
    base = {"a": torch.ones(2, 3), "b": torch.full((4,), -1.0)}
    models = [{k: base[k] + torch.tensor(v, dtype=torch.float32) for k, v in tau.items()} for tau in TAU]
    return base, models


@pytest.mark.parametrize("lam", [1.0, 0.5])
def test_ties_hand_worked_example(lam):
    base, models = _ties_inputs()
    merged = get_method("ties")(models, base, lam=lam, k=40)
    for key, expected in TIES_EXPECTED.items():
        torch.testing.assert_close(merged[key], base[key] + lam * torch.tensor(expected))


def test_ties_zero_majority_keeps_negative_entries_as_the_official_code():
    base = {"x": torch.zeros(2)}
    models = [{"x": torch.tensor([1.0, -1.0])}, {"x": torch.tensor([-1.0, 1.0])}]
    merged = get_method("ties")(models, base, lam=1.0, k=100)
    torch.testing.assert_close(merged["x"], torch.tensor([-1.0, -1.0]))


def test_ties_global_and_per_tensor_trim():
    # One task given twice (a merge needs 2 models; the disjoint mean of two equal tasks is that task), k = 50.
    # Global: n = 8, kth = 4, threshold 4 -> a survives whole, b keeps only 4.
    # Per tensor: n = 4, kth = 2 -> a keeps |x| >= 20, b keeps |x| >= 2. The task elects its own signs.
    base = {"a": torch.zeros(4), "b": torch.zeros(4)}
    model = {"a": torch.tensor([10.0, 20, 30, 40]), "b": torch.tensor([1.0, 2, 3, 4])}
    ties = get_method("ties")
    global_trim = ties([model, model], base, k=50)
    per_tensor = ties([model, model], base, k=50, trim="per-tensor")
    torch.testing.assert_close(global_trim["a"], torch.tensor([10.0, 20, 30, 40]))
    torch.testing.assert_close(global_trim["b"], torch.tensor([0.0, 0, 0, 4]))
    torch.testing.assert_close(per_tensor["a"], torch.tensor([0.0, 20, 30, 40]))
    torch.testing.assert_close(per_tensor["b"], torch.tensor([0.0, 2, 3, 4]))


# -------------------------------------------------------------------------------------------- DARE
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


def _dare_keep(seed: int, task: int, key: str, shape, drop: float) -> np.ndarray:
    """DARE's documented mask, written again: Bernoulli keep masks from torch.rand seeded by
    sha256('dare/<seed>/<task>/<key>') (first 8 bytes, little endian, 63 bits)."""
    digest = hashlib.sha256(f"dare/{seed}/{task}/{key}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return (torch.rand(tuple(shape), generator=generator) >= drop).numpy()


def _dropped(base, models, key, drop, seed) -> np.ndarray:
    """[T, ...] task vectors (float32 as the code subtracts) with DARE's drop and rescale applied."""
    taus = np.stack([m[key].numpy() - base[key].numpy() for m in models])
    keeps = np.stack([_dare_keep(seed, t, key, base[key].shape, drop) for t in range(len(models))])
    return taus.astype(np.float64) * keeps / (1 - drop)


@pytest.mark.parametrize("drop, seed", [(0.3, 4), (0.3, 5), (0.8, 0)])
def test_dare_task_arithmetic_with_drop_matches_an_independent_reimplementation(drop, seed):
    base, models = perturbed_models(3, seed=11)
    merged = get_method("dare_task_arithmetic")(models, base, lam=0.7, drop=drop, seed=seed)
    for key in (MLP_MATRIX, "ln.weight", "proj"):
        expected = base[key].numpy() + 0.7 * _dropped(base, models, key, drop, seed).sum(0)
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-5, atol=1e-5)
    assert int(merged["counter"]) == 7


def test_dare_ties_with_drop_is_numpy_ties_on_the_dropped_vectors():
    base, models = perturbed_models(3, seed=12)
    merged = get_method("dare_ties")(models, base, lam=1.3, drop=0.4, seed=2, k=30)
    keys = (MLP_MATRIX, "ln.weight", "proj")
    expected = numpy_ties({key: _dropped(base, models, key, 0.4, 2) for key in keys}, k=30)
    for key in keys:
        np.testing.assert_allclose(merged[key].numpy(), base[key].numpy() + 1.3 * expected[key], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------- Breadcrumbs
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
    for key in (MLP_MATRIX, "ln.weight", "proj"):  # widths 8, 8, 4: drop the top 2, 2, 1 and keep 4, 4, 2 per row
        taus = [m[key].numpy() - base[key].numpy() for m in models]
        expected = base[key].numpy() + 0.5 * sum(_numpy_breadcrumbs(t, 0.5, 0.25) for t in taus)
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------- DELLA
def test_della_keep_probabilities_by_hand():
    # magnitudes ranked 0.1 < 0.5 < 2 < 3 -> ranks 0, 1, 2, 3; p = 0.35 + 0.3 * rank / 3
    row = torch.tensor([[0.1, -3.0, 2.0, 0.5], [1.0, 1.0, -1.0, 0.0]])
    expected = torch.tensor([[0.35, 0.65, 0.55, 0.45], [0.45, 0.55, 0.65, 0.35]])  # equal magnitudes: earlier first
    torch.testing.assert_close(keep_probabilities(row, density=0.5, epsilon=0.15), expected)
    assert torch.equal(keep_probabilities(torch.tensor([[4.0]]), 0.3, 0.1), torch.tensor([[0.3]]))


def test_della_without_drop_is_the_disjoint_mean_with_zero_sums_elected_positive():
    # density 1 keeps every entry unscaled; sums (4, -1, 0): elected (+, -, +);
    # means (1 + 3) / 2, -2 / 1 and 1 / 1 (a zero sum elects +, unlike TIES's model-wide majority)
    base = {"w": torch.zeros(3)}
    models = [{"w": torch.tensor([1.0, -2.0, 1.0])}, {"w": torch.tensor([3.0, 1.0, -1.0])}]
    merged = get_method("della")(models, base, density=1.0, lam=0.5)
    torch.testing.assert_close(merged["w"], 0.5 * torch.tensor([2.0, -2.0, 1.0]))


def _della_draws(seed: int, task: int, key: str, shape) -> np.ndarray:
    """The documented draws: torch.rand(rows x width) seeded by sha256('della/<seed>/<task>/<key>')."""
    digest = hashlib.sha256(f"della/{seed}/{task}/{key}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.rand(shape, generator=generator).numpy()


def _numpy_magprune(tau: np.ndarray, density: float, epsilon: float, seed: int, task: int, key: str) -> np.ndarray:
    """mergekit's della_magprune with 1 / p rescaling (the paper's), ranks within rows of the first dimension."""
    rows = tau.reshape(tau.shape[0], -1) if tau.ndim >= 2 else tau.reshape(1, -1)
    width = rows.shape[1]
    if width == 1:
        probs = np.full(rows.shape, density)
    else:
        ranks = np.empty(rows.shape)
        for r, row in enumerate(rows):
            ranks[r, np.argsort(np.abs(row), kind="stable")] = np.arange(width)
        probs = (density - epsilon) + 2 * epsilon * ranks / (width - 1)
    kept = _della_draws(seed, task, key, rows.shape) < probs
    return (rows * kept / probs).reshape(tau.shape)


def _numpy_della(base, models, density, epsilon, seed, lam) -> dict[str, np.ndarray]:
    out = {}
    for key, tau in block_task_vectors(base, models).items():
        pruned = np.stack([_numpy_magprune(t, density, epsilon, seed, i, key) for i, t in enumerate(tau)])
        elected = np.where(pruned.sum(0) >= 0, 1.0, -1.0)
        agree = np.sign(pruned) == elected
        merged = (pruned * agree).sum(0) / np.maximum(agree.sum(0), 1)
        out[key] = base[key].numpy() + lam * merged
    return out


@pytest.mark.parametrize("density, epsilon, seed", [(0.5, 0.15, 0), (0.3, 0.2, 4)])
def test_della_matches_a_numpy_reimplementation(density, epsilon, seed):
    base, models = block_models(3, seed=5)
    merged = get_method("della")(models, base, lam=1.3, density=density, epsilon=epsilon, seed=seed)
    for key, expected in _numpy_della(base, models, density, epsilon, seed, 1.3).items():
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-5, atol=1e-5, err_msg=key)
    assert int(merged["counter"]) == 7
    other = get_method("della")(models, base, lam=1.3, density=density, epsilon=epsilon, seed=seed + 1)
    assert not torch.equal(other["proj"], merged["proj"])  # the seed is used


def test_magprune_is_unbiased_and_keeps_density_on_average():
    tau = torch.randn(4, 50, generator=torch.Generator().manual_seed(6))
    draws = torch.stack([magprune(tau, 0.4, 0.2, seed, 0, "w") for seed in range(2000)])
    torch.testing.assert_close(draws.mean(0), tau, rtol=0, atol=0.25)  # E[kept / p] = tau entry by entry
    kept = (draws != 0).float().mean(0)
    assert abs(float(kept.mean()) - 0.4) < 0.01
    order = tau.abs().argsort(dim=1)
    assert float(kept.gather(1, order[:, -5:]).mean()) > float(kept.gather(1, order[:, :5]).mean()) + 0.2


def test_della_refuses_a_window_outside_zero_one():
    base, models = block_models(2, seed=7)
    with pytest.raises(MimaError, match=r"density - epsilon and density \+ epsilon must lie in \(0, 1\), got density=0.9, epsilon=0.15"):
        get_method("della")(models, base, density=0.9)


# ------------------------------------------------------------------------ Consensus and TALL masks
def _numpy_masks(base, models, key, lam):
    taus = np.stack([m[key].numpy() - base[key].numpy() for m in models])
    total = taus.sum(0)
    return np.abs(taus) > lam * np.abs(total - taus), total


def test_consensus_with_k1_keeps_the_union_and_k_above_t_is_refused():
    base, models = perturbed_models(3, seed=3)
    union = get_method("consensus")(models, base, lam=1.0, mask_lam=0.4, min_tasks=1)
    for key in (MLP_MATRIX, "ln.weight", "proj"):
        masks, total = _numpy_masks(base, models, key, 0.4)
        np.testing.assert_allclose(union[key].numpy(), base[key].numpy() + total * masks.any(0), rtol=1e-5, atol=1e-6)
    assert int(union["counter"]) == 7
    # k above T would keep nothing but theta_0: refused, as `mima merge --min-tasks` is
    with pytest.raises(MimaError, match=r"min_tasks \(--min-tasks\) must be at most the 3 models given, got 4"):
        get_method("consensus")(models, base, lam=1.0, mask_lam=0.4, min_tasks=4)


def test_tall_masks_reconstruct_theta0_plus_mask_times_the_sum():
    base, models = perturbed_models(3, seed=8)
    method = get_method("tall")
    index = method(models, base, mask_lam=[0.2, 0.4, 0.6])
    for t, lam in enumerate((0.2, 0.4, 0.6)):
        rebuilt = method.reconstruct(index, t)
        for key in (MLP_MATRIX, "ln.weight", "proj"):
            masks, total = _numpy_masks(base, models, key, lam)
            np.testing.assert_allclose(rebuilt[key].numpy(), base[key].numpy() + masks[t] * total, rtol=1e-5, atol=1e-6)
    mask = torch.rand(5, 7) > 0.5
    assert torch.equal(unpack(pack(mask), mask.shape), mask)


# --------------------------------------------------------------------------------------------- EMR
def test_emr_by_hand():
    # Sums (2, -2, -0.5, 0, 0): gamma (+, -, -, -, -), a zero sum counting as -. Masks: t1 (1, 1, 0, 0, 0),
    # t2 (0, 1, 0, 0, 1), t3 (1, 0, 1, 0, 0); tau_uni = (2, -3, -2, 0, -1). Rescalers (one tensor, so the
    # means of 5 entries): t1 0.9 / 1.0, t2 1.2 / 0.8 = 1.5, t3 1.0 / 0.8 = 1.25; the fourth task has a
    # zero task vector and gets theta_0 back (rescaler 0).
    base = {"w": torch.ones(5)}
    deltas = [[2.0, -1.0, 0.5, 0.0, 1.0], [-1.0, -3.0, 1.0, 0.0, -1.0], [1.0, 2.0, -2.0, 0.0, 0.0], [0.0] * 5]
    models = [{"w": base["w"] + torch.tensor(d)} for d in deltas]
    method = get_method("emr")
    index = method(models, base)
    expected = [[2.8, -1.7, 1, 1, 1], [1, -3.5, 1, 1, -0.5], [3.5, 1, -1.5, 1, 1], [1, 1, 1, 1, 1]]
    for task, row in enumerate(expected):
        torch.testing.assert_close(method.reconstruct(index, task)["w"], torch.tensor(row, dtype=torch.float32))
    assert [float(index[f"task{t}/rescaler"]) for t in range(4)] == pytest.approx([0.9, 1.5, 1.25, 0.0])


def _numpy_emr(taus: dict[str, np.ndarray]):
    """FusionBench's emr_merge written again: flag = sign of the sum (0 -> -1), masks agree with it,
    unified = flag * largest agreeing magnitude, rescaler = sum of per-tensor mean|tau_t| over sum of
    per-tensor mean|mask_t * unified|."""
    tasks = len(next(iter(taus.values())))
    unified, masks = {}, {}
    scales, new_scales = np.zeros(tasks), np.zeros(tasks)
    for key, tau in taus.items():
        flag = np.where(tau.sum(0) > 0, 1.0, -1.0)
        masks[key] = tau * flag > 0
        unified[key] = np.max(np.abs(tau) * masks[key], axis=0) * flag
        scales += np.abs(tau).reshape(tasks, -1).mean(1)
    for key in taus:
        new_scales += np.abs(unified[key] * masks[key]).reshape(tasks, -1).mean(1)
    return unified, masks, scales / new_scales


def _check_emr(index, base, models):
    unified, masks, rescalers = _numpy_emr(block_task_vectors(base, models))
    method = get_method("emr")
    for task in range(len(models)):
        rebuilt = method.reconstruct(index, task)
        for key in BLOCK_SHAPES:
            expected = base[key].numpy() + unified[key] * masks[key][task] * rescalers[task]
            np.testing.assert_allclose(rebuilt[key].numpy(), expected, rtol=1e-5, atol=1e-6, err_msg=key)
        assert int(rebuilt["counter"]) == 7
    return rescalers


def test_emr_matches_fusionbench_rule_over_tensors_of_different_sizes():
    base, models = block_models(3, seed=3)
    rescalers = _check_emr(get_method("emr")(models, base), base, models)
    assert not np.allclose(rescalers, 1.0)


# --------------------------------------------------------------------------------- hyperparameters
def test_consensus_and_tall_check_the_number_of_mask_lambdas():
    base, models = perturbed_models(3, seed=13)
    for name in ("consensus", "tall"):
        with pytest.raises(MimaError, match="mask_lam: 2 values for 3 tasks"):
            get_method(name)(models, base, mask_lam=[0.2, 0.4])


@pytest.mark.parametrize("flags, fragment", [
    (["--method", "della", "--epsilon", "0.5"], "--epsilon must be a number in [0, 0.5), got 0.5"),
    (["--method", "della", "--density", "0.9"], "density - epsilon and density + epsilon must lie in (0, 1)"),
    (["--method", "emr", "--lam", "1"], "--lam does not apply to merge method 'emr'"),
])
def test_bad_flags_are_one_line(tmp_path, capsys, flags, fragment):
    assert_merge_flags_refused(tmp_path, capsys, flags, fragment)


# -------------------------------------------------------------------------------------- mima merge
def _numpy_defaults(name: str, base, models) -> dict[str, np.ndarray]:
    """Each strategy at its documented defaults, written again with numpy."""
    keys = (MLP_MATRIX, "ln.weight", "proj")
    b = {key: base[key].double().numpy() for key in keys}
    taus = {key: np.stack([m[key].numpy() - base[key].numpy() for m in models]).astype(np.float64) for key in keys}
    if name == "ties":  # lam 1, k 20, global trim
        merged = numpy_ties(taus, k=20)
        return {key: b[key] + merged[key] for key in keys}
    if name == "dare_ties":  # drop 0.5, seed 0, then ties at lam 1, k 20
        merged = numpy_ties({key: _dropped(base, models, key, 0.5, 0) for key in keys}, k=20)
        return {key: b[key] + merged[key] for key in keys}
    if name == "breadcrumbs":  # density 0.15, gamma 0.006, lam 0.2
        return {key: b[key] + 0.2 * sum(_numpy_breadcrumbs(t, 0.15, 0.006) for t in taus[key]) for key in keys}
    if name == "consensus":  # mask_lam 0.4, min_tasks 2, lam 0.4
        out = {}
        for key in keys:
            masks, total = _numpy_masks(base, models, key, 0.4)
            out[key] = b[key] + 0.4 * total * (masks.sum(0) >= 2)
        return out
    raise KeyError(name)


@pytest.mark.parametrize("name", ["ties", "dare_ties", "breadcrumbs", "consensus"])
def test_streamed_file_merge_matches_the_formula(tmp_path, name):
    assert_streamed_merge_matches(tmp_path, name, lambda base, models: _numpy_defaults(name, base, models))


def test_merge_command_writes_della_and_emr_from_files(tmp_path, capsys):
    base, models = block_models(3, seed=9)
    base_path, paths = save_models(tmp_path, base, models)
    assert merge_files("della", base_path, paths, tmp_path / "della.safetensors", "--density", "0.6", "--epsilon", "0.1",
                       "--seed", "3", "--lam", "0.9") == 0
    written = load_state_dict(tmp_path / "della.safetensors")
    for key, expected in _numpy_della(base, models, 0.6, 0.1, 3, 0.9).items():
        np.testing.assert_allclose(written[key].numpy(), expected, rtol=1e-5, atol=1e-5, err_msg=key)
    assert int(written["counter"]) == 7

    assert merge_files("emr", base_path, paths, tmp_path / "emr.safetensors") == 0
    _check_emr(load_state_dict(tmp_path / "emr.safetensors"), base, models)
