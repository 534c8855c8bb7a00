"""The data-dependent merges (AdaMerging, FW-Merging, Fisher merging, RegMean, RegMean++), each against a
hand or numpy computation: on tiny models and a tiny task pool, and on the small CLIP with the digits
tasks' pool (tests/conftest.py's `digits_pool` and `clip_task_models`).

The tiny pool (TinyPool, tests/helpers.py) is not mima.pools.TaskPool: strategies must work with any
object of the shape of mima.merging.pool.Pool (tasks, heads, encoder, loader, examples, logits). Its
train splits hold exactly the number of calibration examples asked for, so the examples a strategy
sees are known.
"""

from __future__ import annotations

import json

import numpy as np
import open_clip
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mima.cli import main
from mima.core.errors import MimaError
from mima.core.safetensors_io import load_state_dict
from mima.merging import get_method
from mima.merging.fisher import diagonal_fisher
from mima.merging.fw_merging import CANDIDATE_INITIAL
from mima.merging.pool import Pool
from mima.merging.regmean import regmean_weight
from mima.merging.selection import merge_with_defaults
from mima.pools import task_pool
from tests.helpers import assert_merge_flags_refused
from tests.helpers import TinyPool, block_models, random_splits, save_models, state_of

TASKS = ["rot90", "mirror"]


@pytest.fixture
def pool(digits_pool):
    """The small CLIP's pool of the digits tasks TASKS."""
    return digits_pool


@pytest.fixture
def task_models(clip_task_models):
    """theta_0 of the pool's encoder and two perturbed copies standing in for fine-tuned task models."""
    return clip_task_models.base, clip_task_models.models


def test_the_tiny_pool_has_the_shape_strategies_rely_on():
    pool = TinyPool(nn.Linear(2, 2), {"a": torch.eye(2)}, {"a": random_splits(torch.Generator().manual_seed(0), 2, 2, 4)})
    assert isinstance(pool, Pool)


# -------------------------------------------------------------------------------------- AdaMerging
def test_adamerging_lowers_the_prediction_entropy(pool, task_models):
    base, models = task_models
    for granularity in ("task", "layer"):
        note = get_method("adamerging").merge(models, base, pool=pool, granularity=granularity, steps=25, lr=0.01).notes
        assert note["entropy_after"] < note["entropy_before"], note
        coefficients = np.array(note["coefficients"])
        assert coefficients.shape[1] == 2 and coefficients.min() >= 0 and coefficients.max() <= 1


def test_adamerging_merges_a_batchnorm_encoder_its_statistics_by_the_mean_coefficients(batchnorm_clip):
    """BatchNorm's running statistics are buffers, not parameters: they take the mean of the learnt
    coefficients, detached (batch_norm refuses statistics that carry a gradient; the offline suite's
    MobileNetV2 failed so). Checked against the merge written out from the coefficients noted."""
    bn_pool = task_pool({"model": {"clip": batchnorm_clip, "pretrained": None}, "data": {"suite": "digits", "tasks": TASKS}})
    base = {k: v.detach().clone() for k, v in bn_pool.encoder.state_dict().items()}
    models = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        models.append({k: v + 0.05 * torch.rand(v.shape, generator=g) if v.is_floating_point() else v for k, v in base.items()})
    buffers = [k for k in base if "running_" in k]
    assert buffers and all(k not in dict(bn_pool.encoder.named_parameters()) for k in buffers)
    output = get_method("adamerging").merge(models, base, pool=bn_pool, granularity="layer", steps=3, lr=0.01)
    layers, coefficients = output.notes["layers"], torch.tensor(output.notes["coefficients"])
    assert not set(buffers) & set(layers)  # a coefficient per parameter only
    mean_row = coefficients.mean(dim=0)
    for key in buffers:
        expected = base[key] + sum(mean_row[t] * (models[t][key] - base[key]) for t in range(2))
        assert torch.allclose(output.state[key], expected, atol=1e-6), key
    key = layers[0]
    expected = base[key] + sum(coefficients[0, t] * (models[t][key] - base[key]) for t in range(2))
    assert torch.allclose(output.state[key], expected, atol=1e-6)
    cart = get_method("adamerging_cart").merge(models, base, pool=bn_pool, granularity="task", steps=2, lr=0.01,
                                               matrix_keys="head.proj.weight")
    assert not set(buffers) & set(cart.notes.get("layers", [])) and all(torch.isfinite(cart.state[k]).all() for k in buffers)


