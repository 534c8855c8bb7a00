"""`mima analyze ctl` (paper 003, section 4.1): cross-task linearity against hand computations."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from mima.analysis.ctl.compute import (
    OUTPUT,
    capture_features,
    cross_task_linearity,
    task_arithmetic_linearity,
)
from mima.cli import main
from mima.pools import task_pool
from mima.core.run_folder import RunFolder
from mima.commands.fit.run import run_fit
from tests.helpers import fit_config

ALPHAS = [0.25, 0.5, 0.75]


def _random_weights(module: nn.Module, seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(v.shape, generator=g) for k, v in module.state_dict().items()}


def _inputs(seed: int, rows: int, width: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, width, generator=g), torch.randn(rows + 3, width, generator=g)]


# --------------------------------------------------------------- an independent numpy computation
def _mlp_features(w: dict[str, np.ndarray], x: np.ndarray) -> dict[str, np.ndarray]:
    """Linear-ReLU-Linear written out with matrix products: the output of each of the three layers."""
    hidden = x @ w["0.weight"].T + w["0.bias"]
    active = np.maximum(hidden, 0.0)
    return {"0": hidden, "1": active, "2": active @ w["2.weight"].T + w["2.bias"]}


def _hand_stats(fa: np.ndarray, fb: np.ndarray, fm: np.ndarray, alpha: float):
    target = alpha * fa + (1 - alpha) * fb
    cos = np.array([m @ t / (np.linalg.norm(m) * np.linalg.norm(t)) for m, t in zip(fm, target)])
    ratio = np.array([np.linalg.norm(m) * c / np.linalg.norm(t) for m, t, c in zip(fm, target, cos)])
    base = np.array([a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) for a, b in zip(fa, fb)])
    return cos, ratio, base


def _assert_spread(spread, values: np.ndarray, tol: float = 1e-9) -> None:
    expected = [values.mean(), *np.percentile(values, [25, 50, 75]), values.min(), values.max()]
    got = [spread.mean, spread.lower_quartile, spread.median, spread.upper_quartile, spread.minimum, spread.maximum]
    np.testing.assert_allclose(got, expected, rtol=tol, atol=tol)


def test_a_model_linear_in_its_weights_has_cosine_and_length_ratio_one():
    model = nn.Linear(5, 3)
    a, b = _random_weights(model, 1), _random_weights(model, 2)
    batches = _inputs(0, 6, 5)
    result = cross_task_linearity(model, [OUTPUT], a, b, batches, ALPHAS)
    (layer,) = result.layers
    assert result.examples == 15
    for alpha in ALPHAS:
        for spread in (layer.cosine[alpha], layer.length_ratio[alpha]):
            assert abs(spread.minimum - 1) < 1e-6 and abs(spread.maximum - 1) < 1e-6
    # the two models really differ, so the 1s above are not the trivial case
    x = torch.cat(batches).double()
    fa = x @ a["weight"].double().T + a["bias"].double()
    fb = x @ b["weight"].double().T + b["bias"].double()
    _assert_spread(layer.baseline_cosine, torch.nn.functional.cosine_similarity(fa, fb).numpy(), tol=1e-6)
    assert layer.baseline_cosine.mean < 0.9


def test_linear_relu_linear_matches_a_hand_computation():
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    a, b = _random_weights(model, 3), _random_weights(model, 4)
    batches = _inputs(5, 7, 4)
    result = cross_task_linearity(model, ["0", "1", "2"], a, b, batches, ALPHAS)

    x = torch.cat(batches).double().numpy()
    wa = {k: v.double().numpy() for k, v in a.items()}
    wb = {k: v.double().numpy() for k, v in b.items()}
    fa, fb = _mlp_features(wa, x), _mlp_features(wb, x)
    for alpha in ALPHAS:
        fm = _mlp_features({k: alpha * wa[k] + (1 - alpha) * wb[k] for k in wa}, x)
        for layer in result.layers:
            cos, ratio, base = _hand_stats(fa[layer.layer], fb[layer.layer], fm[layer.layer], alpha)
            _assert_spread(layer.cosine[alpha], cos, tol=1e-5)
            _assert_spread(layer.length_ratio[alpha], ratio, tol=1e-5)
            _assert_spread(layer.baseline_cosine, base, tol=1e-5)
    by_name = {layer.layer: layer for layer in result.layers}
    # the first Linear is linear in its weights; after the ReLU, linearity breaks visibly
    assert abs(by_name["0"].cosine[0.5].minimum - 1) < 1e-6
    assert by_name["2"].cosine[0.5].mean < 0.999


def test_task_addition_matches_a_hand_computation():
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    base, a, b = (_random_weights(model, seed) for seed in (6, 7, 8))
    batches = _inputs(9, 10, 4)
    lam = 0.3
    result = task_arithmetic_linearity(model, ["1", "2"], base, a, b, batches, lam=lam)

    x = torch.cat(batches).double().numpy()
    w0, wa, wb = ({k: v.double().numpy() for k, v in w.items()} for w in (base, a, b))
    end_a = _mlp_features({k: w0[k] + 2 * lam * (wa[k] - w0[k]) for k in w0}, x)
    end_b = _mlp_features({k: w0[k] + 2 * lam * (wb[k] - w0[k]) for k in w0}, x)
    merged = _mlp_features({k: w0[k] + lam * (wa[k] - w0[k] + wb[k] - w0[k]) for k in w0}, x)
    assert result.alphas == [0.5]
    for layer in result.layers:
        cos, ratio, base_cos = _hand_stats(end_a[layer.layer], end_b[layer.layer], merged[layer.layer], 0.5)
        _assert_spread(layer.cosine[0.5], cos, tol=1e-5)
        _assert_spread(layer.length_ratio[0.5], ratio, tol=1e-5)
        _assert_spread(layer.baseline_cosine, base_cos, tol=1e-5)


def test_a_model_against_itself_has_baseline_cosine_one():
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    a = _random_weights(model, 10)
    result = cross_task_linearity(model, ["1", "2"], a, {k: v.clone() for k, v in a.items()}, _inputs(11, 5, 4), ALPHAS)
    for layer in result.layers:
        assert abs(layer.baseline_cosine.minimum - 1) < 1e-6
        for alpha in ALPHAS:
            assert abs(layer.cosine[alpha].minimum - 1) < 1e-6 and abs(layer.length_ratio[alpha].mean - 1) < 1e-6


def test_token_features_are_flattened_per_example_whatever_the_batch_dimension():
    tokens = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)  # [batch, tokens, width]
    model = nn.Sequential(nn.Identity())
    assert torch.equal(capture_features(model, ["0"], tokens)["0"], tokens.reshape(2, 12))
    sequence_first = tokens.transpose(0, 1)  # [tokens, batch, width], as older open_clip blocks run
    assert torch.equal(capture_features(model, ["0"], sequence_first, batch_dims={"0": 1})["0"], tokens.reshape(2, 12))


def test_a_timm_resnet_tower_is_measured_at_its_stages_with_batchnorm_statistics_swapped_in():
    import copy

    import open_clip

    from mima.analysis.ctl.compute import tower_layers
    from tests.helpers import BATCHNORM_CLIP_CFG

    torch.manual_seed(0)
    tower = open_clip.CLIP(**BATCHNORM_CLIP_CFG).visual
    layers = tower_layers(tower)
    assert layers == ["trunk.layer1", "trunk.layer2", "trunk.layer3", "trunk.layer4", OUTPUT]
    a = tower.state_dict()
    g = torch.Generator().manual_seed(1)
    b = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in a.items()}
    images = torch.randn(5, 3, 16, 16, generator=g)
    result = cross_task_linearity(tower, layers, a, b, [images], [0.5])
    # plain eval-mode forwards of two loaded copies (running statistics included), no hooks
    outputs = []
    for weights in (a, b):
        model = copy.deepcopy(tower).eval()
        model.load_state_dict(weights)
        with torch.no_grad():
            outputs.append(model(images).double())
    expected = torch.nn.functional.cosine_similarity(*outputs).numpy()
    _assert_spread(result.layers[-1].baseline_cosine, expected, tol=1e-5)


# ------------------------------------------------------------------------- open_clip and the CLI
TASKS = ["rot90", "rot180"]


@pytest.fixture(scope="module")
def fitted_run(tmp_path_factory, small_clip):
    return run_fit(fit_config(tmp_path_factory.mktemp("ctl") / "run", small_clip, TASKS, steps=4, iterations=2)).run_dir


def test_ctl_on_an_open_clip_run_has_one_entry_per_resblock_and_matches_plain_forwards(fitted_run, tmp_path, capsys):
    out = tmp_path / "ctl"
    assert main(["analyze", "ctl", str(fitted_run), "--examples", "6", "--alphas", "0.5", "--out", str(out)]) == 0
    report = json.loads((out / "ctl.json").read_text())
    layers = report["interpolation"]["layers"]
    assert [layer["layer"] for layer in layers] == ["transformer.resblocks.0", "transformer.resblocks.1", OUTPUT]
    assert report["examples_per_task"] == {"rot90": 3, "rot180": 3}
    assert report["task_arithmetic"]["lambda"] == 0.4
    assert (out / "ctl.png").stat().st_size > 0 and (out / "ctl_arithmetic.png").stat().st_size > 0
    assert "transformer.resblocks.1" in capsys.readouterr().out

    # the tower output again, with load_state_dict and plain forward passes instead of hooks
    context = task_pool(fitted_run)
    run = RunFolder(fitted_run)
    a, b = run.final("rot90"), run.final("rot180")
    images = torch.cat([
        torch.stack([context.splits[task].test[i][0] for i in _subset_indices(len(context.splits[task].test), 3, context.seed)])
        for task in TASKS
    ])
    encoder = context.encoder.eval()
    features = []
    for weights in (a, b, {k: 0.5 * a[k] + 0.5 * b[k] for k in a}):
        encoder.load_state_dict(weights)
        with torch.no_grad():
            features.append(encoder(images).double().numpy())
    cos, ratio, base = _hand_stats(*features, 0.5)
    output = layers[-1]
    np.testing.assert_allclose(output["cosine"]["0.5"]["mean"], cos.mean(), rtol=1e-5)
    np.testing.assert_allclose(output["length_ratio"]["0.5"]["mean"], ratio.mean(), rtol=1e-5)
    np.testing.assert_allclose(output["baseline_cosine"]["mean"], base.mean(), rtol=1e-5)
    assert base.mean() < 1 - 1e-4  # fine-tuning moved the two models apart


def _subset_indices(size: int, count: int, seed: int) -> list[int]:
    """The indices mima.core.subsets.fixed_subset draws, written out again."""
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed))[:count]
    return sorted(order.tolist())


def test_ctl_on_two_model_files_with_a_layer_pattern(fitted_run, tmp_path):
    out = tmp_path / "files"
    files = [str(fitted_run / "final" / f"{task}.safetensors") for task in TASKS]
    argv = ["analyze", "ctl", *files, "--config", str(fitted_run), "--examples", "4", "--layers", r"transformer\.resblocks\.1",
            "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "ctl.json").read_text())
    assert [layer["layer"] for layer in report["interpolation"]["layers"]] == ["transformer.resblocks.1"]
    assert report["tasks"] == TASKS and report["task_arithmetic"] is None  # no theta_0 without --base
    assert report["interpolation"]["alphas"] == ALPHAS
    assert main(argv) == 2  # the outputs are there now: needs --overwrite


@pytest.mark.parametrize(
    "extra, option",
    [
        (["--alphas", "1.5"], "--alphas"),
        (["--tasks", "rot90", "nope"], "--tasks nope"),
        (["--layers", "no_such_module"], "--layers"),
        (["--layers", "("], "--layers"),
    ],
)
def test_bad_options_give_one_line_errors(fitted_run, tmp_path, capsys, extra, option):
    assert main(["analyze", "ctl", str(fitted_run), "--examples", "2", "--out", str(tmp_path / "x"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and option in err


def test_two_model_files_need_a_config(fitted_run, tmp_path, capsys):
    files = [str(fitted_run / "final" / f"{task}.safetensors") for task in TASKS]
    assert main(["analyze", "ctl", *files, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--config" in err
