"""`mima analyze gradients` (paper 004), checked against fine-tunes written out in the test itself.

Every reference here is trained by the test, never taken from the module under test: a numpy
fine-tune of a linear encoder with hand-derived gradients (SGD and AdamW), a torch fine-tune of an
encoder with BatchNorm in plain eval mode, and, for the small CLIP, a hand SGD loop whose weights
give the per-epoch gradients as (theta_start - theta_end) / lr and the task-arithmetic merges.
The batches the module's loader served are recorded and replayed, so the references see the same
minibatches in the same order without relying on how the loader shuffles.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from mima.analysis.gradients.command import DEFAULT_LR
from mima.analysis.gradients.compute import (
    GradientSettings,
    analyse_gradients,
    epoch_gradient_stats,
    fine_tune_task,
    task_vector_cosine,
)
from mima.cli import main
from mima.data.tasks import TaskData
from mima.pools import task_pool
from tests.helpers import fit_config

TASKS = ["rot90", "mirror"]
EXAMPLES = 32


class Recording(Dataset):
    """A dataset that remembers every item it served, in order (the loader's batches, replayable)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset, self.served = dataset, []

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        item = self.dataset[index]
        self.served.append(item)
        return item

    def epochs(self, epochs: int, batch_size: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """The served items regrouped as the loader batched them: per epoch, per step (images, labels)."""
        per_epoch = len(self.served) // epochs
        assert per_epoch * epochs == len(self.served)
        result = []
        for epoch in range(epochs):
            items = self.served[epoch * per_epoch:(epoch + 1) * per_epoch]
            batches = [items[i:i + batch_size] for i in range(0, per_epoch, batch_size)]
            result.append([(torch.stack([x for x, _ in b]), torch.as_tensor([int(y) for _, y in b])) for b in batches])
        return result


def test_epoch_stats_by_hand():
    # ||g|| = (3, 1, 2), <g_k, g_1> = (9, -1, 0): shares 3/6, 1/6, 2/6; cosines 1, -1/3, 0.
    stats = epoch_gradient_stats([3.0, 1.0, 2.0], [9.0, -1.0, 0.0])
    assert stats.shares == pytest.approx([0.5, 1 / 6, 1 / 3])
    assert stats.cos_first == pytest.approx([1.0, -1 / 3, 0.0])


# ------------------------------------------------------------------ a linear encoder, by hand in numpy
IN, OUT, CLASSES, ROWS = 5, 4, 3, 20


def _linear_problem(seed: int):
    g = torch.Generator().manual_seed(seed)
    encoder = nn.Linear(IN, OUT).double()
    theta_0 = {"weight": torch.randn(OUT, IN, generator=g, dtype=torch.float64),
               "bias": torch.randn(OUT, generator=g, dtype=torch.float64)}
    head = 3.0 * torch.randn(CLASSES, OUT, generator=g, dtype=torch.float64)
    data = TensorDataset(torch.randn(ROWS, IN, generator=g, dtype=torch.float64), torch.randint(0, CLASSES, (ROWS,), generator=g))
    return encoder, theta_0, head, data


def _numpy_loss_and_gradient(w: np.ndarray, b: np.ndarray, head: np.ndarray, x: np.ndarray, y: np.ndarray):
    """Mean cross-entropy of logits = normalize(x W^T + b) H^T, and its gradient in W and b, by the chain rule."""
    f = x @ w.T + b
    length = np.linalg.norm(f, axis=1, keepdims=True)
    z = f / length
    logits = z @ head.T
    logits = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    loss = float(-np.log(p[np.arange(len(y)), y]).mean())
    d_logits = p.copy()
    d_logits[np.arange(len(y)), y] -= 1.0
    d_logits /= len(y)
    d_z = d_logits @ head
    d_f = (d_z - z * (z * d_z).sum(axis=1, keepdims=True)) / length
    return loss, d_f.T @ x, d_f.sum(axis=0)


def _numpy_fine_tune(theta_0, head, epochs_of_batches, step):
    """Replay the batches; `step(state, grads, t)` updates the weights. Returns per-epoch gradient sums,
    the weights after each epoch (index 0 = theta_0) and the mean loss per epoch."""
    w, b = theta_0["weight"].numpy().copy(), theta_0["bias"].numpy().copy()
    state: dict = {}
    weights, sums, losses, t = [(w.copy(), b.copy())], [], [], 0
    for batches in epochs_of_batches:
        g_w, g_b, total = np.zeros_like(w), np.zeros_like(b), 0.0
        for x, y in batches:
            loss, d_w, d_b = _numpy_loss_and_gradient(w, b, head.numpy(), x.numpy(), y.numpy())
            g_w += d_w
            g_b += d_b
            total += loss
            t += 1
            w, b = step(state, (w, b), (d_w, d_b), t)
        sums.append(np.concatenate([g_w.ravel(), g_b.ravel()]))
        weights.append((w.copy(), b.copy()))
        losses.append(total / len(batches))
    return sums, weights, losses


def _stats(vectors: list[np.ndarray]) -> tuple[list[float], list[float], list[float]]:
    norms = [float(np.linalg.norm(v)) for v in vectors]
    shares = [n / sum(norms) for n in norms]
    cosines = [float(v @ vectors[0]) / (n * norms[0]) for v, n in zip(vectors, norms)]
    return norms, shares, cosines


def _flat(w: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.concatenate([w.ravel(), b.ravel()])


def test_sgd_epoch_gradients_match_a_numpy_fine_tune_and_the_weight_changes():
    encoder, theta_0, head, data = _linear_problem(0)
    lr, epochs, batch_size = 0.5, 3, 8
    recording = Recording(data)
    run = fine_tune_task("toy", encoder, head, recording, theta_0,
                         GradientSettings(epochs=epochs, optimizer="sgd", lr=lr, batch_size=batch_size, seed=4))
    batches = recording.epochs(epochs, batch_size)
    assert [len(b) for b in batches] == [3, 3, 3] and len(batches[0][-1][1]) == 4  # 8 + 8 + 4 rows per epoch
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(batches[0], batches[1]))  # reshuffled every epoch

    def sgd(state, params, grads, t):
        return tuple(p - lr * g for p, g in zip(params, grads))

    sums, weights, losses = _numpy_fine_tune(theta_0, head, batches, sgd)
    # SGD without momentum: the epoch's summed gradient is exactly the weight change over -lr
    changes = [(_flat(*weights[k]) - _flat(*weights[k + 1])) / lr for k in range(epochs)]
    for summed, change in zip(sums, changes):
        np.testing.assert_allclose(summed, change, rtol=1e-9, atol=1e-12)
    norms, shares, cosines = _stats(changes)
    assert run.stats.norms == pytest.approx(norms, rel=1e-9)
    assert run.stats.shares == pytest.approx(shares, rel=1e-9)
    assert run.stats.cos_first == pytest.approx(cosines, rel=1e-9, abs=1e-12)
    assert max(abs(s - 1 / epochs) for s in shares) > 0.01 and cosines[1] < 0.999  # not the trivial case
    assert run.train_loss == pytest.approx(losses, rel=1e-10)
    assert run.steps_per_epoch == 3
    np.testing.assert_allclose(_flat(run.one_epoch["weight"].numpy(), run.one_epoch["bias"].numpy()), _flat(*weights[1]),
                               rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(_flat(run.converged["weight"].numpy(), run.converged["bias"].numpy()), _flat(*weights[-1]),
                               rtol=1e-10, atol=1e-12)


def test_adamw_epoch_gradients_are_the_raw_gradients_not_the_updates():
    encoder, theta_0, head, data = _linear_problem(1)
    lr, weight_decay, epochs, batch_size = 0.05, 0.1, 3, 6
    recording = Recording(data)
    run = fine_tune_task("toy", encoder, head, recording, theta_0,
                         GradientSettings(epochs=epochs, optimizer="adamw", lr=lr, weight_decay=weight_decay,
                                          batch_size=batch_size, seed=2))
    beta1, beta2, eps = 0.9, 0.999, 1e-8

    def adamw(state, params, grads, t):  # decoupled weight decay (Loshchilov & Hutter), torch's defaults
        updated = []
        for index, (p, g) in enumerate(zip(params, grads)):
            m, v = state.get(index, (np.zeros_like(p), np.zeros_like(p)))
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            state[index] = (m, v)
            p = p * (1 - lr * weight_decay)
            updated.append(p - lr / (1 - beta1**t) * m / (np.sqrt(v) / math.sqrt(1 - beta2**t) + eps))
        return tuple(updated)

    sums, weights, _ = _numpy_fine_tune(theta_0, head, recording.epochs(epochs, batch_size), adamw)
    norms, shares, cosines = _stats(sums)
    assert run.stats.norms == pytest.approx(norms, rel=1e-8)
    assert run.stats.shares == pytest.approx(shares, rel=1e-8)
    assert run.stats.cos_first == pytest.approx(cosines, rel=1e-8, abs=1e-10)
    np.testing.assert_allclose(run.converged["weight"].numpy(), weights[-1][0], rtol=1e-8, atol=1e-10)
    # AdamW's updates are not -lr g: the weight changes would give other numbers
    update_norms = [float(np.linalg.norm(_flat(*weights[k]) - _flat(*weights[k + 1]))) / lr for k in range(epochs)]
    assert abs(update_norms[0] - norms[0]) > 0.05 * norms[0]


def _hand_sgd_step(model, params: dict, head: torch.Tensor, x, y, lr: float) -> dict:
    """One SGD step on the cross-entropy of normalised features against the head, written out; the gradients."""
    features = model(x)
    logits = (features / features.norm(dim=1, keepdim=True)) @ head.T
    loss = -torch.log_softmax(logits, dim=1)[torch.arange(len(y)), y].mean()
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
    with torch.no_grad():
        for name, p in params.items():
            p -= lr * grads[name]
    return grads


def test_batchnorm_keeps_theta_0_statistics_while_its_affine_weights_train():
    g = torch.Generator().manual_seed(5)
    encoder = nn.Sequential(nn.Linear(IN, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, OUT)).double()
    theta_0 = {k: torch.randn(v.shape, generator=g, dtype=torch.float64) if v.is_floating_point() else v.clone()
               for k, v in encoder.state_dict().items()}
    theta_0["1.running_var"] = theta_0["1.running_var"].abs() + 0.5
    head = 3.0 * torch.randn(CLASSES, OUT, generator=g, dtype=torch.float64)
    data = TensorDataset(torch.randn(ROWS, IN, generator=g, dtype=torch.float64), torch.randint(0, CLASSES, (ROWS,), generator=g))
    lr, epochs, batch_size = 0.3, 2, 5
    recording = Recording(data)
    run = fine_tune_task("toy", encoder, head, recording, theta_0,
                         GradientSettings(epochs=epochs, lr=lr, batch_size=batch_size, seed=1))

    # reference: the whole model in eval mode (BatchNorm normalises with theta_0's running statistics),
    # the loss written out, plain gradient steps
    model = copy.deepcopy(encoder).requires_grad_(True)
    model.load_state_dict(theta_0)
    model.eval()
    params = dict(model.named_parameters())
    sums = []
    for batches in recording.epochs(epochs, batch_size):
        total = {name: torch.zeros_like(p) for name, p in params.items()}
        for x, y in batches:
            for name, grad in _hand_sgd_step(model, params, head, x, y, lr).items():
                total[name] += grad
        sums.append(torch.cat([t.flatten() for t in total.values()]).numpy())
    norms, shares, cosines = _stats(sums)
    assert run.stats.norms == pytest.approx(norms, rel=1e-9)
    assert run.stats.cos_first == pytest.approx(cosines, rel=1e-9, abs=1e-12)
    for key in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.equal(run.converged[key], theta_0[key])  # statistics untouched
    for name, p in params.items():
        torch.testing.assert_close(run.converged[name], p.detach(), rtol=1e-10, atol=1e-12)
    assert not torch.equal(run.converged["1.weight"], theta_0["1.weight"])  # the affine part did train
    # with batch statistics the first step's loss would differ: the check above tells the two apart
    x, y = recording.epochs(epochs, batch_size)[0][0]
    model.load_state_dict(theta_0)
    assert not torch.allclose(model.train()(x), model.eval()(x))


def test_task_vector_cosine_against_flattened_numpy():
    g = torch.Generator().manual_seed(3)
    base = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g), "n": torch.tensor([7])}
    one = {k: v + torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in base.items()}
    two = {k: v + torch.randn(v.shape, generator=g) if v.is_floating_point() else v + 1 for k, v in base.items()}
    ta = np.concatenate([(one[k].double() - base[k].double()).numpy().ravel() for k in ("a", "b")])
    tb = np.concatenate([(two[k].double() - base[k].double()).numpy().ravel() for k in ("a", "b")])
    expected = float(ta @ tb / (np.linalg.norm(ta) * np.linalg.norm(tb)))
    assert task_vector_cosine(one, two, base) == pytest.approx(expected, rel=1e-12)  # integer buffers ignored


# ------------------------------------------------------------------------------ the small CLIP
@pytest.fixture(scope="module")
def pool(small_clip, tmp_path_factory):
    return task_pool(fit_config(tmp_path_factory.mktemp("pool"), small_clip, TASKS, steps=2, iterations=1))


def _hand_accuracy(encoder, head, dataset) -> float:
    encoder.eval()
    with torch.no_grad():
        correct = 0
        for x, y in DataLoader(dataset, batch_size=200):
            features = encoder(x)
            correct += int((((features / features.norm(dim=1, keepdim=True)) @ head.T).argmax(1) == y).sum())
    return correct / len(dataset)


def _hand_sgd(encoder, head, theta_0, epochs_of_batches, lr):
    """Plain SGD written out (autograd of the loss written out, then p <- p - lr g, as torch.optim.SGD
    applies it); the weights after each epoch, theta_0 first."""
    model = copy.deepcopy(encoder).requires_grad_(True)
    model.load_state_dict(theta_0)
    model.train()
    params = dict(model.named_parameters())
    snapshots = [{k: v.clone() for k, v in theta_0.items()}]
    for batches in epochs_of_batches:
        for x, y in batches:
            _hand_sgd_step(model, params, head, x, y, lr)
        snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return snapshots


def test_analysis_on_a_small_clip_matches_a_hand_fine_tune_and_a_hand_merge(pool):
    theta_0 = {k: v.detach().clone() for k, v in pool.encoder.state_dict().items()}
    lr, epochs, batch_size = 0.02, 2, 8
    recordings = {task: Recording(pool.splits[task].train) for task in TASKS}
    recorded = dataclasses.replace(pool, splits={t: TaskData(recordings[t], s.val, s.test) for t, s in pool.splits.items()
                                                 if t in recordings})
    settings = GradientSettings(epochs=epochs, lr=lr, batch_size=batch_size, train_examples=EXAMPLES)
    results = analyse_gradients(recorded, TASKS, theta_0, settings)
    assert results["tasks"] == TASKS
    keys = [k for k, v in theta_0.items() if v.is_floating_point()]

    def flat(a, b):
        return torch.cat([(a[k].double() - b[k].double()).flatten() for k in keys])

    trained = {}
    for task in TASKS:
        row = results["per_task"][task]
        assert row["steps_per_epoch"] == 4 and row["train_examples"] == EXAMPLES
        head = pool.heads[task]
        batches = recordings[task].epochs(epochs, batch_size)
        assert sum(len(y) for _, y in batches[0]) == EXAMPLES
        trained[task] = weights = _hand_sgd(pool.encoder, head, theta_0, batches, lr)
        # SGD: g_k = (theta_(k-1) - theta_k) / lr, from the weights trained here (float32: a few digits lost)
        steps = [flat(weights[k], weights[k + 1]) / lr for k in range(epochs)]
        norms = [float(s.norm()) for s in steps]
        assert row["gradient_norm"] == pytest.approx(norms, rel=2e-3)
        assert row["share"] == pytest.approx([n / sum(norms) for n in norms], rel=2e-3)
        cos = float(steps[1] @ steps[0] / (norms[0] * norms[1]))
        assert row["cos_first"][1] == pytest.approx(cos, abs=2e-3)
        assert -1.0 <= cos < 0.999  # epoch 2 is not a copy of epoch 1
        tau_one, tau_all = flat(weights[1], theta_0), flat(weights[-1], theta_0)
        assert row["cos_tau_one_epoch_converged"] == pytest.approx(float(tau_one @ tau_all / (tau_one.norm() * tau_all.norm())),
                                                                   abs=1e-4)
        for name, state in (("zero_shot", theta_0), ("one_epoch", weights[1]), ("converged", weights[-1])):
            pool.encoder.load_state_dict(state)
            assert row["test_accuracy"][name] == pytest.approx(_hand_accuracy(pool.encoder, head, pool.splits[task].test))

    # task arithmetic theta_0 + lam sum_t tau_t of the hand-trained models: lam is the first best on val
    grid = [round(0.05 * i, 2) for i in range(21)]
    for name, index in (("one_epoch", 1), ("converged", epochs)):
        states = [trained[task][index] for task in TASKS]

        def merge(lam):
            return {k: (v + lam * sum(s[k] - v for s in states)) if v.is_floating_point() else v for k, v in theta_0.items()}

        def mean_accuracy(state, split):
            pool.encoder.load_state_dict(state)
            return sum(_hand_accuracy(pool.encoder, pool.heads[t], getattr(pool.splits[t], split)) for t in TASKS) / len(TASKS)

        val = [mean_accuracy(merge(lam), "val") for lam in grid]
        merged = results["merged"][name]
        assert merged["lam"] == grid[int(np.argmax(val))]
        assert merged["val_mean"] == pytest.approx(max(val), abs=1e-6)
        pool.encoder.load_state_dict(merge(merged["lam"]))
        hand = {t: _hand_accuracy(pool.encoder, pool.heads[t], pool.splits[t].test) for t in TASKS}
        assert merged["test"] == pytest.approx(hand, abs=1e-6)
        assert merged["test_mean"] == pytest.approx(sum(hand.values()) / len(hand), abs=1e-6)
    pool.encoder.load_state_dict(theta_0)


def test_cli_on_a_run_folder_and_one_line_errors(tmp_path, small_clip, capsys):
    from mima.commands.fit.run import run_fit

    run = run_fit(fit_config(tmp_path / "run", small_clip, TASKS, steps=2, iterations=1)).run_dir
    out = tmp_path / "out"
    argv = ["analyze", "gradients", str(run), "--epochs", "2", "--train-examples", "16", "--batch-size", "8", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "task arithmetic of 1-epoch task vectors" in printed and " s\n" in printed
    results = json.loads((out / "gradients.json").read_text())
    assert (out / "gradients.png").stat().st_size > 10_000
    assert results["settings"]["lr"] == DEFAULT_LR["sgd"] and results["settings"]["epochs"] == 2
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
