"""The models' average, task arithmetic, and the data-free merges that pick or scale its task vectors
per entry, tensor or residual block (MagMax, Model Stock, LiNeS), each against numpy, a hand-worked
example or the reference's rule written again here, and through `mima merge`."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from mima.core.errors import MimaError
from mima.core.safetensors_io import load_state_dict
from mima.merging import get_method
from tests.helpers import assert_merge_flags_refused
from tests.helpers import (BLOCK_SHAPES, CONV_KERNEL, MLP_BIAS, MLP_MATRIX, WIDE_MATRIX, assert_streamed_merge_matches,
                           block_models, block_task_vectors, clip_like_models, matrix_models, merge_files, merged_from_files,
                           numpy_ties, save_models, task_vectors)


# --------------------------------------------------------------------- uniform and task arithmetic
def test_uniform_is_the_mean():
    _, models = clip_like_models(3)
    merged = get_method("uniform")(models)
    for key in models[0]:
        if models[0][key].is_floating_point():
            np.testing.assert_allclose(merged[key], np.mean([m[key].numpy() for m in models], axis=0), rtol=1e-6, atol=1e-6)
    assert int(merged["counter"]) == 3


@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
def test_task_arithmetic_formula(lam):
    base, models = clip_like_models(4, seed=1)
    merged = get_method("task_arithmetic")(models, base, lam=lam)
    for key, value in base.items():
        if not value.is_floating_point():
            continue
        expected = value.numpy() + lam * sum(m[key].numpy() - value.numpy() for m in models)
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-5, atol=1e-5)


def test_task_arithmetic_with_one_over_t_is_the_uniform_average():
    base, models = clip_like_models(4, seed=2)
    merged = get_method("task_arithmetic")(models, base, lam=0.25)
    uniform = get_method("uniform")(models)
    for key in uniform:
        torch.testing.assert_close(merged[key], uniform[key], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ MagMax
def test_magmax_hand_worked_with_ties_going_to_the_later_task():
    base = {"w": torch.tensor([10.0, 10.0, 10.0, 10.0]), "n": torch.tensor(3)}
    taus = [torch.tensor([1.0, -3.0, 2.0, 0.1]), torch.tensor([-2.0, 3.0, 0.5, 0.2]), torch.tensor([0.5, 1.0, -2.0, -0.3])]
    models = [{"w": base["w"] + t, "n": torch.tensor(3)} for t in taus]
    # largest magnitudes: -2 (task 2); 3 (task 2 ties task 1's -3 and is later); -2 (task 3 ties task 1's 2); -0.3
    merged = get_method("magmax")(models, base, lam=0.5)
    torch.testing.assert_close(merged["w"], base["w"] + 0.5 * torch.tensor([-2.0, 3.0, -2.0, -0.3]))
    assert int(merged["n"]) == 3


def test_magmax_matches_a_numpy_argmax_on_every_tensor():
    base, models = matrix_models(4, seed=7)
    merged = get_method("magmax")(models, base)  # default lam 0.5
    for key in (MLP_MATRIX, WIDE_MATRIX, MLP_BIAS, CONV_KERNEL):
        taus = np.stack(task_vectors(base, models, key))
        last_max = len(taus) - 1 - np.argmax(np.abs(taus)[::-1], axis=0)  # the last task among equal magnitudes
        chosen = np.take_along_axis(taus, last_max[None], axis=0)[0]
        np.testing.assert_allclose(merged[key].numpy(), base[key].numpy() + 0.5 * chosen, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------- Model Stock
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
    base, models = matrix_models(count, seed=8)
    g = torch.Generator().manual_seed(9)
    shared = {k: torch.randn(v.shape, generator=g) for k, v in base.items() if v.is_floating_point()}
    # a shared direction makes the angles (and so the per-tensor ratios) differ from 90 degrees
    models = [{k: v + shared[k] if k in shared else v for k, v in m.items()} for m in models]
    merged = get_method("model_stock")(models, base)
    for key in (MLP_MATRIX, WIDE_MATRIX, MLP_BIAS, CONV_KERNEL):
        expected = _numpy_model_stock(base[key].double().numpy(), [m[key].double().numpy() for m in models])
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-5, atol=1e-5)
    assert int(merged["counter"]) == 7


def test_model_stock_needs_two_models():
    base, models = matrix_models(1, seed=10)
    with pytest.raises(MimaError, match="at least 2"):
        get_method("model_stock")(models, base)


# ------------------------------------------------------------------------------------------- LiNeS
def _ties_reference(taus: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The official TIES (k = 20, tests.helpers.numpy_ties); 0-D tensors pass as one-entry vectors
    (TIES is entry-wise after its global trim) and come back 0-D."""
    merged = numpy_ties({key: tau.reshape(len(tau), -1) for key, tau in taus.items()}, k=20)
    return {key: merged[key].reshape(taus[key].shape[1:]) for key in taus}


