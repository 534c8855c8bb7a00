"""ACE-Merging and Singular Value Calibration, each against the reference code's steps written again
here in numpy, loop by loop (ACE: unravel-xu/ACE-Merging src/merge/strategy.py `ace_merging`; SVC:
the paper's eqs. 4 and 8 as lyymuwu/SVC merge_func.py and FusionBench's utils.py compute them, with
the merged matrix's singular vectors), hand-worked cases, one-line refusals, and `mima merge`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from mima.cli import main
from mima.core.errors import MimaError
from mima.core.safetensors_io import load_state_dict, save_state_dict
from mima.merging import HYPERPARAMETERS, get_method
from tests.helpers import perturbed_models

MATRIX = "transformer.resblocks.0.mlp.c_fc.weight"
WIDE = "transformer.resblocks.1.mlp.c_proj.weight"
TEXT_PROJECTION = "text_projection"
EMBEDDING = "positional_embedding"
BIAS = "transformer.resblocks.0.mlp.c_fc.bias"
SHAPES = ((MATRIX, (12, 8)), (WIDE, (5, 9)), (TEXT_PROJECTION, (6, 4)), (EMBEDDING, (7, 4)), (BIAS, (12,)))


def _models(count: int, seed: int = 0, scales: tuple[float, ...] | None = None):
    """theta_0 (with an integer tensor) and `count` models; `scales` multiplies each model's task vector."""
    base, models = perturbed_models(count, seed, SHAPES)
    if scales is not None:
        models = [{k: base[k] + scale * (v - base[k]) if v.is_floating_point() else v for k, v in m.items()}
                  for m, scale in zip(models, scales)]
    return base, models


def _taus(base, models, key) -> list[np.ndarray]:
    return [m[key].double().numpy() - base[key].double().numpy() for m in models]


# ------------------------------------------------------------------------------------- ACE
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
    base, models = _models(3, seed=1, scales=scales)
    merged = get_method("ace")(models, base, lam=0.7)
    for key in (MATRIX, WIDE):
        expected, flag = _reference_ace(_taus(base, models, key))
        assert flag is heterogeneous
        np.testing.assert_allclose(merged[key].double().numpy(), base[key].double().numpy() + 0.7 * expected,
                                   rtol=1e-4, atol=1e-5)
    for key in (BIAS, TEXT_PROJECTION):  # not matrices (the reference's rule): the mean task vector
        np.testing.assert_allclose(merged[key].numpy(), base[key].numpy() + 0.7 * np.mean(_taus(base, models, key), axis=0),
                                   rtol=1e-5, atol=1e-5)
    assert int(merged["counter"]) == 7


@pytest.mark.parametrize("eps, k_frac", [(0.5, 0.3), (1e-2, 0.6), (0.0, 1.0)])
def test_ace_hyperparameters_follow_the_reference(eps, k_frac):
    base, models = _models(4, seed=2, scales=(0.02, 1.0, 3.0, 50.0))
    merged = get_method("ace")(models, base, ace_epsilon=eps, ace_rank_fraction=k_frac)  # lam 1, the reference's
    expected, flag = _reference_ace(_taus(base, models, MATRIX), eps, k_frac)
    assert flag
    np.testing.assert_allclose(merged[MATRIX].double().numpy(), base[MATRIX].double().numpy() + expected, rtol=1e-4, atol=1e-5)


def test_ace_without_refinement_rank_is_the_closed_form():
    # 3 x 3 matrices keep int(0.3 * 3) = 0 directions: the reference's mean of no values is NaN there;
    # here the refinement is empty, which is rank fraction 0.
    base, models = _models(3, seed=3, scales=(0.01, 1.0, 30.0))
    key = "small"
    g = torch.Generator().manual_seed(4)
    base[key] = torch.randn(3, 3, generator=g)
    for index, model in enumerate(models):
        model[key] = base[key] + (0.01, 1.0, 30.0)[index] * torch.randn(3, 3, generator=g)
    merged = get_method("ace")(models, base)
    assert bool(torch.isfinite(merged[key]).all())
    torch.testing.assert_close(merged[key], get_method("ace")(models, base, ace_rank_fraction=0.0)[key])
    assert not torch.equal(merged[MATRIX], get_method("ace")(models, base, ace_rank_fraction=0.0)[MATRIX])


