"""`mima analyze gradients` (paper 004): per-epoch gradients checked against the weights they move,
against torch.autograd.grad of an independently written loss, and the merges against a hand merge."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch.utils.data import DataLoader

from mima.analysis import gradients as G
from mima.analysis.common import fixed_subset
from mima.cli import main
from mima.merging.context import context_from_config
from mima.models.classifier import classify
from tests.conftest import fit_config

TASKS = ["rot90", "mirror"]
EXAMPLES = 32


@pytest.fixture(scope="module")
def context(small_clip, tmp_path_factory):
    return context_from_config(fit_config(tmp_path_factory.mktemp("ctx"), small_clip, TASKS, steps=2, iterations=1))


@pytest.fixture(scope="module")
def theta_0(context):
    return {k: v.detach().clone() for k, v in context.encoder.state_dict().items()}


def _train_set(context, task="rot90", count=EXAMPLES):
    return fixed_subset(context.splits[task].train, count, seed=0)


def _params(encoder):
    return {name: p.detach().clone() for name, p in encoder.named_parameters()}


def test_epoch_stats_by_hand():
    # ||g|| = (3, 1, 2), <g_k, g_1> = (9, -1, 0): shares 3/6, 1/6, 2/6; cosines 1, -1/3, 0.
    stats = G.epoch_gradient_stats([3.0, 1.0, 2.0], [9.0, -1.0, 0.0])
    assert stats.shares == pytest.approx([0.5, 1 / 6, 1 / 3])
    assert stats.cos_first == pytest.approx([1.0, -1 / 3, 0.0])


def test_sgd_epoch_gradient_is_the_weight_change_over_lr(context, theta_0):
    # Double precision so that (theta_start - theta_end) / lr is not swamped by float32 rounding.
    encoder = copy.deepcopy(context.encoder).double()
    encoder.load_state_dict(theta_0)
    encoder.requires_grad_(True)
    G.set_train_mode(encoder)
    head = context.heads["rot90"].double()
    lr = 0.05
    settings = G.GradientSettings(lr=lr)
    optimizer = G.make_optimizer(encoder.parameters(), settings)
    batches = [(x.double(), y) for x, y in DataLoader(_train_set(context), batch_size=8, shuffle=True,
                                                        generator=torch.Generator().manual_seed(1))]
    assert len(batches) == 4  # several steps: g is a sum over steps taken at different weights
    start = _params(encoder)
    result = G.run_epoch(encoder, head, batches, optimizer)
    end = _params(encoder)
    assert result.steps == 4 and set(result.gradient) == set(start)
    moved = 0.0
    for name in start:
        from_weights = (start[name] - end[name]) / lr
        torch.testing.assert_close(result.gradient[name], from_weights, rtol=1e-7, atol=1e-9)
        moved += float(from_weights.abs().sum())
    assert moved > 1.0  # the epoch really changed the weights


def test_single_batch_epoch_is_the_autograd_gradient(context, theta_0):
    encoder = copy.deepcopy(context.encoder)
    encoder.load_state_dict(theta_0)
    encoder.requires_grad_(True)
    G.set_train_mode(encoder)
    head = context.heads["mirror"]
    images, labels = next(iter(DataLoader(_train_set(context, "mirror", 16), batch_size=16)))

    # The loss written out again: softmax cross-entropy of cosine logits against the frozen head.
    features = encoder(images)
    features = features / features.norm(dim=-1, keepdim=True)
    log_probs = torch.log_softmax(features @ head.T, dim=1)
    loss = -log_probs[torch.arange(len(labels)), labels].mean()
    names = [name for name, _ in encoder.named_parameters()]
    expected = dict(zip(names, torch.autograd.grad(loss, list(encoder.parameters()))))

    optimizer = G.make_optimizer(encoder.parameters(), G.GradientSettings(optimizer="adamw", lr=1e-3, weight_decay=0.1))
    result = G.run_epoch(encoder, head, [(images, labels)], optimizer)  # one full-batch epoch
    assert result.steps == 1 and result.mean_loss == pytest.approx(float(loss.detach()), rel=1e-5)
    for name in names:
        torch.testing.assert_close(result.gradient[name], expected[name], rtol=1e-4, atol=1e-6)


def _hand_accuracy(encoder, head, dataset):
    encoder.eval()
    with torch.no_grad():
        correct = sum(int((classify(encoder, head, x).argmax(1) == y).sum()) for x, y in DataLoader(dataset, batch_size=200))
    return correct / len(dataset)


def test_analysis_numbers_agree_with_the_saved_weights_and_a_hand_merge(context, theta_0):
    lr = 0.02
    settings = G.GradientSettings(epochs=2, lr=lr, batch_size=8, train_examples=EXAMPLES)
    results = G.analyse_gradients(context, TASKS, theta_0, settings, log=lambda *_: None)
    assert results["tasks"] == TASKS
    keys = [k for k, v in theta_0.items() if v.is_floating_point()]

    # Re-run the fine-tunes (deterministic) to get the weights after epoch 1 and 2.
    for task in TASKS:
        row = results["per_task"][task]
        assert sum(row["share"]) == pytest.approx(1.0, abs=1e-12)
        assert row["cos_first"][0] == pytest.approx(1.0, abs=1e-9)
        assert row["steps_per_epoch"] == 4 and row["train_examples"] == EXAMPLES
        run = G.fine_tune_task(task, context.encoder, context.heads[task], _train_set(context, task), theta_0, settings)
        # SGD: theta_1 - theta_0 = -lr g_1 and theta_2 - theta_1 = -lr g_2, so the weights alone give
        # ||g_k|| and cos(g_2, g_1) (float32 weights: differences lose a few digits).
        step_1 = torch.cat([(run.one_epoch[k] - theta_0[k]).double().flatten() for k in keys])
        step_2 = torch.cat([(run.converged[k] - run.one_epoch[k]).double().flatten() for k in keys])
        norms = [float(step_1.norm()) / lr, float(step_2.norm()) / lr]
        assert row["gradient_norm"] == pytest.approx(norms, rel=2e-3)
        assert row["share"] == pytest.approx([n / sum(norms) for n in norms], rel=2e-3)
        cos = float(step_1 @ step_2 / (step_1.norm() * step_2.norm()))
        assert row["cos_first"][1] == pytest.approx(cos, abs=2e-3)
        assert -1.0 <= cos < 0.999  # epoch 2 is not a copy of epoch 1
        tau_cos = float(step_1 @ (step_1 + step_2) / (step_1.norm() * (step_1 + step_2).norm()))
        assert row["cos_tau_one_epoch_converged"] == pytest.approx(tau_cos, abs=1e-4)
        head = context.heads[task]
        context.encoder.load_state_dict(theta_0)
        assert row["test_accuracy"]["zero_shot"] == pytest.approx(_hand_accuracy(context.encoder, head, context.splits[task].test))
        context.encoder.load_state_dict(run.converged)
        assert row["test_accuracy"]["converged"] == pytest.approx(_hand_accuracy(context.encoder, head, context.splits[task].test))

    # The merge: theta_0 + lam * sum_t tau_t at the chosen lam, evaluated by hand on test.
    models = {"one_epoch": [], "converged": []}
    for task in TASKS:
        run = G.fine_tune_task(task, context.encoder, context.heads[task], _train_set(context, task), theta_0, settings)
        models["one_epoch"].append(run.one_epoch)
        models["converged"].append(run.converged)
    for name, states in models.items():
        merged_result = results["merged"][name]
        lam = merged_result["lam"]
        assert lam in [round(0.05 * i, 2) for i in range(21)]
        merged = {k: (v + lam * sum(s[k] - v for s in states)) if v.is_floating_point() else v for k, v in theta_0.items()}
        context.encoder.load_state_dict(merged)
        hand = {t: _hand_accuracy(context.encoder, context.heads[t], context.splits[t].test) for t in TASKS}
        assert merged_result["test"] == pytest.approx(hand, abs=1e-6)
        assert merged_result["test_mean"] == pytest.approx(sum(hand.values()) / 2, abs=1e-6)
        # lam was chosen on validation: no grid point scores higher there than the chosen one.
        context.encoder.load_state_dict(theta_0)
        at_zero = sum(_hand_accuracy(context.encoder, context.heads[t], context.splits[t].val) for t in TASKS) / 2
        assert merged_result["val_mean"] >= at_zero - 1e-9


def test_cli_on_a_run_folder_and_one_line_errors(tmp_path, small_clip, capsys):
    from mima.training.trainer import run_fit

    run = run_fit(fit_config(tmp_path / "run", small_clip, TASKS, steps=2, iterations=1)).run_dir
    out = tmp_path / "out"
    argv = ["analyze", "gradients", str(run), "--epochs", "2", "--train-examples", "16", "--batch-size", "8", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "task arithmetic of 1-epoch task vectors" in printed and " s\n" in printed
    results = json.loads((out / "gradients.json").read_text())
    assert (out / "gradients.png").stat().st_size > 10_000
    assert results["settings"]["lr"] == G.DEFAULT_LR["sgd"] and results["settings"]["epochs"] == 2
    for task in TASKS:
        assert len(results["per_task"][task]["share"]) == 2
        assert math.isfinite(results["per_task"][task]["gradient_norm"][0])
    assert set(results["merged"]) == {"one_epoch", "converged"}

    assert main(argv) == 2  # outputs exist: refuses without --overwrite
    assert "--overwrite" in capsys.readouterr().err
    for bad, option in ((["--epochs", "0"], "--epochs"), (["--tasks", "nope"], "--tasks"),
                        (["--weight-decay", "0.1"], "--weight-decay")):
        assert main(["analyze", "gradients", str(run), "--out", str(tmp_path / "bad"), *bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and option in err and "Traceback" not in err
    assert not (tmp_path / "bad").exists()  # a mistake leaves no output folder behind
    assert main(["analyze", "gradients", str(tmp_path / "missing"), "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RUN" in err and "missing" in err