def _reference_lines_scale(key: str, alpha: float, beta: float, num_blocks: int) -> float:
    """LiNeS_scaling of the authors' src/eval/eval.py, written again: the first i (0 ..) whose
    '.i.' is in the name gives alpha + beta * i / (num_blocks - 1); no such i gives alpha."""
    for layer in range(num_blocks):
        if f".{layer}." in key:
            return alpha + beta * (layer / (num_blocks - 1))
    return alpha


def test_lines_on_task_arithmetic_by_hand():
    # T = 2, theta_0 = 0, so tau_m = sum of the models; auto alpha = 1 / T = 0.5, beta 0.6, L = 3:
    # scales 0.5 outside the blocks and in block 0, 0.8 in block 1, 1.1 in block 2.
    base = {"pre": torch.zeros(1), "transformer.resblocks.0.w": torch.zeros(2), "transformer.resblocks.1.w": torch.zeros(2),
            "transformer.resblocks.2.w": torch.zeros(2), "n": torch.tensor(3)}
    models = [
        {"pre": torch.tensor([1.0]), "transformer.resblocks.0.w": torch.tensor([1.0, -2.0]),
         "transformer.resblocks.1.w": torch.tensor([0.5, 0.0]), "transformer.resblocks.2.w": torch.tensor([2.0, 1.0]), "n": torch.tensor(3)},
        {"pre": torch.tensor([3.0]), "transformer.resblocks.0.w": torch.tensor([1.0, 0.0]),
         "transformer.resblocks.1.w": torch.tensor([1.5, -1.0]), "transformer.resblocks.2.w": torch.tensor([0.0, 1.0]), "n": torch.tensor(3)},
    ]
    merged = get_method("lines")(models, base, lines_beta=0.6)
    torch.testing.assert_close(merged["pre"], torch.tensor([2.0]))  # 0.5 * 4
    torch.testing.assert_close(merged["transformer.resblocks.0.w"], torch.tensor([1.0, -1.0]))  # 0.5 * (2, -2)
    torch.testing.assert_close(merged["transformer.resblocks.1.w"], torch.tensor([1.6, -0.8]))  # 0.8 * (2, -1)
    torch.testing.assert_close(merged["transformer.resblocks.2.w"], torch.tensor([2.2, 2.2]))  # 1.1 * (2, 2)
    assert int(merged["n"]) == 3
    # a given alpha replaces the automatic one: 0.2 + 0.6 * 1 / 2 = 0.5 in block 1
    fixed = get_method("lines")(models, base, lines_alpha=0.2, lines_beta=0.6)
    torch.testing.assert_close(fixed["transformer.resblocks.1.w"], torch.tensor([1.0, -0.5]))
    torch.testing.assert_close(fixed["pre"], torch.tensor([0.8]))


@pytest.mark.parametrize("base_merge", ["task_arithmetic", "ties", "consensus"])
def test_lines_matches_the_reference_rule_on_each_base_merge(base_merge):
    base, models = block_models(3, seed=1)
    taus = block_task_vectors(base, models)
    total = {key: value.sum(0) for key, value in taus.items()}
    if base_merge == "task_arithmetic":
        merged_tv = total
    elif base_merge == "ties":  # k = 20, global trim, disjoint mean (the reference's LiNeS+TIES)
        merged_tv = _ties_reference(taus)
    else:  # TALL masks at lambda 0.4, kept where at least 2 tasks select the entry
        merged_tv = {key: total[key] * ((np.abs(taus[key]) > 0.4 * np.abs(total[key] - taus[key])).sum(0) >= 2) for key in taus}
    # the reference's multi-task alpha: (||sum tau||_1 / ||merged tau||_1) / num_tasks
    alpha = sum(np.abs(v).sum() for v in total.values()) / sum(np.abs(v).sum() for v in merged_tv.values()) / 3
    merged = get_method("lines")(models, base, base_merge=base_merge, lines_beta=0.7)
    for key in BLOCK_SHAPES:
        scale = _reference_lines_scale(key, alpha, 0.7, num_blocks=3)
        np.testing.assert_allclose(merged[key].numpy(), base[key].numpy() + scale * merged_tv[key], rtol=1e-5, atol=1e-5,
                                   err_msg=key)
    assert int(merged["counter"]) == 7
    if base_merge != "task_arithmetic":
        assert abs(alpha - 1 / 3) > 1e-3  # the automatic alpha is not task arithmetic's 1 / T here