def test_ace_matrix_keys_narrow_the_matrices():
    base, models = _models(2, seed=5)
    narrowed = get_method("ace")(models, base, matrix_keys="c_fc")
    full = get_method("ace")(models, base)
    torch.testing.assert_close(narrowed[MATRIX], full[MATRIX])
    np.testing.assert_allclose(narrowed[WIDE].numpy(), base[WIDE].numpy() + np.mean(_taus(base, models, WIDE), axis=0),
                               rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------- SVC
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
    base, models = _models(3, seed=6)
    g = torch.Generator().manual_seed(7)
    shared = {k: torch.randn(v.shape, generator=g) for k, v in base.items() if v.is_floating_point()}
    models = [{k: v + shared[k] if k in shared else v for k, v in m.items()} for m in models]  # a shared direction
    merged = get_method("svc")(models, base, inner_hparams="lam=0.3", svc_alpha=alpha)
    for key in (MATRIX, WIDE):
        taus = _taus(base, models, key)
        expected = base[key].double().numpy() + _reference_svc(0.3 * sum(taus), taus, alpha)
        np.testing.assert_allclose(merged[key].double().numpy(), expected, rtol=1e-4, atol=1e-5)
    for key in (TEXT_PROJECTION, EMBEDDING, BIAS):  # the authors' rule: task arithmetic's values
        np.testing.assert_allclose(merged[key].numpy(), base[key].numpy() + 0.3 * np.sum(_taus(base, models, key), axis=0),
                                   rtol=1e-5, atol=1e-5)
    assert int(merged["counter"]) == 7


def test_svc_on_top_of_lines_calibrates_its_result():
    base, models = _models(3, seed=8)
    keys = r"resblocks\.(\d+)\."
    lines = get_method("lines")(models, base, base_merge="ties", lines_beta=0.8, block_keys=keys)
    merged = get_method("svc")(models, base, inner_merge="lines", inner_hparams=f"base_merge=ties,lines_beta=0.8,block_keys={keys}",
                               matrix_keys=".*")
    for key in (MATRIX, WIDE, TEXT_PROJECTION, EMBEDDING):
        expected = base[key].double().numpy() + _reference_svc(lines[key].double().numpy() - base[key].double().numpy(),
                                                               _taus(base, models, key), 0.1)
        np.testing.assert_allclose(merged[key].double().numpy(), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(merged[BIAS], lines[BIAS])
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
    base, models = _models(2, seed=9)
    default = get_method("svc")(models, base)  # task arithmetic at its own default lam 0.4
    explicit = get_method("svc")(models, base, inner_hparams="lam=0.4")
    assert all(torch.equal(default[k], explicit[k]) for k in default)


# -------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("method, given, message", [
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
    base, models = _models(2, seed=10)
    with pytest.raises(MimaError) as error:
        get_method(method)(models, base, **given)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.parametrize("method", ["ace", "svc"])
def test_non_finite_weights_are_refused_in_one_line(method):
    base, models = _models(3, seed=12)
    models[1][MATRIX][0, 0] = float("nan")
    with pytest.raises(MimaError) as error:
        get_method(method)(models, base)
    assert str(error.value) == (f"models[1]: tensor '{MATRIX}' holds NaN or Inf values; a merge needs finite weights "
                                "(`mima merge --allow-non-finite`, or allow_non_finite=True, merges them as they are)")
    if method == "svc":  # allowed through, they reach the calibration's SVD: still one line
        with pytest.raises(MimaError, match=r"^svc: cannot merge weights holding NaN or Inf, which allow_non_finite"):
            get_method(method)(models, base, allow_non_finite=True)


@pytest.mark.parametrize("argv, fragment", [
    (["--method", "ace", "--ace-rank-fraction", "2"], "merge method 'ace': --ace-rank-fraction must be a fraction of the rank"),
    (["--method", "ace", "--lam", "nan"], "merge method 'ace': --lam must be a finite number"),
    (["--method", "svc", "--inner-merge", "fisher"], "merge method 'svc': --inner-merge 'fisher' needs task data"),
    (["--method", "svc", "--inner-hparams", "lam=oops"], "merge method 'svc': --inner-hparams lam=oops: lam must be a finite number"),
    (["--method", "svc", "--inner-merge", "ties", "--inner-hparams", "k=0"],
     "merge method 'svc': inner merge 'ties': --inner-hparams k must be a percentage of entries kept"),
    (["--method", "svc", "--lam", "0.3"], "--lam does not apply to merge method 'svc'"),
])
def test_bad_flags_are_one_line(argv, fragment, tmp_path, capsys):
    code = main(["merge", *argv, "--models", str(tmp_path / "a.safetensors"), "--output", str(tmp_path / "out.safetensors")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "out.safetensors").exists()


# ------------------------------------------------------------------------------ mima merge
def _write_inputs(tmp_path, base, models) -> list[str]:
    save_state_dict(tmp_path / "base.safetensors", base)
    paths = []
    for index, model in enumerate(models):
        save_state_dict(tmp_path / f"task{index}.safetensors", model)
        paths.append(str(tmp_path / f"task{index}.safetensors"))
    return paths


@pytest.mark.parametrize("method, flags, hparams", [
    ("ace", ["--ace-epsilon", "0.1", "--lam", "0.9"], {"ace_epsilon": 0.1, "lam": 0.9}),
    ("svc", ["--inner-merge", "ties", "--inner-hparams", "k=30,lam=0.8", "--svc-alpha", "0.2"],
     {"inner_merge": "ties", "inner_hparams": "k=30,lam=0.8", "svc_alpha": 0.2}),
])
def test_mima_merge_streams_from_safetensors_files(method, flags, hparams, tmp_path, capsys):
    base, models = _models(3, seed=11, scales=(0.05, 1.0, 20.0))
    paths = _write_inputs(tmp_path, base, models)
    out = tmp_path / f"{method}.safetensors"
    argv = ["merge", "--method", method, "--base", str(tmp_path / "base.safetensors"), "--models", *paths, "--output", str(out), *flags]
    assert main(argv) == 0
    written = load_state_dict(out)
    expected = get_method(method)(models, base, **hparams)
    assert sorted(written) == sorted(base)
    for key, value in expected.items():
        torch.testing.assert_close(written[key], value, rtol=1e-6, atol=1e-6)
    assert f"mima merge: {method}" in capsys.readouterr().out


def test_help_lists_the_new_flags(capsys):
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in ("ace", "svc"):
        assert name in text
        for hyperparameter in get_method(name).defaults:
            assert HYPERPARAMETERS[hyperparameter].flag in text


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
    paths = _write_inputs(tmp_path, base, models)
    out = tmp_path / "ace.safetensors"
    assert main(["merge", "--method", "ace", "--base", str(tmp_path / "base.safetensors"), "--models", *paths,
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
