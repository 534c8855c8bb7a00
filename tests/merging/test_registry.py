"""What every merge strategy shares: the registry (declarations checked as strategies register, clear
errors), the kinds as types with their own entry points, and the selection on validation over a
strategy's grid, in the one order `mima evaluate`'s grid search walks too."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from mima.core.errors import MimaError
from mima.merging import (HYPERPARAMETERS, MERGE_METHODS, DataFreeMerge, DataMerge, PerTaskMerge, ScaledMerge, StreamingMerge,
                          get_method)
from mima.merging.catalogue import STRATEGIES
from mima.merging.registry import register
from mima.merging.selection import merge_with_defaults, select_on_validation
from tests.helpers import clip_like_models


# ------------------------------------------------------------------------------------ the registry
def test_registry_errors_are_clear():
    base, models = clip_like_models(2)
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
    refused = [(StreamingMerge(name="x1", stream_fn=stream), "hyperparameter colour is not declared"),
               (StreamingMerge(name="x2", stream_fn=stream), "default k=0 is not a percentage"),
               (StreamingMerge(name="x3", stream_fn=stream), "grid of lam"),
               (ScaledMerge(name="x4", scaled_fn=stream), "a ScaledMerge takes lam"),
               (StreamingMerge(name="x5", stream_fn=stream), "x5 is declared a scaled strategy, so it must be a ScaledMerge, not a StreamingMerge"),
               (StreamingMerge(name="unlisted", stream_fn=stream), "STRATEGIES must list it")]
    for method, message in refused:
        with pytest.raises(ValueError, match=message):
            register(method)
    assert not {"x1", "x2", "x3", "x4", "x5", "unlisted"} & set(MERGE_METHODS)


def test_each_kind_merges_through_its_own_entry_points():
    """The kinds are types: data-free ones stream, a scaled one sweeps, a per-task one reconstructs, a
    data-dependent one refuses to merge without a pool; none needs to be asked which function it holds."""
    base, models = clip_like_models(3, seed=2)
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


# --------------------------------------------------------------------------------------- selection
def test_selection_keeps_the_best_grid_point_and_merges_with_it():
    base, models = clip_like_models(3, seed=5)
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


@pytest.mark.parametrize("name", sorted(name for name, method in MERGE_METHODS.items()
                                         if method.grid and not isinstance(method, (PerTaskMerge, DataMerge))))
def test_selection_scores_the_grid_in_its_one_walk(name):
    """`--select-on val` scores the points in the order of MergeMethod.grid_points, the walk `mima
    evaluate`'s grid search follows too, so that on a tie both keep the same (first) point."""
    method = get_method(name)
    base, models = clip_like_models(2, seed=8)
    walked = [{**setting, **({} if lam is None else {"lam": lam})} for setting, lam in method.grid_points()]
    assert len(walked) == math.prod(len(values) for values in method.grid.values())
    assert [point for point, _ in method.grid_merges(models, base)] == walked
    tie = select_on_validation(method, models, base, lambda merged: 0.0)  # every point scores alike
    assert {key: tie.hparams[key] for key in walked[0]} == walked[0]


def test_defaults_without_validation_are_the_papers():
    # SPEC 2.2: task arithmetic 0.4 without validation, TIES lam 1 and k 20, CART 8% of the rank
    base, models = clip_like_models(2, seed=7)
    selection = merge_with_defaults(get_method("task_arithmetic"), models, base)
    for key, value in base.items():
        if value.is_floating_point():
            expected = value.numpy() + 0.4 * sum(m[key].numpy() - value.numpy() for m in models)
            np.testing.assert_allclose(selection.merged[key].numpy(), expected, rtol=1e-5, atol=1e-5)
    assert selection.hparams == {"lam": 0.4} and selection.notes == {} and selection.score is None
    assert merge_with_defaults(get_method("ties"), models, base).hparams == {"lam": 1.0, "k": 20.0, "trim": "global"}
    assert merge_with_defaults(get_method("cart"), models, base).hparams["rank_ratio"] == 0.08