def test_lines_refuses_names_without_blocks_and_an_undefined_auto_alpha():
    base, models = block_models(2, seed=2)
    with pytest.raises(MimaError, match=r"no tensor name matches block_keys 'layer\(\\d\+\)'"):
        get_method("lines")(models, base, block_keys=r"layer(\d+)")
    # disjoint task vectors: each entry is selected by one task only, so consensus (k = 2) keeps nothing
    zero = {"transformer.resblocks.0.w": torch.zeros(2)}
    disjoint = [{"transformer.resblocks.0.w": torch.tensor([1.0, 0.0])}, {"transformer.resblocks.0.w": torch.tensor([0.0, 1.0])}]
    with pytest.raises(MimaError, match="lines_alpha 'auto' .* is undefined"):
        get_method("lines")(disjoint, zero, base_merge="consensus")


# --------------------------------------------------------------------------------- hyperparameters
@pytest.mark.parametrize("method, given, fragment", [
    ("magmax", {"lam": "big"}, "lam must be a finite number"),
    ("model_stock", {"lam": 0.5}, "takes no hyperparameter 'lam'"),
])
def test_bad_hyperparameters_are_one_line_errors(method, given, fragment):
    base, models = matrix_models(2, seed=11)
    with pytest.raises(MimaError) as error:
        get_method(method)(models, base, **given)
    assert fragment in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("flags, fragment", [
    (["--method", "magmax", "--lam", "nan"], "--lam must be a finite number"),
    (["--method", "model_stock", "--lam", "0.5"], "--lam does not apply to merge method 'model_stock'"),
    (["--method", "lines", "--lines-beta", "nan"], "--lines-beta must be a finite number, got nan"),
    (["--method", "lines", "--lines-alpha", "often"], "argument --lines-alpha: invalid"),
    (["--method", "lines", "--base-merge", "dare"], "argument --base-merge: invalid choice: 'dare'"),
    (["--method", "lines", "--block-keys", "layer"], "--block-keys must be a regular expression with a group"),
    (["--method", "lines", "--block-keys", r"layer(\d+)"], "no tensor name matches block_keys"),
    (["--method", "lines", "--block-keys", r"(res)blocks"], "its first group captured 'res' in"),
    (["--method", "lines", "--k", "20"], "--k does not apply to merge method 'lines'"),
])
def test_bad_flags_are_one_line(tmp_path, capsys, flags, fragment):
    assert_merge_flags_refused(tmp_path, capsys, flags, fragment)


def test_defaults_and_grids_follow_the_references():
    assert get_method("magmax").defaults["lam"] == 0.5
    assert get_method("magmax").grid["lam"] == tuple(np.round(np.linspace(0, 1, 21)[1:], 2))
    assert not get_method("model_stock").grid


# -------------------------------------------------------------------------------------- mima merge
def _numpy_defaults(name: str, base, models) -> dict[str, np.ndarray]:
    """uniform and task arithmetic at their documented defaults, written again with numpy."""
    keys = (MLP_MATRIX, "ln.weight", "proj")
    if name == "uniform":
        return {key: np.mean([m[key].double().numpy() for m in models], axis=0) for key in keys}
    taus = {key: np.stack([m[key].numpy() - base[key].numpy() for m in models]).astype(np.float64) for key in keys}
    return {key: base[key].double().numpy() + 0.4 * taus[key].sum(0) for key in keys}  # lam 0.4


@pytest.mark.parametrize("name", ["uniform", "task_arithmetic"])
def test_streamed_file_merge_matches_the_formula(tmp_path, name):
    assert_streamed_merge_matches(tmp_path, name, lambda base, models: _numpy_defaults(name, base, models))


def _magmax(theta_0: np.ndarray, taus: list[np.ndarray], lam: float) -> np.ndarray:
    """theta_0 + lam times, per entry, the task-vector value of largest magnitude (the later task on ties)."""
    stacked = np.stack(taus)
    last_max = len(taus) - 1 - np.argmax(np.abs(stacked)[::-1], axis=0)
    return theta_0 + lam * np.take_along_axis(stacked, last_max[None], axis=0)[0]