# -------------------------------------------------------------------------------------- FW-Merging
def _linear_pool(seed: int, tasks: int, train: int):
    """A Linear(3 -> 2) encoder, `tasks` heads of 3 classes, base and one perturbed model per task."""
    g = torch.Generator().manual_seed(seed)
    encoder = nn.Linear(3, 2)
    heads = {f"t{i}": torch.randn(3, 2, generator=g) for i in range(tasks)}
    pool = TinyPool(encoder, heads, {task: random_splits(g, 3, 3, train=train) for task in heads})
    base = {"weight": torch.randn(2, 3, generator=g), "bias": torch.randn(2, generator=g)}
    models = [{k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(tasks)]
    return pool, base, models


def _numpy_gradient(pool: TinyPool, theta: dict[str, np.ndarray], tasks) -> dict[str, np.ndarray]:
    """Gradient of the mean cross-entropy over each task's train split (all of it), summed over tasks:
    logits z = H (W x + b), dL/dz = softmax(z) - onehot(y)."""
    grad = {"weight": np.zeros_like(theta["weight"]), "bias": np.zeros_like(theta["bias"])}
    for task in tasks:
        x, y = (t.double().numpy() for t in pool.data[task]["train"])
        head = pool.heads[task].double().numpy()
        z = (x @ theta["weight"].T + theta["bias"]) @ head.T
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y.astype(int)] -= 1
        dfeatures = p @ head / (len(y) * len(tasks))
        grad["weight"] += dfeatures.T @ x
        grad["bias"] += dfeatures.sum(axis=0)
    return grad


def _alignment(grad: dict[str, np.ndarray], vertex: dict[str, np.ndarray]) -> float:
    """sum over tensors of cos(grad, vertex): the smallest is the vertex most aligned with -grad."""
    total = 0.0
    for key, value in grad.items():
        norms = np.linalg.norm(value) * np.linalg.norm(vertex[key])
        total += float((value * vertex[key]).sum() / norms) if norms > 0 else 0.0
    return total


def _np(state) -> dict[str, np.ndarray]:
    return {k: v.double().numpy() for k, v in state.items()}


def test_fw_soft_picks_the_vertices_most_aligned_with_each_tasks_negative_gradient():
    pool, base, models = _linear_pool(seed=15, tasks=3, train=6)
    output = get_method("fw_merging").merge(models, base, pool, mode="soft", iterations=2, examples=6, ada_steps=3, lr=0.05)
    notes = output.notes
    assert notes["mode"] == "soft" and len(notes["steps"]) == 2
    vertices = [_np(m) for m in models]
    theta = _np(base)  # soft starts from theta_0

    def picks_by(gradient_tasks) -> list[int]:  # each task in turn picks its best vertex not taken yet
        picks: list[int] = []
        for task in pool.tasks:
            scores = [_alignment(_numpy_gradient(pool, theta, gradient_tasks(task)), v) for v in vertices]
            picks.append(min((i for i in range(len(vertices)) if i not in picks), key=scores.__getitem__))
        return picks

    for t, step in enumerate(notes["steps"]):
        picks = picks_by(lambda task: [task])  # each task's own gradient
        if t == 0:  # this example tells the rule apart from the obvious alternatives
            assert picks != [0, 1, 2] and picks != picks_by(lambda task: pool.tasks)
        assert step["vertices"] == [pool.tasks[i] for i in picks]
        # theta moves to theta + sum_j c[l, j] (s_j - theta), with the learnt layer-wise coefficients
        coefficients = dict(zip(step["layers"], np.array(step["coefficients"], dtype=np.float64)))
        theta = {key: theta[key] + sum(c * (vertices[p][key] - theta[key]) for c, p in zip(coefficients[key], picks))
                 for key in theta}
    for key in theta:
        np.testing.assert_allclose(output.state[key].numpy(), theta[key], rtol=1e-5, atol=1e-6)
    # ada_steps and lr are used: each AdaMerging run draws 2 probe batches and 2 per step from each
    # task's test split; its first coefficients start at 0.3 and moved
    assert all(pool.drawn[(task, "test")] == 2 * 2 * (3 + 1) for task in pool.tasks)
    assert not np.allclose(notes["steps"][0]["coefficients"], 0.3)


