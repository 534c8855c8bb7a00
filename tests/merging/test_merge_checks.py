"""Each merge method checks its own inputs (MergeMethod.check): the Python API and `mima merge` refuse
the same inputs with the same one-line message, for every registered method a rule applies to.

The inputs are the small CLIP's image encoders written as safetensors files (the `encoders` fixture,
tests/conftest.py); the expected messages are written out here, not built by the code under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mima.cli import main
from mima.core.errors import MimaError
from mima.core.safetensors_io import load_state_dict
from mima.merging import MERGE_METHODS, get_method
from mima.merging.engine import open_inputs
from tests.helpers import merge_argv, poisoned

MATRIX_KEYS_METHODS = sorted(name for name, method in MERGE_METHODS.items() if "matrix_keys" in method.defaults)
MIN_TASKS_METHODS = sorted(name for name, method in MERGE_METHODS.items() if "min_tasks" in method.defaults)
COMMAND_ERROR = "mima merge: error: "


def python_error(method: str, encoders: dict[str, Path], models: tuple[str, ...], **given) -> str:
    """The message of the Python API's refusal, on the files' state dicts loaded into memory."""
    states = [load_state_dict(encoders[name]) for name in models]
    base = load_state_dict(encoders["base"]) if MERGE_METHODS[method].needs_base else None
    with pytest.raises(MimaError) as refused:
        get_method(method).merge(states, base, **given)
    return str(refused.value)


def command_error(method: str, encoders: dict[str, Path], tmp_path: Path, capfd, models, *flags: str) -> str:
    """The message of `mima merge`'s refusal: exit 2, one line on stderr, and no output written."""
    output = tmp_path / "out.safetensors"
    capfd.readouterr()
    code = main([str(word) for word in merge_argv(method, encoders, output, *flags, models=models,
                                                  base=MERGE_METHODS[method].needs_base)])
    lines = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(COMMAND_ERROR), (code, lines)
    assert not output.exists()
    return lines[0][len(COMMAND_ERROR):]


def test_the_rules_apply_to_the_methods_they_were_written_for():
    assert {"tsv", "iso_c", "wudi", "cart"} <= set(MATRIX_KEYS_METHODS)
    assert "consensus" in MIN_TASKS_METHODS


@pytest.mark.parametrize("method", MATRIX_KEYS_METHODS)
def test_a_matrix_keys_pattern_matching_nothing_is_refused_alike(method, encoders, tmp_path, capfd):
    """A pattern selecting no matrix would quietly turn a low-rank merge into an average of task vectors."""
    python = python_error(method, encoders, ("m1", "m2"), matrix_keys="^nothing$")
    command = command_error(method, encoders, tmp_path, capfd, ("m1", "m2"), "--matrix-keys", "^nothing$")
    assert command == python
    expected = f"merge method '{method}': matrix_keys (--matrix-keys) '^nothing$' matches no 2-D floating tensor of the models"
    assert python.startswith(expected + " (its 2-D tensors: "), python


@pytest.mark.parametrize("method", sorted(MERGE_METHODS))
def test_fewer_task_models_than_the_minimum_are_refused_alike(method, encoders, tmp_path, capfd):
    minimum = MERGE_METHODS[method].min_models
    models = ("m1", "m2")[: minimum - 1]
    python = python_error(method, encoders, models)
    command = command_error(method, encoders, tmp_path, capfd, models)
    assert command == python
    assert python == f"merge method '{method}': models (--models) must be at least {minimum} task models, got {minimum - 1}"


@pytest.mark.parametrize("method", MIN_TASKS_METHODS)
def test_min_tasks_above_the_model_count_is_refused_alike(method, encoders, tmp_path, capfd):
    python = python_error(method, encoders, ("m1", "m2"), min_tasks=3)
    command = command_error(method, encoders, tmp_path, capfd, ("m1", "m2"), "--min-tasks", "3")
    assert command == python
    assert python == (f"merge method '{method}': min_tasks (--min-tasks) must be at most the 2 models given, got 3 "
                      "(each entry can be chosen by at most 2 tasks)")


@pytest.mark.parametrize("method", ["uniform", "task_arithmetic", "tsv"])
def test_non_finite_weights_are_refused_alike_naming_the_file(method, encoders, tmp_path, capfd):
    """Given file-backed inputs (the engine's views), Python names the file as the command does."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    path, key = poisoned(encoders, inputs, float("nan"))
    base = encoders["base"] if MERGE_METHODS[method].needs_base else None
    with open_inputs([encoders["m1"], path], base) as views, pytest.raises(MimaError) as refused:
        get_method(method).merge(views.models, views.base)
    command = command_error(method, encoders, tmp_path, capfd, ("m1", path))
    assert command == str(refused.value)
    assert command == (f"{path}: tensor '{key}' holds NaN or Inf values; a merge needs finite weights "
                       "(`mima merge --allow-non-finite`, or allow_non_finite=True, merges them as they are)")


def test_allowed_non_finite_weights_into_an_svd_are_refused_alike(encoders, tmp_path, capfd):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    path, key = poisoned(encoders, inputs, float("nan"))
    with open_inputs([encoders["m1"], path], encoders["base"]) as views, pytest.raises(MimaError) as refused:
        get_method("tsv").merge(views.models, views.base, allow_non_finite=True)
    command = command_error("tsv", encoders, tmp_path, capfd, ("m1", path), "--allow-non-finite")
    assert command == str(refused.value)
    assert command == (f"tsv: tensor '{key}' holds NaN or Inf values, which allow_non_finite (--allow-non-finite) "
                       "let through; its SVD cannot take them")