@pytest.mark.parametrize("method, flags", [("magmax", ["--lam", "0.3"]), ("model_stock", [])])
def test_mima_merge_from_safetensors_files(method, flags, tmp_path, capsys):
    base, models, written = merged_from_files(tmp_path, method, flags)
    for key in (MLP_MATRIX, WIDE_MATRIX, MLP_BIAS, CONV_KERNEL):  # both treat every tensor alike
        theta_0 = base[key].double().numpy()
        if method == "magmax":
            expected = _magmax(theta_0, task_vectors(base, models, key), 0.3)
        else:
            expected = _numpy_model_stock(theta_0, [m[key].double().numpy() for m in models])
        np.testing.assert_allclose(written[key].double().numpy(), expected, rtol=1e-4, atol=1e-4, err_msg=key)
    assert f"mima merge: {method}" in capsys.readouterr().out


def test_merge_command_writes_lines_from_files(tmp_path, capsys):
    base, models = block_models(3, seed=9)
    base_path, paths = save_models(tmp_path, base, models)
    assert merge_files("lines", base_path, paths, tmp_path / "lines.safetensors", "--base-merge", "ties", "--lines-beta", "0.9") == 0
    written = load_state_dict(tmp_path / "lines.safetensors")
    taus = block_task_vectors(base, models)
    ties_tv = _ties_reference(taus)
    alpha = sum(np.abs(v.sum(0)).sum() for v in taus.values()) / sum(np.abs(v).sum() for v in ties_tv.values()) / 3
    for key in BLOCK_SHAPES:
        expected = base[key].numpy() + _reference_lines_scale(key, alpha, 0.9, 3) * ties_tv[key]
        np.testing.assert_allclose(written[key].numpy(), expected, rtol=1e-5, atol=1e-5, err_msg=key)


def test_magmax_select_on_val_searches_the_grid(clip_task_models, tmp_path, capsys):
    """`--select-on val` on a small CLIP: every grid point is scored, the best lam is written."""
    inputs = clip_task_models
    out = tmp_path / "magmax.safetensors"
    assert merge_files("magmax", inputs.base_path, inputs.paths, out, "--config", str(inputs.config), "--select-on", "val") == 0
    report = json.loads((tmp_path / "magmax.safetensors.results.json").read_text())
    trials = report["trials"]
    assert [t["lam"] for t in trials] == list(get_method("magmax").grid["lam"])
    best = max(trials, key=lambda t: t["score"])  # the first of equal scores, as the selection
    assert report["hparams"] == {"lam": best["lam"]} and report["validation_accuracy"] == best["score"]
    written = load_state_dict(out)
    for key, value in inputs.base.items():
        if not value.is_floating_point():
            continue
        taus = [m[key].numpy() - value.numpy() for m in inputs.models]
        np.testing.assert_allclose(written[key].numpy(), _magmax(value.numpy(), taus, best["lam"]), rtol=1e-5, atol=1e-6)
    capsys.readouterr()


def test_lines_select_on_val_searches_beta_and_writes_that_merge(clip_task_models, tmp_path, capsys):
    inputs = clip_task_models
    out = tmp_path / "lines.safetensors"
    assert merge_files("lines", inputs.base_path, inputs.paths, out, "--config", str(inputs.config), "--select-on", "val") == 0
    report = json.loads((tmp_path / "lines.safetensors.results.json").read_text())
    assert report["selected_on"] == "val" and [t["lines_beta"] for t in report["trials"]] == [round(0.1 * i, 1) for i in range(1, 16)]
    best = max(report["trials"], key=lambda t: t["score"])  # the first best on ties, as selection keeps
    assert report["hparams"]["lines_beta"] == best["lines_beta"] and report["validation_accuracy"] == best["score"]
    written = load_state_dict(out)
    blocks = 1 + max(int(k.split(".")[2]) for k in inputs.base if k.startswith("transformer.resblocks."))
    for key, value in inputs.base.items():
        if not value.is_floating_point():
            continue
        tau = sum(m[key].double() - value.double() for m in inputs.models)  # task arithmetic; alpha 1 / T
        expected = value.double() + _reference_lines_scale(key, 0.5, best["lines_beta"], blocks) * tau
        np.testing.assert_allclose(written[key].numpy(), expected.numpy(), rtol=1e-5, atol=1e-6, err_msg=key)