def test_fw_soft_coefficients_stay_at_the_start_when_lr_is_negligible():
    pool, base, models = _linear_pool(seed=5, tasks=2, train=4)
    output = get_method("fw_merging").merge(models, base, pool, mode="soft", iterations=1, examples=4, ada_steps=1, lr=1e-30)
    step = output.notes["steps"][0]
    assert np.all(np.array(step["coefficients"]) == np.float32(0.3))
    picks = [pool.tasks.index(name) for name in step["vertices"]]
    for key in base:  # theta_0 + 0.3 * sum_j (s_j - theta_0), by hand
        expected = base[key].double() + 0.3 * sum(models[p][key].double() - base[key].double() for p in picks)
        np.testing.assert_allclose(output.state[key].numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)


def test_fw_hard_task_arithmetic_start_uses_lam_for_the_start_and_the_step():
    pool, base, models = _linear_pool(seed=6, tasks=2, train=5)
    lam, step_size = 0.6, 0.5
    output = get_method("fw_merging").merge(models, base, pool, start="task_arithmetic", iterations=1, examples=5,
                                            lam=lam, step_size=step_size)
    start = {k: base[k].double().numpy() + lam * sum(m[k].double().numpy() - base[k].double().numpy() for m in models)
             for k in base}
    vertices = [*(_np(m) for m in models), start]  # the fine-tuned models and the initial merge
    grad = _numpy_gradient(pool, start, pool.tasks)
    pick = int(np.argmin([_alignment(grad, v) for v in vertices]))
    assert output.notes["steps"][0]["vertex"] == [*pool.tasks, "initial merge"][pick]
    gamma = 2 / (0 + 2) * step_size * lam
    for key in base:
        np.testing.assert_allclose(output.state[key].numpy(), start[key] + gamma * (vertices[pick][key] - start[key]),
                                   rtol=1e-5, atol=1e-6)
    assert "start_adamerging" not in output.notes and pool.drawn[("t0", "test")] == 0


def test_fw_hard_adamerging_start_uses_ada_steps_and_lr():
    for ada_steps, lr in ((2, 1e-30), (4, 0.05)):
        pool, base, models = _linear_pool(seed=7, tasks=2, train=4)
        output = get_method("fw_merging").merge(models, base, pool, iterations=1, examples=4, ada_steps=ada_steps, lr=lr)
        start = np.array(output.notes["start_adamerging"]["coefficients"])
        assert all(pool.drawn[(task, "test")] == 2 * (ada_steps + 1) for task in pool.tasks)
        assert np.all(start == np.float32(0.3)) == (lr == 1e-30)


@pytest.mark.parametrize(
    "given, fragments",
    [
        ({"mode": "soft", "lam": 0.5}, ["lam is not used with mode=soft"]),
        ({"mode": "soft", "step_size": 0.2}, ["step_size is not used with mode=soft"]),
        ({"mode": "soft", "start": "pretrained"}, ["start is not used with mode=soft"]),
        ({"start": "pretrained", "ada_steps": 10}, ["ada_steps is not used with mode=hard, start=pretrained"]),
        ({"start": "task_arithmetic", "lr": 0.1}, ["lr is not used with mode=hard, start=task_arithmetic"]),
        ({"mode": "soft", "iterations": 0}, ["iterations must be a positive whole number, got 0"]),
    ],
)
def test_fw_rejects_hyperparameters_its_mode_does_not_use(given, fragments):
    pool, base, models = _linear_pool(seed=8, tasks=2, train=4)
    with pytest.raises(MimaError) as error:
        get_method("fw_merging").merge(models, base, pool, **given)
    assert all(fragment in str(error.value) for fragment in fragments), str(error.value)
    assert sum(pool.drawn.values()) == 0  # refused before any work


def test_fw_reports_only_the_hyperparameters_its_mode_uses():
    method = get_method("fw_merging")
    assert set(method.hyperparameters({"mode": "soft"})) == {"mode", "iterations", "examples", "ada_steps", "lr"}
    assert set(method.hyperparameters({"start": "pretrained"})) == {"mode", "iterations", "step_size", "lam", "examples", "start"}


def _independent_gradient(pool, clip: str, weights: dict, examples: int) -> dict[str, torch.Tensor]:
    """Cross-entropy gradient with a real module holding `weights` (not functional_call)."""
    encoder = open_clip.create_model(clip).visual
    encoder.load_state_dict(weights)
    total = {n: torch.zeros_like(p) for n, p in encoder.named_parameters()}
    for task in pool.tasks:
        encoder.zero_grad()
        loss = 0
        for images, labels in pool.examples(task, "train", examples):
            features = F.normalize(encoder(images), dim=-1)
            loss = loss + F.cross_entropy(features @ pool.heads[task].T, labels, reduction="sum")
        (loss / (examples * len(pool.tasks))).backward()
        for n, p in encoder.named_parameters():
            total[n] += p.grad
    return total


