"""Data-dependent strategies on tiny models and a tiny task pool, each against a hand or numpy computation.

The pool here (TinyPool, tests/helpers.py) is not mima.pools.TaskPool: strategies must work with any
object of the shape of mima.merging.pool.Pool (tasks, heads, encoder, loader, examples, logits). Its
train splits hold exactly the number of calibration examples asked for, so the examples a strategy
sees are known.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from mima.core.errors import MimaError
from mima.merging import get_method
from mima.merging.pool import Pool
from mima.merging.selection import merge_with_defaults
from tests.helpers import TinyPool


def _data(g, inputs: int, classes: int, train: int, test: int = 24) -> dict[str, tuple]:
    return {
        "train": (torch.randn(train, inputs, generator=g), torch.randint(0, classes, (train,), generator=g)),
        "test": (torch.randn(test, inputs, generator=g), torch.randint(0, classes, (test,), generator=g)),
    }


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in module.state_dict().items()}


def test_the_tiny_pool_has_the_shape_strategies_rely_on():
    pool = TinyPool(nn.Linear(2, 2), {"a": torch.eye(2)}, {"a": _data(torch.Generator().manual_seed(0), 2, 2, 4)})
    assert isinstance(pool, Pool)


# --------------------------------------------------------------------------------- Fisher
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


# -------------------------------------------------------------------------------- RegMean
def test_regmean_on_a_two_layer_network_matches_numpy():
    g = torch.Generator().manual_seed(3)
    encoder = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    heads = {"a": torch.randn(2, 3, generator=g), "b": torch.randn(2, 3, generator=g)}
    data = {task: _data(g, 4, 2, train=10) for task in heads}
    base = _state(encoder)
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


# ------------------------------------------------------------------------ AdaMerging+CART
class MlpBlock(nn.Module):
    """One `mlp.c_fc` layer (a CART matrix key) mapping 2 inputs to 3 features."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(2, 3)

    def forward(self, x):
        return self.mlp.c_fc(x)


W, B = "mlp.c_fc.weight", "mlp.c_fc.bias"


def _cart_pool(seed: int, tasks: int) -> TinyPool:
    g = torch.Generator().manual_seed(seed)
    heads = {f"t{i}": torch.randn(4, 3, generator=g) for i in range(tasks)}
    return TinyPool(MlpBlock(), heads, {task: _data(g, 2, 4, train=8) for task in heads})


def test_adamerging_cart_with_given_coefficients_is_eq_8_by_hand():
    # Paper 000, eq. 8: theta = theta_avg + sum_t lam_t^l SVD_k(theta_t - theta_avg). Three tasks around
    # an average A (values exact in binary), 3 x 2 weight matrices, rank_ratio 0.5 -> k = max(1, floor(1)) = 1:
    #   D1 = [[2, 0], [0, 0], [0, 0]]   SVD_1(D1) = D1
    #   D2 = [[0, 0], [0, 1], [0, 0]]   SVD_1(D2) = D2
    #   D3 = -D1 - D2                   SVD_1(D3) = [[-2, 0], [0, 0], [0, 0]] (singular values 2 > 1)
    # With every coefficient at the prior p (lr so small that Adam cannot move them), the merged
    # weight is A + p (D1 + D2 - 2 e11) = A + p e22. Biases keep their full centered differences,
    # which sum to zero: the average bias.
    average = torch.tensor([[0.5, -1.25], [2.0, 0.75], [-0.5, 1.5]])
    d1 = torch.tensor([[2.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    d2 = torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    bias = torch.tensor([0.25, -0.5, 1.0])
    offsets = [torch.tensor([0.5, 0.0, -1.0]), torch.tensor([-0.25, 0.5, 0.5]), torch.tensor([-0.25, -0.5, 0.5])]
    models = [{W: average + d, B: bias + o} for d, o in zip((d1, d2, -d1 - d2), offsets)]
    prior = 1.75
    for granularity in ("layer", "task"):
        output = get_method("adamerging_cart").merge(models, None, _cart_pool(0, 3), granularity=granularity, steps=2,
                                                     lr=1e-30, prior=prior, rank_ratio=0.5)
        expected = average.clone()
        expected[1, 1] += prior
        torch.testing.assert_close(output.state[W], expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(output.state[B], bias, rtol=0, atol=1e-6)
        rows = 2 if granularity == "layer" else 1
        assert np.array(output.notes["coefficients"]).shape == (rows, 3)
        assert np.all(np.array(output.notes["coefficients"]) == np.float32(prior))


def test_adamerging_cart_with_learnt_coefficients_is_eq_8_by_hand():
    # Two tasks: theta_1,2 = A +- D with D = [[3, 0], [0, 1], [0, 0]]; SVD_1(+-D) = +-3 e11, so
    # eq. 8 gives A + 3 (lam_1 - lam_2) e11 on the weight and a + (lam_1 - lam_2) d on the bias,
    # with each tensor's own learnt coefficients (layer-wise, reported in the notes).
    average = torch.tensor([[0.5, -1.25], [2.0, 0.75], [-0.5, 1.5]])
    d = torch.tensor([[3.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    bias, bias_offset = torch.tensor([0.25, -0.5, 1.0]), torch.tensor([0.5, -1.0, 0.25])
    models = [{W: average + d, B: bias + bias_offset}, {W: average - d, B: bias - bias_offset}]
    output = get_method("adamerging_cart").merge(models, None, _cart_pool(1, 2), steps=5, lr=0.1, rank_ratio=0.5)
    notes = output.notes
    coefficients = dict(zip(notes["layers"], np.array(notes["coefficients"], dtype=np.float64)))
    assert set(coefficients) == {W, B} and notes["granularity"] == "layer"
    for key in (W, B):
        assert np.all((coefficients[key] >= 0) & (coefficients[key] <= 3))  # clamped to CART's lam range
        assert coefficients[key][0] != coefficients[key][1]  # learnt apart, so the check below has teeth
    (w1, w2), (b1, b2) = coefficients[W], coefficients[B]
    expected_w = average.double().numpy().copy()
    expected_w[0, 0] += 3 * (w1 - w2)
    np.testing.assert_allclose(output.state[W].numpy(), expected_w, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(output.state[B].numpy(), bias.numpy() + (b1 - b2) * bias_offset.numpy(), rtol=1e-6, atol=1e-6)
    assert notes["entropy_after"] < notes["entropy_before"]


# ------------------------------------------------------------------------------ FW-Merging
def _linear_pool(seed: int, tasks: int, train: int):
    """A Linear(3 -> 2) encoder, `tasks` heads of 3 classes, base and one perturbed model per task."""
    g = torch.Generator().manual_seed(seed)
    encoder = nn.Linear(3, 2)
    heads = {f"t{i}": torch.randn(3, 2, generator=g) for i in range(tasks)}
    pool = TinyPool(encoder, heads, {task: _data(g, 3, 3, train=train) for task in heads})
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


def test_data_strategies_need_a_pool():
    pool, base, models = _linear_pool(seed=9, tasks=2, train=4)
    with pytest.raises(MimaError, match="needs task data"):
        get_method("adamerging")(models, base)
