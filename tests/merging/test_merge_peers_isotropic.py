"""Iso-C, Iso-CTS, WUDI, MagMax and Model Stock, each against a hand-worked example or the reference
code's steps written again here (numpy, or torch autograd for WUDI), and through `mima merge`."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
import yaml

from mima.cli import main
from mima.core.errors import MimaError
from mima.core.safetensors_io import load_state_dict, save_state_dict
from mima.merging import HYPERPARAMETERS, get_method
from mima.merging.iso_cts import subspace_sizes
from tests.helpers import perturbed_models

MATRIX = "transformer.resblocks.0.mlp.c_fc.weight"
WIDE = "transformer.resblocks.0.mlp.c_proj.weight"
BIAS = "transformer.resblocks.0.mlp.c_fc.bias"
CONV = "conv1.weight"
SHAPES = ((MATRIX, (12, 8)), (WIDE, (5, 9)), (BIAS, (12,)), (CONV, (2, 3, 2, 2)))
NEW_METHODS = ("iso_c", "iso_cts", "wudi", "magmax", "model_stock")


def _models(count: int, seed: int = 0, shapes=SHAPES):
    """theta_0 (with an integer tensor) and `count` perturbed copies (the strategies' own fixture)."""
    return perturbed_models(count, seed, shapes)


def _taus(base, models, key) -> list[np.ndarray]:
    return [m[key].double().numpy() - base[key].double().numpy() for m in models]


def _polar(matrix: np.ndarray) -> np.ndarray:
    u, _, vt = np.linalg.svd(matrix, full_matrices=False)
    return u @ vt


# ---------------------------------------------------------------------------------- Iso-C
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
    base, models = _models(3, seed=1)
    merged = get_method("iso_c")(models, base, lam=0.8)
    for key in (MATRIX, WIDE):
        expected = base[key].numpy() + 0.8 * _numpy_iso_c(_taus(base, models, key))
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-5, atol=1e-5)
        spectrum = np.linalg.svd(merged[key].double().numpy() - base[key].double().numpy(), compute_uv=False)
        np.testing.assert_allclose(spectrum, spectrum[0], rtol=1e-4)  # isotropic
    for key in (BIAS, CONV):  # not matrices: the mean task vector
        np.testing.assert_allclose(merged[key].numpy(), base[key].numpy() + 0.8 * np.mean(_taus(base, models, key), axis=0),
                                   rtol=1e-5, atol=1e-6)
    assert int(merged["counter"]) == 7
    # matrix_keys narrows the matrices: the wide one is then averaged
    narrowed = get_method("iso_c")(models, base, lam=0.8, matrix_keys="c_fc")
    torch.testing.assert_close(narrowed[MATRIX], merged[MATRIX])
    np.testing.assert_allclose(narrowed[WIDE].numpy(), base[WIDE].numpy() + 0.8 * np.mean(_taus(base, models, WIDE), axis=0),
                               rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------- Iso-CTS
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
    base, models = _models(3, seed=2)
    merged = get_method("iso_cts")(models, base, lam=1.3, common_space_fraction=fraction)
    for key in (MATRIX, WIDE):
        expected = base[key].numpy() + 1.3 * _numpy_iso_cts(_taus(base, models, key), fraction)
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(merged[BIAS].numpy(), base[BIAS].numpy() + 1.3 * np.mean(_taus(base, models, BIAS), axis=0),
                               rtol=1e-5, atol=1e-6)
    assert int(merged["counter"]) == 7


def test_iso_cts_with_no_task_directions_is_iso_c():
    base, models = _models(3, seed=3)
    cts = get_method("iso_cts")(models, base, lam=1.0, common_space_fraction=1.0)
    iso = get_method("iso_c")(models, base, lam=1.0)
    for key in (MATRIX, WIDE, BIAS):
        torch.testing.assert_close(cts[key], iso[key], rtol=1e-4, atol=1e-4)


def test_iso_cts_with_more_tasks_than_the_rank_allows_still_merges():
    # rank 5, T = 8, fraction 0: the reference's round(5 / 8) = 1 direction per task needs 8 > 5.
    base, models = _models(8, seed=4, shapes=((WIDE, (5, 9)),))
    merged = get_method("iso_cts")(models, base, lam=1.0, common_space_fraction=0.0)
    expected = base[WIDE].numpy() + _numpy_iso_c(_taus(base, models, WIDE))  # 0 per task: all common, as Iso-C
    np.testing.assert_allclose(merged[WIDE].numpy(), expected, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------- WUDI
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
    base, models = _models(3, seed=5)
    merged = get_method("wudi")(models, base, steps=steps, lr=lr)
    for key in (MATRIX, WIDE):
        taus = [m[key] - base[key] for m in models]
        expected = base[key] + _reference_wudi(taus, steps, lr)
        torch.testing.assert_close(merged[key], expected, rtol=1e-5, atol=1e-5)
        moved = merged[key] - base[key] - sum(taus)
        assert float(moved.abs().max()) > 0.5 * min(steps * lr, 1e-2)  # Adam moved away from the sum
        numpy_taus = [t.double().numpy() for t in taus]
        assert _wudi_loss((merged[key] - base[key]).double().numpy(), numpy_taus) < _wudi_loss(sum(numpy_taus), numpy_taus)
    for key in (BIAS, CONV):
        np.testing.assert_allclose(merged[key].numpy(), base[key].numpy() + np.mean(_taus(base, models, key), axis=0),
                                   rtol=1e-5, atol=1e-6)
    assert int(merged["counter"]) == 7


def test_wudi_skips_a_task_that_did_not_change_a_matrix():
    base, models = _models(2, seed=6)
    unchanged = {k: v.clone() for k, v in base.items()}  # tau = 0: the reference would divide 0 by 0
    with_idle = get_method("wudi")([*models, unchanged], base, steps=20, lr=1e-3)
    without = get_method("wudi")(models, base, steps=20, lr=1e-3)
    for key in (MATRIX, WIDE):
        assert bool(torch.isfinite(with_idle[key]).all())
        torch.testing.assert_close(with_idle[key], without[key])


# --------------------------------------------------------------------------------- MagMax
def test_magmax_hand_worked_with_ties_going_to_the_later_task():
    base = {"w": torch.tensor([10.0, 10.0, 10.0, 10.0]), "n": torch.tensor(3)}
    taus = [torch.tensor([1.0, -3.0, 2.0, 0.1]), torch.tensor([-2.0, 3.0, 0.5, 0.2]), torch.tensor([0.5, 1.0, -2.0, -0.3])]
    models = [{"w": base["w"] + t, "n": torch.tensor(3)} for t in taus]
    # largest magnitudes: -2 (task 2); 3 (task 2 ties task 1's -3 and is later); -2 (task 3 ties task 1's 2); -0.3
    merged = get_method("magmax")(models, base, lam=0.5)
    torch.testing.assert_close(merged["w"], base["w"] + 0.5 * torch.tensor([-2.0, 3.0, -2.0, -0.3]))
    assert int(merged["n"]) == 3


def test_magmax_matches_a_numpy_argmax_on_every_tensor():
    base, models = _models(4, seed=7)
    merged = get_method("magmax")(models, base)  # default lam 0.5
    for key in (MATRIX, WIDE, BIAS, CONV):
        taus = np.stack(_taus(base, models, key))
        last_max = len(taus) - 1 - np.argmax(np.abs(taus)[::-1], axis=0)  # the last task among equal magnitudes
        chosen = np.take_along_axis(taus, last_max[None], axis=0)[0]
        np.testing.assert_allclose(merged[key].numpy(), base[key].numpy() + 0.5 * chosen, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- Model Stock
def test_model_stock_hand_worked():
    base = {"a": torch.zeros(2), "still": torch.ones(3), "n": torch.tensor(1)}
    # two models at 45 degrees: t = 2 cos / (cos + 1) = 2 / (1 + sqrt 2) = 2 (sqrt 2 - 1)
    two = [{"a": torch.tensor([1.0, 0.0]), "still": torch.ones(3), "n": torch.tensor(1)},
           {"a": torch.tensor([1.0, 1.0]), "still": torch.ones(3), "n": torch.tensor(1)}]
    merged = get_method("model_stock")(two, base)
    t = 2 * (math.sqrt(2) - 1)
    torch.testing.assert_close(merged["a"], t * torch.tensor([1.0, 0.5]))  # t * mean + (1 - t) * 0
    torch.testing.assert_close(merged["still"], torch.ones(3))  # no task changed it: cos 0, t 0
    assert int(merged["n"]) == 1
    # three models at 90, 45, 45 degrees: mean angle 60, cos 1/2, t = 3 (1/2) / (2 (1/2) + 1) = 3/4
    three = [*two, {"a": torch.tensor([0.0, 1.0]), "still": torch.ones(3), "n": torch.tensor(1)}]
    merged = get_method("model_stock")(three, base)
    torch.testing.assert_close(merged["a"], 0.75 * torch.tensor([2.0, 2.0]) / 3)


def _numpy_model_stock(base_value: np.ndarray, values: list[np.ndarray]) -> np.ndarray:
    """FusionBench's ModelStock for one tensor: mean pairwise angle in degrees, ratio, interpolation."""
    eps = 1e-8
    angles = []
    for a, b in itertools.combinations(values, 2):
        v1, v2 = (a - base_value).ravel(), (b - base_value).ravel()
        cosine = np.clip(np.sum(v1 * v2) / (math.sqrt(np.sum(v1 ** 2) * np.sum(v2 ** 2)) + eps), -1.0, 1.0)
        angles.append(np.rad2deg(np.arccos(cosine)))
    k = len(values)
    angle = np.deg2rad(np.mean(angles))
    ratio = k * np.cos(angle) / ((k - 1) * np.cos(angle) + 1 + eps)
    return np.mean(values, axis=0) * ratio + base_value * (1.0 - ratio)


@pytest.mark.parametrize("count", [2, 4])
def test_model_stock_matches_the_reference_steps(count):
    base, models = _models(count, seed=8)
    g = torch.Generator().manual_seed(9)
    shared = {k: torch.randn(v.shape, generator=g) for k, v in base.items() if v.is_floating_point()}
    # a shared direction makes the angles (and so the per-tensor ratios) differ from 90 degrees
    models = [{k: v + shared[k] if k in shared else v for k, v in m.items()} for m in models]
    merged = get_method("model_stock")(models, base)
    for key in (MATRIX, WIDE, BIAS, CONV):
        expected = _numpy_model_stock(base[key].double().numpy(), [m[key].double().numpy() for m in models])
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-5, atol=1e-5)
    assert int(merged["counter"]) == 7


def test_model_stock_needs_two_models():
    base, models = _models(1, seed=10)
    with pytest.raises(MimaError, match="at least 2"):
        get_method("model_stock")(models, base)


# ---------------------------------------------------------------------- hyperparameters
@pytest.mark.parametrize("method, given, fragment", [
    ("iso_cts", {"common_space_fraction": 1.5}, "common_space_fraction must be a fraction of the rank, in [0, 1], got 1.5"),
    ("iso_c", {"lam": float("nan")}, "lam must be a finite number"),
    ("wudi", {"steps": 0}, "steps must be a positive whole number"),
    ("wudi", {"lr": -1e-5}, "lr must be a positive number"),
    ("wudi", {"lam": 1.0}, "takes no hyperparameter 'lam'"),
    ("magmax", {"lam": "big"}, "lam must be a finite number"),
    ("model_stock", {"lam": 0.5}, "takes no hyperparameter 'lam'"),
])
def test_bad_hyperparameters_are_one_line_errors(method, given, fragment):
    base, models = _models(2, seed=11)
    with pytest.raises(MimaError) as error:
        get_method(method)(models, base, **given)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_defaults_and_grids_follow_the_references():
    assert get_method("iso_c").defaults["lam"] == 1.0 and get_method("iso_cts").defaults["lam"] == 1.0
    assert get_method("iso_cts").defaults["common_space_fraction"] == 0.8
    assert get_method("iso_c").grid["lam"] == tuple(np.round(np.linspace(0, 3, 31)[1:], 1))
    assert get_method("magmax").defaults["lam"] == 0.5
    assert get_method("magmax").grid["lam"] == tuple(np.round(np.linspace(0, 1, 21)[1:], 2))
    assert get_method("wudi").defaults["steps"] == 300 and get_method("wudi").defaults["lr"] == 1e-5
    assert not get_method("wudi").grid and not get_method("model_stock").grid


# -------------------------------------------------------------------------- mima merge
def _write_inputs(tmp_path, count: int = 3, seed: int = 12):
    base, models = _models(count, seed=seed)
    save_state_dict(tmp_path / "base.safetensors", base)
    paths = []
    for index, model in enumerate(models):
        save_state_dict(tmp_path / f"task{index}.safetensors", model)
        paths.append(str(tmp_path / f"task{index}.safetensors"))
    return base, models, paths


@pytest.mark.parametrize("method, flags, hparams", [
    ("iso_c", ["--lam", "0.7", "--matrix-keys", "c_fc"], {"lam": 0.7, "matrix_keys": "c_fc"}),
    ("iso_cts", ["--common-space-fraction", "0.5", "--lam", "1.2"], {"common_space_fraction": 0.5, "lam": 1.2}),
    ("wudi", ["--steps", "5", "--lr", "0.01"], {"steps": 5, "lr": 0.01}),
    ("magmax", ["--lam", "0.3"], {"lam": 0.3}),
    ("model_stock", [], {}),
])
def test_mima_merge_from_safetensors_files(method, flags, hparams, tmp_path, capsys):
    base, models, paths = _write_inputs(tmp_path)
    out = tmp_path / f"{method}.safetensors"
    argv = ["merge", "--method", method, "--base", str(tmp_path / "base.safetensors"), "--models", *paths, "--output", str(out), *flags]
    assert main(argv) == 0
    written = load_state_dict(out)
    assert sorted(written) == sorted(base) and int(written["counter"]) == 7
    for key, value in _reference_merge(method, hparams, base, models).items():
        np.testing.assert_allclose(written[key].double().numpy(), value, rtol=1e-4, atol=1e-4, err_msg=key)
    assert f"mima merge: {method}" in capsys.readouterr().out


def _reference_merge(method: str, hparams: dict, base, models) -> dict[str, np.ndarray]:
    """Each floating tensor as the reference steps above compute it (not the strategies' code): the
    2-D tensors that --matrix-keys selects (default: all) get the method's matrix rule, the others the
    mean task vector; MagMax and Model Stock treat every tensor alike."""
    selected = hparams.get("matrix_keys", "")
    expected = {}
    for key in (MATRIX, WIDE, BIAS, CONV):
        theta_0, taus = base[key].double().numpy(), _taus(base, models, key)
        matrix = base[key].ndim == 2 and selected in key
        if method == "iso_c":
            expected[key] = theta_0 + hparams["lam"] * (_numpy_iso_c(taus) if matrix else np.mean(taus, axis=0))
        elif method == "iso_cts":
            rule = _numpy_iso_cts(taus, hparams["common_space_fraction"]) if matrix else np.mean(taus, axis=0)
            expected[key] = theta_0 + hparams["lam"] * rule
        elif method == "wudi":
            torch_taus = [m[key] - base[key] for m in models]
            rule = _reference_wudi(torch_taus, hparams["steps"], hparams["lr"]).double().numpy() if matrix else np.mean(taus, axis=0)
            expected[key] = theta_0 + rule
        elif method == "magmax":
            stacked = np.stack(taus)
            last_max = len(taus) - 1 - np.argmax(np.abs(stacked)[::-1], axis=0)
            expected[key] = theta_0 + hparams["lam"] * np.take_along_axis(stacked, last_max[None], axis=0)[0]
        else:
            expected[key] = _numpy_model_stock(theta_0, [m[key].double().numpy() for m in models])
    return expected


def test_help_lists_the_new_methods_flags(capsys):
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    text = capsys.readouterr().out
    for name in NEW_METHODS:
        assert name in text
        for hyperparameter in get_method(name).defaults:
            assert HYPERPARAMETERS[hyperparameter].flag in text
    assert "Iso-CTS: share of each matrix's rank given to the common subspace" in " ".join(text.split())


@pytest.mark.parametrize("argv, fragment", [
    (["--method", "iso_cts", "--common-space-fraction", "1.5"], "--common-space-fraction must be a fraction of the rank, in [0, 1]"),
    (["--method", "wudi", "--steps", "0"], "--steps must be a positive whole number"),
    (["--method", "magmax", "--lam", "nan"], "--lam must be a finite number"),
    (["--method", "model_stock", "--lam", "0.5"], "--lam does not apply to merge method 'model_stock'"),
    (["--method", "wudi", "--lam", "0.5"], "--lam does not apply to merge method 'wudi'"),
])
def test_bad_flags_are_one_line(argv, fragment, tmp_path, capsys):
    code = main(["merge", *argv, "--models", str(tmp_path / "a.safetensors"), "--output", str(tmp_path / "out.safetensors")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "out.safetensors").exists()


def test_select_on_val_searches_the_grid(tmp_path, small_clip, capsys):
    """`--select-on val` on a small CLIP: every grid point is scored, the best lam is written."""
    from mima.pools import task_pool

    config = {"model": {"clip": small_clip, "pretrained": None}, "data": {"suite": "digits", "tasks": ["rot90", "mirror"]}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    base = {k: v.detach().clone() for k, v in task_pool(config).encoder.state_dict().items()}
    models = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        models.append({k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in base.items()})
    save_state_dict(tmp_path / "base.safetensors", base)
    paths = []
    for index, model in enumerate(models):
        save_state_dict(tmp_path / f"t{index}.safetensors", model)
        paths.append(str(tmp_path / f"t{index}.safetensors"))
    out = tmp_path / "magmax.safetensors"
    assert main(["merge", "--method", "magmax", "--base", str(tmp_path / "base.safetensors"), "--models", *paths,
                 "--config", str(tmp_path / "config.yaml"), "--output", str(out), "--select-on", "val"]) == 0
    report = json.loads((tmp_path / "magmax.safetensors.results.json").read_text())
    trials = report["trials"]
    assert [t["lam"] for t in trials] == list(get_method("magmax").grid["lam"])
    best = max(trials, key=lambda t: t["score"])  # the first of equal scores, as the selection
    assert report["hparams"] == {"lam": best["lam"]} and report["validation_accuracy"] == best["score"]
    written = load_state_dict(out)
    for key, value in base.items():
        if not value.is_floating_point():
            continue
        taus = np.stack([m[key].numpy() - value.numpy() for m in models])
        last_max = len(taus) - 1 - np.argmax(np.abs(taus)[::-1], axis=0)
        chosen = np.take_along_axis(taus, last_max[None], axis=0)[0]
        np.testing.assert_allclose(written[key].numpy(), value.numpy() + best["lam"] * chosen, rtol=1e-5, atol=1e-6)
    capsys.readouterr()
