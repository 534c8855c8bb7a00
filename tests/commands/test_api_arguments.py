"""The Python API checks its arguments as the commands check their words (issue 49, item 4;
mima.services.arguments): each case below is one MimaError line saying what was wrong, never
another exception or a quiet result, and writes nothing (the working folder and the inputs hashed
before and after). `mima merge` refuses the same models given as files in the same words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import mima
from mima.core.errors import MimaError
from tests.helpers import assert_one_line, cli, unchanged

REPOSITORY = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPOSITORY / "configs" / "demo.yaml"


def weights(scale: float = 1.0, **changes) -> dict[str, torch.Tensor]:
    return {"w": torch.ones(2, 3) * scale, "b": torch.zeros(3) + scale, **changes}


def integers(value: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2,), value, dtype=torch.int64)}


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    """The working folder, holding three model files (in/m0..m2.safetensors) and a results folder whose
    results.json is a list of anything but rows."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in").mkdir()
    for index in range(3):
        save_file(weights(float(index)), str(tmp_path / "in" / f"m{index}.safetensors"))
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "results.json").write_text(json.dumps([1, 2, "x"]))
    (tmp_path / "no-accuracy").mkdir()
    (tmp_path / "no-accuracy" / "results.json").write_text(json.dumps([{"N": 1, "model": "ties", "task": "rot90"}]))
    (tmp_path / "measured-at-text").mkdir()
    (tmp_path / "measured-at-text" / "results.json").write_text(json.dumps(
        [{"N": 1, "model": "joint", "task": "rot90", "seed": 1, "accuracy": 0.9, "measured_at": "zero"}]))
    return tmp_path


FILES = ["in/m1.safetensors", "in/m2.safetensors"]
BASE = "in/m0.safetensors"

# (call, what its one line says)
CASES = {
    "a-wrong-shape": (lambda: mima.merge([weights(), weights(w=torch.ones(3, 2))], "task_arithmetic", base=weights(0.0)),
                      "key 'w': shape (2, 3) in base but (3, 2) in models[1]"),
    "a-missing-key": (lambda: mima.merge([weights(), {"w": torch.ones(2, 3)}], "task_arithmetic", base=weights(0.0)),
                      "key 'b' is in base but not in models[1]"),
    "an-extra-key": (lambda: mima.merge([weights(), weights(x=torch.ones(1))], "task_arithmetic", base=weights(0.0)),
                     "key 'x' is in models[1] but not in base"),
    "models-a-number": (lambda: mima.merge(123, "ties"), "models: expected a path (str or os.PathLike)"),
    "models-an-empty-list": (lambda: mima.merge([], "ties"), "models: expected at least one model"),
    "device-a-number": (lambda: mima.merge(FILES, "uniform", device=0),
                        "argument --device: expected auto, cpu, cuda or cuda:N, got '0'"),
    "base-a-list": (lambda: mima.merge(FILES, "task_arithmetic", base=[BASE]), "base: expected a path"),
    "config-a-number": (lambda: mima.merge(FILES, "uniform", config=5), "config: expected a path"),
    "models-as-bytes": (lambda: mima.merge([name.encode() for name in FILES], "uniform"),
                        "models[0]: expected a path (str or os.PathLike) of a safetensors file, or a state dict, got bytes"),
    "output-as-bytes": (lambda: mima.merge(FILES, "uniform", output=b"merged.safetensors"),
                        "output: expected a path (str or os.PathLike), got bytes"),
    "overwrite-a-string": (lambda: mima.merge(FILES, "uniform", output="merged.safetensors", overwrite="no"),
                           "overwrite: expected True or False, got str 'no'"),
    "empty-state-dicts": (lambda: mima.merge([{}, {}], "uniform"), "models[0]: holds no tensors"),
    "int64-models": (lambda: mima.merge([integers(1), integers(2)], "uniform"),
                     "models[0]: holds no floating-point tensor (int64 only); nothing to merge"),
    "complex64-models": (lambda: mima.merge([{"w": torch.ones(2, dtype=torch.complex64)}] * 2, "uniform"),
                         "models[0]: tensor 'w' has dtype complex64; mima reads float64"),
    "a-list-for-a-tensor": (lambda: mima.merge([{"w": [1.0]}, {"w": [2.0]}], "uniform"), "models[0]: 'w' holds list"),
    "evaluate-a-number": (lambda: mima.evaluate(5, out="table"), "runs: expected a path (str or os.PathLike)"),
    "evaluate-out-a-number": (lambda: mima.evaluate("run", out=5), "out: expected a path (str or os.PathLike), got int 5"),
    "evaluate-merges-a-string": (lambda: mima.evaluate("run", out="table", merges="ties"),
                                 "merges: expected a list of names"),
    "evaluate-select-a-string": (lambda: mima.evaluate("run", out="table", select="no"), "select: expected True or False"),
    "load-results-a-number": (lambda: mima.load_results(5), "folder: expected a path (str or os.PathLike), got int 5"),
    "load-results-rows-not-objects": (lambda: mima.load_results("results"), "results.json: row 0 is not an object"),
    "load-results-row-without-accuracy": (lambda: mima.load_results("no-accuracy"),
                                          "results.json: row 0 has no number 'accuracy'"),
    "load-results-measured-at-not-a-seed": (lambda: mima.load_results("measured-at-text"),
                                            "results.json: row 0 has a 'measured_at' that is not the whole-number seed"),
    "plan-a-number": (lambda: mima.plan(5), "config: expected a path (str or os.PathLike) of a config file"),
    "plan-a-config-yaml-cannot-hold": (lambda: mima.plan({"model": {"lr": object()}}),
                                       "config.model.lr: object <object object"),
    "fit-a-number": (lambda: mima.fit(5), "config: expected a path (str or os.PathLike) of a config file"),
    "fit-out-a-number": (lambda: mima.fit(DEMO_CONFIG, out=5), "out: expected a path (str or os.PathLike), got int 5"),
    "fit-a-config-yaml-cannot-hold": (lambda: mima.fit(DEMO_CONFIG, out="run", trainer={"logger": object()}),
                                      "overrides.trainer.logger: object <object object"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_mistaken_argument_is_one_line(folder, case):
    call, says = CASES[case]
    with unchanged(folder), pytest.raises(MimaError) as refused:
        call()
    line = str(refused.value)
    assert "\n" not in line and says in line, line


@pytest.mark.parametrize("models, says", [
    ({"e0": {}, "e1": {}}, "holds no tensors"),
    ({"i0": integers(1), "i1": integers(2)}, "holds no floating-point tensor (int64 only); nothing to merge"),
], ids=["empty-files", "int64-files"])
def test_the_command_refuses_the_same_models_as_files(tmp_path, capfd, models, says):
    for name, state in models.items():  # metadata apart, so that two empty files differ
        save_file(state, str(tmp_path / f"{name}.safetensors"), metadata={"name": name})
    paths = [tmp_path / f"{name}.safetensors" for name in models]
    with unchanged(tmp_path):
        result = cli(["merge", "--method", "uniform", "--models", *paths, "--output", tmp_path / "out.safetensors"], capfd)
    assert_one_line(result.code, result.err, f"{paths[0]}: {says}")
