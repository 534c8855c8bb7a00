"""Merge strategies against independent computations (numpy, hand-worked examples, known identities)."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from mima.core.errors import MimaError
from mima.merging import (HYPERPARAMETERS, MERGE_METHODS, DataFreeMerge, DataMerge, PerTaskMerge, ScaledMerge, StreamingMerge,
                          get_method)
from mima.merging.cart import DEFAULT_MATRIX_KEYS, cart_rank
from mima.merging.catalogue import STRATEGIES
from mima.merging.registry import register
from mima.merging.selection import merge_with_defaults, select_on_validation


def _models(count: int, seed: int = 0, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    base = {
        "transformer.resblocks.0.attn.in_proj_weight": torch.randn(12, 4, generator=g),
        "transformer.resblocks.0.mlp.c_fc.weight": torch.randn(8, 4, generator=g),
        "transformer.resblocks.0.mlp.c_fc.bias": torch.randn(8, generator=g),
        "positional_embedding": torch.randn(5, 4, generator=g),
        "proj": torch.randn(4, 3, generator=g),
        "counter": torch.tensor(3),
    }
    models = []
    for _ in range(count):
        models.append({k: (v + scale * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v.clone() for k, v in base.items()})
    return base, models


def test_uniform_is_the_mean():
    _, models = _models(3)
    merged = get_method("uniform")(models)
    for key in models[0]:
        if models[0][key].is_floating_point():
            np.testing.assert_allclose(merged[key], np.mean([m[key].numpy() for m in models], axis=0), rtol=1e-6, atol=1e-6)
    assert int(merged["counter"]) == 3


@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
def test_task_arithmetic_formula(lam):
    base, models = _models(4, seed=1)
    merged = get_method("task_arithmetic")(models, base, lam=lam)
    for key, value in base.items():
        if not value.is_floating_point():
            continue
        expected = value.numpy() + lam * sum(m[key].numpy() - value.numpy() for m in models)
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-5, atol=1e-5)


def test_task_arithmetic_with_one_over_t_is_the_uniform_average():
    base, models = _models(4, seed=2)
    merged = get_method("task_arithmetic")(models, base, lam=0.25)
    uniform = get_method("uniform")(models)
    for key in uniform:
        torch.testing.assert_close(merged[key], uniform[key], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------- TIES
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


# ---------------------------------------------------------------------------------- CART
@pytest.mark.parametrize(
    "shape, ratio, rank",
    [((192, 64), 0.08, 5), ((10, 10), 0.08, 1), ((100, 50), 0.32, 16), ((100, 100), 0.29, 29), ((7, 9), 1.0, 7), ((7, 9), 0.0, 0)],
)
def test_cart_rank_rule(shape, ratio, rank):
    assert cart_rank(shape, ratio) == rank


def _numpy_truncated(matrix: np.ndarray, rank: int) -> np.ndarray:
    u, s, vh = np.linalg.svd(matrix.astype(np.float64), full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vh[:rank]


@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_cart_low_rank_part_is_the_truncated_svd_of_centered_vectors(ratio):
    base, models = _models(3, seed=3)
    lam = 1.7
    merged = get_method("cart")(models, base, lam=lam, rank_ratio=ratio)
    for key, value in base.items():
        if not value.is_floating_point():
            continue
        stacked = np.stack([m[key].numpy().astype(np.float64) for m in models])
        average = stacked.mean(axis=0)
        if key.endswith(("attn.in_proj_weight", "mlp.c_fc.weight")):
            rank = max(1, int(np.floor(ratio * min(value.shape))))
            expected = average + lam * sum(_numpy_truncated(t - average, rank) for t in stacked)
        else:  # biases, positional embedding, projection: the plain average
            expected = average
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("hparams", [{"rank_ratio": 1.0, "lam": 2.3}, {"rank_ratio": 0.08, "lam": 0.0}])
def test_cart_full_rank_or_zero_lambda_is_the_uniform_average(hparams):
    base, models = _models(4, seed=4)
    merged = get_method("cart")(models, base, **hparams)
    uniform = get_method("uniform")(models)
    for key in uniform:
        torch.testing.assert_close(merged[key], uniform[key], rtol=1e-5, atol=1e-5)


def test_cart_matrix_keys_select_only_attention_and_mlp_weights():
    import re

    keys = ["transformer.resblocks.3.attn.in_proj_weight", "transformer.resblocks.3.attn.out_proj.weight",
            "transformer.resblocks.3.mlp.c_fc.weight", "transformer.resblocks.3.mlp.c_proj.weight"]
    others = ["proj", "positional_embedding", "conv1.weight", "transformer.resblocks.3.mlp.c_fc.bias", "text_projection"]
    assert all(re.search(DEFAULT_MATRIX_KEYS, k) for k in keys)
    assert not any(re.search(DEFAULT_MATRIX_KEYS, k) for k in others)


# ----------------------------------------------------------------------- registry, selection
def test_registry_errors_are_clear():
    base, models = _models(2)
    with pytest.raises(MimaError, match="unknown merge method 'avg' \\(known: ace, adamerging, "):
        get_method("avg")
    with pytest.raises(MimaError, match="merge method 'uniform' takes no hyperparameter 'lam'"):
        get_method("uniform")(models, lam=0.3)
    with pytest.raises(MimaError, match="needs the pretrained model"):
        get_method("task_arithmetic")(models, None)


def test_every_default_and_grid_value_passes_its_own_check():
    for method in MERGE_METHODS.values():
        assert set(method.defaults) <= set(HYPERPARAMETERS), method.name
        for name, value in method.defaults.items():
            assert HYPERPARAMETERS[name].accepts(value), (method.name, name, value)
        for name, values in method.grid.items():
            assert all(HYPERPARAMETERS[name].accepts(v) for v in values), (method.name, name)
            method.hyperparameters({name: values[0]})  # a grid point is a valid setting


# Values that break each kind of check: every hyperparameter must reject at least one of them.
WRONG = [float("nan"), float("inf"), -1, -0.5, 0, 1.5, 120.0, True, "bogus", "(", [], [-1.0], None]


@pytest.mark.parametrize("name", sorted(HYPERPARAMETERS))
def test_a_wrong_value_is_rejected_naming_the_option(name):
    spec = HYPERPARAMETERS[name]
    method = next(m for m in MERGE_METHODS.values() if name in m.defaults)
    rejected = [value for value in WRONG if not spec.accepts(value)]
    assert rejected, f"{name} accepts every wrong value"
    for value in rejected:
        with pytest.raises(MimaError) as error:
            method.hyperparameters({name: value})
        assert f"merge method '{method.name}': {name} must be {spec.meaning}, got {value!r}" in str(error.value)


def test_register_refuses_undeclared_or_invalid_defaults(monkeypatch):
    stream = lambda models, base, **hp: iter(())  # noqa: E731
    streaming, scaled = STRATEGIES["uniform"], STRATEGIES["task_arithmetic"]
    declarations = {"x1": replace(streaming, defaults={"colour": 1}), "x2": replace(streaming, defaults={"k": 0}),
                    "x3": replace(streaming, defaults={"lam": 1.0}, grid={"lam": (1.0, float("nan"))}),
                    "x4": replace(scaled, defaults={"k": 20.0}, grid={}), "x5": scaled}
    for name, declaration in declarations.items():
        monkeypatch.setitem(STRATEGIES, name, declaration)
    with pytest.raises(ValueError, match="hyperparameter colour is not declared"):
        register(StreamingMerge(name="x1", stream_fn=stream))
    with pytest.raises(ValueError, match="default k=0 is not a percentage"):
        register(StreamingMerge(name="x2", stream_fn=stream))
    with pytest.raises(ValueError, match="grid of lam"):
        register(StreamingMerge(name="x3", stream_fn=stream))
    with pytest.raises(ValueError, match="a ScaledMerge takes lam"):
        register(ScaledMerge(name="x4", scaled_fn=stream))
    with pytest.raises(ValueError, match="x5 is declared a scaled strategy, so it must be a ScaledMerge, not a StreamingMerge"):
        register(StreamingMerge(name="x5", stream_fn=stream))
    with pytest.raises(ValueError, match="STRATEGIES must list it"):
        register(StreamingMerge(name="unlisted", stream_fn=stream))
    assert not {"x1", "x2", "x3", "x4", "x5", "unlisted"} & set(MERGE_METHODS)


def test_each_kind_merges_through_its_own_entry_points():
    """The kinds are types: data-free ones stream, a scaled one sweeps, a per-task one reconstructs, a
    data-dependent one refuses to merge without a pool; none needs to be asked which function it holds."""
    base, models = _models(3, seed=2)
    kinds = {name: type(method) for name, method in MERGE_METHODS.items()}
    assert kinds["uniform"] is StreamingMerge and kinds["ties"] is ScaledMerge
    assert kinds["tall"] is PerTaskMerge and issubclass(kinds["fw_merging"], DataMerge)
    assert all(issubclass(kind, DataFreeMerge) == (not m.needs_data and not m.per_task)
               for kind, m in zip(kinds.values(), MERGE_METHODS.values()))
    floating = [key for key, value in base.items() if value.is_floating_point()]
    uniform = dict(get_method("uniform").stream(models))
    for key in floating:
        torch.testing.assert_close(uniform[key], sum(model[key] for model in models) / 3, rtol=0, atol=1e-6)
    ta = get_method("task_arithmetic")
    (setting, anchor, direction), = ta.sweep(models, base, {})
    assert setting == {}
    merged_ta = ta(models, base, lam=0.3)
    for key in floating:
        merged = merged_ta[key]
        expected = base[key] + 0.3 * sum(model[key] - base[key] for model in models)
        torch.testing.assert_close(merged, expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(anchor[key] + 0.3 * direction[key], merged, rtol=0, atol=1e-6)
    with pytest.raises(MimaError, match="keeps one model per task"):
        get_method("tall").stream(models, base)
    with pytest.raises(MimaError, match="needs task data"):
        get_method("fisher").merge(models)
    assert not hasattr(get_method("uniform"), "scaled_fn")  # the kind is the type: no optional entry points


def test_selection_keeps_the_best_grid_point_and_merges_with_it():
    base, models = _models(3, seed=5)
    method = get_method("task_arithmetic")
    # A score with a known maximum on the grid: closeness of the merged bias to lam = 0.35.
    target = get_method("task_arithmetic")(models, base, lam=0.35)
    key = "transformer.resblocks.0.mlp.c_fc.bias"

    def score(merged):
        return -float((merged[key] - target[key]).abs().sum())

    chosen = select_on_validation(method, models, base, score)
    assert chosen.hparams["lam"] == pytest.approx(0.35)
    assert len(chosen.trials) == len(method.grid["lam"])
    torch.testing.assert_close(chosen.merged[key], target[key])


def test_selection_over_cart_ratios_and_lambdas():
    g = torch.Generator().manual_seed(6)
    key = "transformer.resblocks.0.attn.in_proj_weight"  # 50 x 40: ratios 4/8/16/32% -> ranks 1/3/6/12
    models = [{key: torch.randn(50, 40, generator=g)} for _ in range(3)]
    base = None
    method = get_method("cart")
    target = method(models, base, rank_ratio=0.16, lam=2.2)
    chosen = select_on_validation(method, models, base, lambda m: -float((m[key] - target[key]).abs().sum()))
    assert (chosen.hparams["rank_ratio"], chosen.hparams["lam"]) == (0.16, pytest.approx(2.2))
    assert len(chosen.trials) == 4 * 11


@pytest.mark.parametrize("name", sorted(name for name, method in MERGE_METHODS.items()
                                         if method.grid and not isinstance(method, (PerTaskMerge, DataMerge))))
def test_selection_scores_the_grid_in_its_one_walk(name):
    """`--select-on val` scores the points in the order of MergeMethod.grid_points, the walk `mima
    evaluate`'s grid search follows too, so that on a tie both keep the same (first) point."""
    method = get_method(name)
    base, models = _models(2, seed=8)
    walked = [{**setting, **({} if lam is None else {"lam": lam})} for setting, lam in method.grid_points()]
    assert len(walked) == math.prod(len(values) for values in method.grid.values())
    assert [point for point, _ in method.grid_merges(models, base)] == walked
    tie = select_on_validation(method, models, base, lambda merged: 0.0)  # every point scores alike
    assert {key: tie.hparams[key] for key in walked[0]} == walked[0]


def test_defaults_without_validation_are_the_papers():
    # SPEC 2.2: task arithmetic 0.4 without validation, TIES lam 1 and k 20, CART 8% of the rank
    base, models = _models(2, seed=7)
    selection = merge_with_defaults(get_method("task_arithmetic"), models, base)
    for key, value in base.items():
        if value.is_floating_point():
            expected = value.numpy() + 0.4 * sum(m[key].numpy() - value.numpy() for m in models)
            np.testing.assert_allclose(selection.merged[key].numpy(), expected, rtol=1e-5, atol=1e-5)
    assert selection.hparams == {"lam": 0.4} and selection.notes == {} and selection.score is None
    assert merge_with_defaults(get_method("ties"), models, base).hparams == {"lam": 1.0, "k": 20.0, "trim": "global"}
    assert merge_with_defaults(get_method("cart"), models, base).hparams["rank_ratio"] == 0.08