def test_fw_hard_first_step_goes_to_the_vertex_most_aligned_with_the_negative_gradient(pool, task_models, small_clip):
    base, models = task_models
    output = get_method("fw_merging").merge(models, base, pool=pool, iterations=1, start="pretrained", examples=8,
                                            step_size=0.5, lam=1.0)
    merged = output.state
    gradient = _independent_gradient(pool, small_clip, base, 8)
    vertices = [*models, base]  # the initial merge is theta_0 here

    def cosine(a: np.ndarray, b: np.ndarray) -> float:  # 0 against a zero vector (theta_0 has zero biases)
        norms = np.linalg.norm(a) * np.linalg.norm(b)
        return float(np.dot(a.ravel(), b.ravel()) / norms) if norms > 0 else 0.0

    scores = [sum(cosine(g.numpy(), v[k].float().numpy()) for k, g in gradient.items()) for v in vertices]
    pick = int(np.argmin(scores))
    assert output.notes["steps"][0]["vertex"] == [*TASKS, CANDIDATE_INITIAL][pick]
    gamma = 2.0 / 2 * 0.5 * 1.0  # 2 / (t + 2) * step_size * lam at t = 0
    for key in gradient:
        expected = base[key] + gamma * (vertices[pick][key] - base[key])
        torch.testing.assert_close(merged[key], expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ Fisher
class TwoParameters(nn.Module):
    """f(x) = w x + b + shift: two parameters and one buffer (buffers are averaged, not Fisher-weighted)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.b = nn.Parameter(torch.zeros(1))
        self.register_buffer("shift", torch.zeros(1))

    def forward(self, x):
        return self.w * x + self.b + self.shift


def test_fisher_merge_is_the_normalised_fisher_weighted_average_computed_by_hand():
    # Two classes with head [[1], [-1]]: logits (f, -f), p0 = sigmoid(2 f). d log p0 / df = 2 p1,
    # d log p1 / df = -2 p0, so the Fisher of f is p0 (2 p1)^2 + p1 (2 p0)^2 = 4 p0 p1, and by the
    # chain rule F_w = mean_x 4 p0 p1 x^2, F_b = mean_x 4 p0 p1 (the buffer is no parameter).
    head = torch.tensor([[1.0], [-1.0]])
    xs = {"a": [0.5, -1.0, 2.0], "b": [1.5, 0.25, -0.75]}
    data = {task: {"train": (torch.tensor(x).reshape(-1, 1), torch.zeros(len(x), dtype=torch.long))} for task, x in xs.items()}
    models = [
        {"w": torch.tensor([0.8]), "b": torch.tensor([-0.3]), "shift": torch.tensor([0.1])},
        {"w": torch.tensor([-0.4]), "b": torch.tensor([0.6]), "shift": torch.tensor([-0.5])},
    ]
    pool = TinyPool(TwoParameters(), {"a": head, "b": head}, data)
    output = get_method("fisher").merge(models, None, pool, examples=3)

    fishers, norms = [], []
    for model, task in zip(models, ("a", "b")):
        x = np.array(xs[task], dtype=np.float64)
        f = float(model["w"]) * x + float(model["b"]) + float(model["shift"])
        p0 = 1 / (1 + np.exp(-2 * f))
        fisher = {"w": np.mean(4 * p0 * (1 - p0) * x**2), "b": np.mean(4 * p0 * (1 - p0))}
        fishers.append(fisher)
        norms.append(np.sqrt(fisher["w"] ** 2 + fisher["b"] ** 2))
    for key in ("w", "b"):
        weights = [(fisher[key] + 1e-6) / norm for fisher, norm in zip(fishers, norms)]  # w_t (F_t + floor), w_t = 1 / ||F_t||
        expected = sum(w * float(m[key]) for w, m in zip(weights, models)) / sum(weights)
        assert float(output.state[key]) == pytest.approx(expected, rel=1e-5)
    assert float(output.state["shift"]) == pytest.approx(-0.2)  # a buffer: the plain average
    assert output.notes["fisher_norms"] == pytest.approx(dict(zip(("a", "b"), norms)), rel=1e-5)
    # the selection wrappers carry the notes on
    assert merge_with_defaults(get_method("fisher"), models, None, pool=pool).notes.keys() == {"fisher_norms"}


def test_diagonal_fisher_equals_the_expectation_over_classes(pool, task_models):
    base, models = task_models
    keys = ["proj", "ln_post.weight"]
    fisher = diagonal_fisher(pool, models[0], keys, "rot90", examples=3)
    params = {k: models[0][k].float() for k in keys}
    expected = {k: torch.zeros_like(v) for k, v in params.items()}
    for images, _ in pool.examples("rot90", "train", 3, batch_size=1):
        def log_probs(p):
            return pool.logits({**models[0], **p}, "rot90", images).log_softmax(dim=1)[0]
        jacobian = torch.func.jacrev(log_probs)(params)  # [classes, *param]
        probs = log_probs(params).exp().detach()
        for k in keys:
            expected[k] += (probs.reshape(-1, *[1] * params[k].ndim) * jacobian[k].pow(2)).sum(0)
    for k in keys:
        torch.testing.assert_close(fisher[k], expected[k] / 3, rtol=1e-4, atol=1e-9)


# ----------------------------------------------------------------------------------------- RegMean
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


def test_regmean_on_a_two_layer_network_matches_numpy():
    g = torch.Generator().manual_seed(3)
    encoder = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    heads = {"a": torch.randn(2, 3, generator=g), "b": torch.randn(2, 3, generator=g)}
    data = {task: random_splits(g, 4, 2, train=10) for task in heads}
    base = state_of(encoder)
    models = [{k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(2)]
    output = get_method("regmean").merge(models, base, TinyPool(encoder, heads, data), examples=10, alpha=0.6)

    def reduce(gram):  # off-diagonal entries scaled by alpha
        return gram * (0.6 + 0.4 * np.eye(len(gram)))

    grams = {"0.weight": [], "2.weight": []}
    for model, task in zip(models, heads):
        x = data[task]["train"][0].double().numpy()
        hidden = np.tanh(x @ model["0.weight"].double().numpy().T + model["0.bias"].double().numpy())
        grams["0.weight"].append(reduce(x.T @ x / len(x)))  # the inputs of each layer, through model t
        grams["2.weight"].append(reduce(hidden.T @ hidden / len(hidden)))
    for key, gram in grams.items():
        rhs = sum(g_t @ m[key].double().numpy().T for g_t, m in zip(gram, models))
        expected = np.linalg.solve(sum(gram), rhs).T
        np.testing.assert_allclose(output.state[key].numpy(), expected, rtol=1e-4, atol=1e-5)
    for key in ("0.bias", "2.bias"):
        np.testing.assert_allclose(output.state[key].numpy(), (models[0][key] + models[1][key]).numpy() / 2, rtol=1e-6)
    assert output.notes == {"linear_layers": ["0.weight", "2.weight"]}


def test_regmean_merges_the_linear_layers_that_run_and_averages_the_rest(pool, task_models):
    base, models = task_models
    output = get_method("regmean").merge(models, base, pool=pool, examples=16)
    merged, layers = output.state, output.notes["linear_layers"]
    assert layers and all(name.endswith(("mlp.c_fc.weight", "mlp.c_proj.weight")) for name in layers)
    for key in ("proj", "transformer.resblocks.0.attn.in_proj_weight", "transformer.resblocks.0.mlp.c_fc.bias"):
        torch.testing.assert_close(merged[key], (models[0][key] + models[1][key]) / 2)
    assert not torch.allclose(merged[layers[0]], (models[0][layers[0]] + models[1][layers[0]]) / 2)


# --------------------------------------------------------------------------------------- RegMean++
class Block(nn.Module):
    """x + fc2(tanh(fc1(x))): two linear layers inside one residual block."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 5), nn.Linear(5, 4)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(3, 4)  # outside the blocks: averaged
        self.resblocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        h = self.stem(x)
        for block in self.resblocks:
            h = block(h)
        return h


def _regmean_solve(grams, weights, alpha):
    reduced = [g * (alpha + (1 - alpha) * np.eye(len(g))) for g in grams]
    return np.linalg.solve(sum(reduced), sum(r @ w.T for r, w in zip(reduced, weights))).T


def test_regmean_plus_plus_propagates_through_the_merged_blocks_below():
    g = torch.Generator().manual_seed(8)
    encoder = TwoBlocks()
    heads = {"a": torch.randn(2, 4, generator=g), "b": torch.randn(2, 4, generator=g)}
    data = {task: {"train": (torch.randn(12, 3, generator=g), torch.zeros(12, dtype=torch.long))} for task in heads}
    base = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
    models = [{k: v + 0.4 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(2)]
    output = get_method("regmean_plus_plus").merge(models, None, TinyPool(encoder, heads, data), examples=12, alpha=0.7)

    w = [{k: v.double().numpy() for k, v in m.items()} for m in models]
    mean = {k: (w[0][k] + w[1][k]) / 2 for k in w[0]}
    expected = dict(mean)
    # inputs of block 0: each task's data through the averaged stem
    hidden = [data[t]["train"][0].double().numpy() @ mean["stem.weight"].T + mean["stem.bias"] for t in heads]
    for block in (0, 1):
        p = f"resblocks.{block}."
        grams1, grams2 = [], []
        for h, m in zip(hidden, w):  # task t's own block on inputs from the merged blocks below
            inner = np.tanh(h @ m[p + "fc1.weight"].T + m[p + "fc1.bias"])
            grams1.append(h.T @ h / len(h))
            grams2.append(inner.T @ inner / len(inner))
        expected[p + "fc1.weight"] = _regmean_solve(grams1, [m[p + "fc1.weight"] for m in w], 0.7)
        expected[p + "fc2.weight"] = _regmean_solve(grams2, [m[p + "fc2.weight"] for m in w], 0.7)
        hidden = [h + np.tanh(h @ expected[p + "fc1.weight"].T + mean[p + "fc1.bias"]) @ expected[p + "fc2.weight"].T
                  + mean[p + "fc2.bias"] for h in hidden]  # through the merged block
    for key, value in expected.items():
        np.testing.assert_allclose(output.state[key].numpy(), value, rtol=1e-4, atol=1e-5, err_msg=key)
    assert output.notes == {"linear_layers": [f"resblocks.{b}.fc{i}.weight" for b in (0, 1) for i in (1, 2)], "blocks": 2}
    # plain RegMean (each model's own inputs) gives another second block: the check above has teeth
    plain = get_method("regmean").merge(models, None, TinyPool(encoder, heads, data), examples=12, alpha=0.7).state
    assert not np.allclose(plain["resblocks.1.fc2.weight"].numpy(), expected["resblocks.1.fc2.weight"], atol=1e-3)


def test_regmean_plus_plus_needs_blocks():
    encoder = nn.Linear(3, 2)
    pool = TinyPool(encoder, {"a": torch.eye(2)}, {"a": {"train": (torch.randn(4, 3), torch.zeros(4, dtype=torch.long))}})
    state = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
    with pytest.raises(MimaError, match="regmean_plus_plus': no tensor name matches block_keys"):
        get_method("regmean_plus_plus").merge([state, state], None, pool)


def test_regmean_plus_plus_through_the_merge_command(clip_task_models, tmp_path, capsys):
    config, models, paths = clip_task_models.config, clip_task_models.models, clip_task_models.paths
    out = tmp_path / "rpp.safetensors"
    code = main(["merge", "--method", "regmean_plus_plus", "--models", *map(str, paths), "--output", str(out),
                 "--config", str(config), "--examples", "8"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "rpp.safetensors.results.json").read_text())
    layers = report["notes"]["linear_layers"]
    assert report["notes"]["blocks"] == 2 and report["hparams"]["examples"] == 8
    assert layers and all(name.endswith(("mlp.c_fc.weight", "mlp.c_proj.weight")) for name in layers)
    written = load_state_dict(out)
    for key in ("proj", "ln_post.weight", "transformer.resblocks.1.attn.in_proj_weight", "transformer.resblocks.0.mlp.c_fc.bias"):
        torch.testing.assert_close(written[key], (models[0][key] + models[1][key]) / 2)  # averaged, not RegMean
    assert not torch.allclose(written[layers[-1]], (models[0][layers[-1]] + models[1][layers[-1]]) / 2)


# ------------------------------------------------------------------- every data-dependent strategy
def test_data_strategies_need_a_pool():
    pool, base, models = _linear_pool(seed=9, tasks=2, train=4)
    with pytest.raises(MimaError, match="needs task data"):
        get_method("adamerging")(models, base)


@pytest.mark.parametrize("flags, fragment", [
    (["--method", "regmean_plus_plus", "--alpha", "1.5"], "--alpha must be a number in [0, 1], got 1.5"),
])
def test_bad_flags_are_one_line(tmp_path, capsys, flags, fragment):
    assert_merge_flags_refused(tmp_path, capsys, flags, fragment)
