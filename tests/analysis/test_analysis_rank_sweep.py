"""`mima analyze rank-sweep`: CART's rank sweep, I(k) and R(k), checked against hand computations."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.data import DataLoader

from mima.analysis.rank_sweep.compute import accuracy_curve, layer_metrics, rank_sweep
from mima.cli import main
from mima.pools import task_pool
from mima.merging.registry import get_method
from mima.models.classifier import classify
from mima.core.run_folder import RunFolder
from mima.core.state_dicts import mean_state_dict

KEY = "blocks.0.attn.out_proj.weight"  # matches the default matrix keys


def _close(a: dict, b: dict, atol: float = 1e-5) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k].double(), b[k].double(), atol=atol) for k in a)


# ----------------------------------------------------------------------------- I(k), R(k) on tiny matrices
def test_hand_worked_2x2_example():
    # original vectors (theta_0 = 0): tau_1 = diag(3, 1), tau_2 = [[0, 2], [0, 0]]
    models = [{KEY: torch.tensor([[3.0, 0.0], [0.0, 1.0]])}, {KEY: torch.tensor([[0.0, 2.0], [0.0, 0.0]])}]
    base = {KEY: torch.zeros(2, 2)}
    metrics = layer_metrics(models, base, ranks=[0, 1, 2])
    # k = 1: top right vectors e1 and e2 are orthogonal; k = 2: only s~_1,2 * s~_2,1 * <e2, e2> = (1/sqrt(10)) * 1
    # survives, counted once for (1, 2) and once for (2, 1)
    assert metrics.interference["original"][KEY] == pytest.approx([0.0, 0.0, 2 / math.sqrt(10)], abs=1e-6)
    # R(0) = 9 + 1 + 4, R(1) = the singular value 1 of tau_1 left out, R(2) = 0
    assert metrics.reconstruction["original"][KEY] == pytest.approx([14.0, 1.0, 0.0], abs=1e-5)
    # centered: theta_avg = [[1.5, 1], [0, 0.5]], c = tau_1 - avg = [[1.5, -1], [0, 0.5]], c_2 = -c.
    # c^T c has trace 3.5 and determinant 0.75^2, so s^2 = (3.5 +- sqrt(10)) / 2 and ||c||_F^2 = 3.5;
    # c_2 = -c shares the singular vectors, so the block is diag(s^2) / 3.5 up to signs.
    s1, s2 = (3.5 + math.sqrt(10)) / 2, (3.5 - math.sqrt(10)) / 2
    assert metrics.interference["centered"][KEY] == pytest.approx(
        [0.0, 2 * s1 / 3.5, 2 * math.sqrt(s1**2 + s2**2) / 3.5], abs=1e-5)
    assert metrics.reconstruction["centered"][KEY] == pytest.approx([7.0, 2 * s2, 0.0], abs=1e-5)
    assert metrics.energy["centered"][KEY] == pytest.approx(7.0, abs=1e-5)


def test_orthogonal_row_spaces_have_no_interference():
    generator = torch.Generator().manual_seed(0)
    models = []
    for t in range(3):  # tau_t lives only in columns 3t .. 3t+2: pairwise orthogonal row spaces
        tau = torch.zeros(6, 9)
        tau[:, 3 * t:3 * t + 3] = torch.randn(6, 3, generator=generator)
        models.append({KEY: tau})
    metrics = layer_metrics(models, {KEY: torch.zeros(6, 9)}, ranks=[0, 1, 2, 3, 6])
    assert metrics.interference["original"][KEY] == pytest.approx([0.0] * 5, abs=1e-6)
    energy = sum(float(m[KEY].square().sum()) for m in models)
    reconstruction = metrics.reconstruction["original"][KEY]
    assert reconstruction[0] == pytest.approx(energy, rel=1e-5)
    assert reconstruction[3] == pytest.approx(0.0, abs=1e-4) and reconstruction[4] == pytest.approx(0.0, abs=1e-4)


def _literal_interference(vectors, k):
    """Eq. 5 with V~ the n x k matrix of top-k right singular vectors: (V~_i S~_i)^T (V~_j S~_j), S~ = s / ||tau||_F."""
    total = 0.0
    parts = []
    for tau in vectors:
        tau = tau.double()
        _, s, vh = torch.linalg.svd(tau, full_matrices=False)
        parts.append(vh[:k].T @ torch.diag(s[:k] / tau.norm()))
    for i, a in enumerate(parts):
        for j, b in enumerate(parts):
            if i != j:
                total += float((a.T @ b).norm())
    return total


def test_interference_and_reconstruction_match_the_literal_formulas():
    generator = torch.Generator().manual_seed(1)
    models = [{KEY: torch.randn(5, 7, generator=generator)} for _ in range(3)]
    base = {KEY: torch.randn(5, 7, generator=generator)}
    ranks = [0, 1, 2, 3, 4, 5, 9]
    metrics = layer_metrics(models, base, ranks=ranks)
    average = sum(m[KEY].double() for m in models) / 3
    for kind, start in (("original", base[KEY].double()), ("centered", average)):
        vectors = [m[KEY].double() - start for m in models]
        expected_i = [_literal_interference(vectors, min(k, 5)) for k in ranks]
        assert metrics.interference[kind][KEY] == pytest.approx(expected_i, rel=1e-4, abs=1e-6)
        expected_r = []
        for k in ranks:
            total = 0.0
            for tau in vectors:
                u, s, vh = torch.linalg.svd(tau, full_matrices=False)
                total += float((tau - (u[:, :k] * s[:k]) @ vh[:k]).square().sum())
            expected_r.append(total)
        assert metrics.reconstruction[kind][KEY] == pytest.approx(expected_r, rel=1e-4, abs=1e-5)
        values = metrics.interference[kind][KEY]
        assert all(b >= a - 1e-9 for a, b in zip(values, values[1:]))  # Frobenius norms of growing blocks
    # I is scale free (singular values are normalised); R scales with the square
    scaled = layer_metrics([{KEY: 10 * m[KEY]} for m in models], {KEY: 10 * base[KEY]}, ranks=ranks)
    assert scaled.interference["original"][KEY] == pytest.approx(metrics.interference["original"][KEY], rel=1e-4, abs=1e-6)
    assert scaled.reconstruction["original"][KEY] == pytest.approx(
        [100 * v for v in metrics.reconstruction["original"][KEY]], rel=1e-4, abs=1e-3)


# ----------------------------------------------------------------------------- the swept merges
def _toy_models():
    generator = torch.Generator().manual_seed(2)
    shapes = {
        "blocks.0.attn.in_proj_weight": (6, 4),
        "blocks.0.attn.in_proj_bias": (6,),
        "blocks.0.mlp.c_fc.weight": (8, 4),
        "proj": (4, 4),  # 2-D but not an attention/MLP weight: no low rank
        "ln.weight": (4,),
    }
    def make():
        state = {key: torch.randn(*shape, generator=generator) for key, shape in shapes.items()}
        state["steps"] = torch.tensor([3], dtype=torch.int64)
        return state
    return [make() for _ in range(3)], make()


def test_sweep_endpoints_are_the_average_and_task_arithmetic():
    models, base = _toy_models()
    sweep = rank_sweep(models, base, ratios=[0.0, 0.5, 1.0], lam_cart=1.7, lam_ta=0.3)
    average = mean_state_dict(models)
    assert _close(sweep.state_dict("centered", 0.0), average)
    assert _close(sweep.state_dict("centered", 1.0), average)  # centered vectors sum to zero
    assert _close(sweep.state_dict("centered", 0.5), get_method("cart")(models, None, lam=1.7, rank_ratio=0.5))
    assert _close(sweep.state_dict("original", 1.0), get_method("task_arithmetic")(models, base, lam=0.3))
    at_zero = sweep.state_dict("original", 0.0)
    for key in ("blocks.0.attn.in_proj_weight", "blocks.0.mlp.c_fc.weight"):
        assert torch.equal(at_zero[key], base[key])  # no low-rank part left
    for key in ("blocks.0.attn.in_proj_bias", "proj", "ln.weight"):
        expected = base[key] + 0.3 * sum(m[key] - base[key] for m in models)
        assert torch.allclose(at_zero[key], expected, atol=1e-6)
    assert sweep.matrices == ["blocks.0.attn.in_proj_weight", "blocks.0.mlp.c_fc.weight"]
    assert sweep.kept_ranks == {0.0: [0], 0.5: [2], 1.0: [4]}


# ----------------------------------------------------------------------------- a real tiny CLIP
@pytest.fixture(scope="module")
def run(two_runs):
    """The shared N = 1 run of rot90 and mirror (tests/conftest.py)."""
    return two_runs[0]


def _hand_mean_accuracy(context, state_dict) -> float:
    """Mean over tasks of top-1 test accuracy, counted in a plain loop."""
    context.encoder.load_state_dict(state_dict)
    context.encoder.eval()
    scores = []
    with torch.no_grad():
        for task in context.tasks:
            dataset = context.splits[task].test
            correct = sum(int((classify(context.encoder, context.heads[task], images).argmax(1) == labels).sum())
                          for images, labels in DataLoader(dataset, batch_size=256))
            scores.append(correct / len(dataset))
    return sum(scores) / len(scores)


def test_accuracy_curve_endpoints_on_a_real_run(run):
    folder = RunFolder(run)
    models = [folder.final(task) for task in ("rot90", "mirror")]
    base = folder.path / "pretrained.safetensors"
    from mima.core.safetensors_io import load_state_dict

    base = load_state_dict(base)
    context = task_pool(run)
    sweep = rank_sweep(models, base, ratios=[0.0, 0.25, 1.0], ranks=[0, 4, 32])
    average = mean_state_dict(models)
    assert _close(sweep.state_dict("centered", 0.0), average) and _close(sweep.state_dict("centered", 1.0), average)
    task_arithmetic = get_method("task_arithmetic")(models, base, lam=0.3)
    assert _close(sweep.state_dict("original", 1.0), task_arithmetic)

    curve = accuracy_curve(sweep, context.evaluator("test").accuracy)
    hand_average = _hand_mean_accuracy(context, average)
    one_example = 1 / len(context.splits["rot90"].test)
    assert curve.average == pytest.approx(hand_average, abs=1e-6)
    assert curve.mean["centered"][0] == pytest.approx(hand_average, abs=1e-6)  # torchmetrics counts in float32
    assert curve.mean["centered"][2] == pytest.approx(hand_average, abs=one_example)  # float noise of the SVD
    assert curve.mean["original"][2] == pytest.approx(_hand_mean_accuracy(context, task_arithmetic), abs=one_example)
    assert curve.pretrained == pytest.approx(_hand_mean_accuracy(context, base), abs=1e-6)
    assert len(sweep.layers.layers) == 8 and set(sweep.layers.full_rank.values()) == {32}
    for layer in sweep.layers.layers:
        assert sweep.layers.reconstruction["centered"][layer][2] == pytest.approx(0.0, abs=1e-6)


def test_cli_writes_numbers_and_plots_and_rejects_bad_options(run, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["analyze", "rank-sweep", str(run), "--out", str(out), "--ratios", "0", "0.5", "1", "--ranks", "0", "1", "4"]
    assert main(args) == 0
    for name in ("rank-sweep.json", "rank-sweep.png", "rank-sweep_layers.png"):
        assert (out / name).stat().st_size > 0
    result = json.loads((out / "rank-sweep.json").read_text())
    accuracy = result["accuracy"]
    assert accuracy["centered"]["mean"][0] == accuracy["theta_avg"]["mean"]
    assert result["layers"]["ranks"] == [0, 1, 4] and len(result["layers"]["per_layer"]) == 8
    assert result["kept_ranks"] == {"0": [0], "0.5": [16], "1": [32]}
    printed = capsys.readouterr().out
    assert "rank-sweep: 2 tasks, N = 1" in printed and "theta_avg" in printed

    assert main(args) == 2  # outputs already there
    assert "--overwrite" in capsys.readouterr().err
    assert main([*args[:3], "--out", str(tmp_path / "bad"), "--ratios", "0", "1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--ratios 1.5" in err and "[0, 1]" in err
    assert not (tmp_path / "bad").exists()

    # safetensors files and --base, without data: only I(k) and R(k)
    files = [str(run / "final" / f"{task}.safetensors") for task in ("rot90", "mirror")]
    layers_only = tmp_path / "layers"
    assert main(["analyze", "rank-sweep", *files, "--base", str(run / "pretrained.safetensors"),
                 "--no-accuracy", "--out", str(layers_only)]) == 0
    assert not (layers_only / "rank-sweep.png").exists() and (layers_only / "rank-sweep_layers.png").is_file()
    numbers = json.loads((layers_only / "rank-sweep.json").read_text())
    assert numbers["accuracy"] is None and numbers["layers"]["ranks"] == list(range(33))
