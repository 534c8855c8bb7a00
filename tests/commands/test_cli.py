"""The command line: bad input gives one clear line, exit status 2 and no partial output."""

from __future__ import annotations

import subprocess
import sys

import open_clip
import pytest
import torch

from mima.cli import main
from mima.merging import MERGE_METHODS

KNOWN = f"known: {', '.join(sorted(MERGE_METHODS))}"
from mima.data import digits
from mima.evaluation.accuracy import TaskEvaluator
from mima.models.heads import zero_shot_head
from mima.core.safetensors_io import load_state_dict, read_metadata, save_state_dict
from tests.helpers import small_fit_argv


@pytest.fixture
def checkpoints(tmp_path, small_clip):
    """theta_0 and two fine-tuned-like state dicts of the small CLIP's image encoder."""
    encoder = open_clip.create_model(small_clip).visual
    base = {k: v.clone() for k, v in encoder.state_dict().items()}
    paths = {"base": tmp_path / "base.safetensors"}
    save_state_dict(paths["base"], base)
    for index in (1, 2):
        g = torch.Generator().manual_seed(index)
        model = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        paths[f"m{index}"] = tmp_path / f"m{index}.safetensors"
        save_state_dict(paths[f"m{index}"], model)
    return paths


def _run(argv, capsys) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def _assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("method, extra", [("uniform", []), ("task_arithmetic", ["--lam", "0.3"]),
                                           ("ties", ["--lam", "1.0", "--k", "20"]), ("cart", ["--rank-ratio", "0.25"])])
def test_merge_writes_a_state_dict_that_loads_strictly_and_evaluates(checkpoints, small_clip, tmp_path, method, extra, capsys):
    out = tmp_path / f"{method}.safetensors"
    code, err = _run(["merge", "--method", method, "--base", checkpoints["base"], "--models", checkpoints["m1"],
                      checkpoints["m2"], "--output", out, *extra], capsys)
    assert code == 0, err
    merged = load_state_dict(out)
    assert read_metadata(out)["method"] == method
    clip = open_clip.create_model(small_clip)
    clip.visual.load_state_dict(merged, strict=True)
    tokenizer = open_clip.get_tokenizer(small_clip)
    head = zero_shot_head(clip, tokenizer, digits.CLASSNAMES, digits.TEMPLATES)
    test_set = digits.TASKS["rot90"].load(digits.LoadOptions(image_size=16)).test
    accuracy = TaskEvaluator(clip.visual, {"rot90": head}, {"rot90": test_set}).accuracy(merged)["rot90"]
    images = torch.stack([test_set[i][0] for i in range(len(test_set))])
    labels = torch.tensor([int(test_set[i][1]) for i in range(len(test_set))])
    with torch.no_grad():  # the same accuracy, by hand
        features = torch.nn.functional.normalize(clip.visual(images), dim=-1)
        by_hand = float(((features @ head.T).argmax(1) == labels).float().mean())
    assert accuracy == pytest.approx(by_hand)


def test_merge_uniform_without_base(checkpoints, tmp_path, capsys):
    out = tmp_path / "u.safetensors"
    code, _ = _run(["merge", "--method", "uniform", "--models", checkpoints["m1"], checkpoints["m2"], "--output", out], capsys)
    assert code == 0
    a, b, merged = (load_state_dict(p) for p in (checkpoints["m1"], checkpoints["m2"], out))
    torch.testing.assert_close(merged["proj"], (a["proj"] + b["proj"]) / 2)


def _mutated(path, tmp_path, name, change):
    state = load_state_dict(path)
    change(state)
    target = tmp_path / name
    save_state_dict(target, state)
    return target


@pytest.mark.parametrize(
    "name, change, fragments",
    [
        ("missing_key.safetensors", lambda s: s.pop("proj"), ["key 'proj'", "base.safetensors", "missing_key.safetensors"]),
        ("bad_shape.safetensors", lambda s: s.update(proj=torch.zeros(3, 3)), ["key 'proj': shape", "bad_shape.safetensors"]),
        ("bad_dtype.safetensors", lambda s: s.update(proj=s["proj"].double()), ["key 'proj': dtype torch.float32", "bad_dtype.safetensors"]),
    ],
)
def test_merge_rejects_incompatible_inputs(checkpoints, tmp_path, capsys, name, change, fragments):
    bad = _mutated(checkpoints["m2"], tmp_path, name, change)
    out = tmp_path / "out.safetensors"
    code, err = _run(["merge", "--method", "task_arithmetic", "--base", checkpoints["base"], "--models",
                      checkpoints["m1"], bad, "--output", out], capsys)
    _assert_one_line_error(code, err, *fragments)
    assert not out.exists() and not list(tmp_path.glob(".out.safetensors*"))


def test_merge_rejects_missing_and_unreadable_files(checkpoints, tmp_path, capsys):
    out = tmp_path / "out.safetensors"
    code, err = _run(["merge", "--method", "uniform", "--models", checkpoints["m1"], tmp_path / "nope.safetensors",
                      "--output", out], capsys)
    _assert_one_line_error(code, err, "nope.safetensors: no such file")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00\x01 not a tensor file")
    code, err = _run(["merge", "--method", "uniform", "--models", checkpoints["m1"], garbage, "--output", out], capsys)
    _assert_one_line_error(code, err, "garbage.safetensors: not a safetensors file")
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--method", "average"], ["unknown merge method 'average'", KNOWN]),
        (["--method", "uniform", "--lam", "0.3"], ["--lam does not apply to merge method 'uniform'"]),
        (["--method", "task_arithmetic"], ["needs the pretrained model: pass base (--base)"]),
        (["--method", "ties", "--k", "0"], ["--k must be a percentage of entries kept, in (0, 100], got 0.0"]),
        (["--method", "ties", "--k", "120"], ["--k must be a percentage"]),
        (["--method", "cart", "--rank-ratio", "-0.1"], ["--rank-ratio must be a fraction of the rank, in [0, 1]"]),
        (["--method", "dare_ties", "--drop", "1"], ["--drop must be a drop probability, in [0, 1)"]),
        (["--method", "ties", "--density", "0.5"], ["--density does not apply to merge method 'ties'"]),
    ],
)
def test_merge_option_errors(checkpoints, tmp_path, capsys, argv, fragments):
    out = tmp_path / "out.safetensors"
    code, err = _run(["merge", *argv, "--models", checkpoints["m1"], checkpoints["m2"], "--output", out], capsys)
    _assert_one_line_error(code, err, *fragments)
    assert not out.exists()


def test_merge_never_overwrites_without_being_asked(checkpoints, tmp_path, capsys):
    out = tmp_path / "precious.safetensors"
    out.write_bytes(b"user data")
    code, err = _run(["merge", "--method", "uniform", "--models", checkpoints["m1"], checkpoints["m2"], "--output", out], capsys)
    _assert_one_line_error(code, err, "precious.safetensors: already exists")
    assert out.read_bytes() == b"user data"
    code, _ = _run(["merge", "--method", "uniform", "--models", checkpoints["m1"], checkpoints["m2"], "--output", out,
                    "--overwrite"], capsys)
    assert code == 0 and out.read_bytes() != b"user data"


@pytest.mark.parametrize("alias", ["same", "symlink", "hardlink", "base"])
def test_merge_never_replaces_an_input_even_with_overwrite(checkpoints, tmp_path, capsys, alias):
    import os

    inputs = {name: checkpoints[name] for name in ("base", "m1", "m2")}
    before = {name: path.read_bytes() for name, path in inputs.items()}
    target = {"same": inputs["m1"], "base": inputs["base"], "symlink": tmp_path / "link.safetensors",
              "hardlink": tmp_path / "hard.safetensors"}[alias]
    if alias == "symlink":
        target.symlink_to(inputs["m2"])
    if alias == "hardlink":
        os.link(inputs["m2"], target)
    code, err = _run(["merge", "--method", "task_arithmetic", "--base", inputs["base"], "--models", inputs["m1"],
                      inputs["m2"], "--output", target, "--overwrite"], capsys)
    _assert_one_line_error(code, err, f"--output {target}: is the input")
    assert {name: path.read_bytes() for name, path in inputs.items()} == before


@pytest.mark.parametrize("method", ["uniform", "task_arithmetic", "ties"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_merge_refuses_non_finite_weights(checkpoints, tmp_path, capsys, method, bad):
    poisoned = load_state_dict(checkpoints["m2"])
    key = sorted(k for k, v in poisoned.items() if v.is_floating_point())[0]
    poisoned[key].view(-1)[3] = bad
    path = tmp_path / "poisoned.safetensors"
    save_state_dict(path, poisoned)
    out = tmp_path / "merged.safetensors"
    code, err = _run(["merge", "--method", method, "--base", checkpoints["base"], "--models", checkpoints["m1"], path,
                      "--output", out], capsys)
    _assert_one_line_error(code, err, str(path), f"'{key}'", "NaN or Inf")
    assert not out.exists() and not list(tmp_path.glob("*.tmp*"))


def test_merge_refuses_a_result_that_overflows(checkpoints, tmp_path, capsys):
    out = tmp_path / "merged.safetensors"
    code, err = _run(["merge", "--method", "task_arithmetic", "--base", checkpoints["base"], "--models", checkpoints["m1"],
                      checkpoints["m2"], "--lam", "1e308", "--output", out], capsys)
    _assert_one_line_error(code, err, "overflows to Inf or NaN", "--lam")
    assert not out.exists()


def test_merge_refuses_one_model_and_more_min_tasks_than_models(checkpoints, tmp_path, capsys):
    out = tmp_path / "merged.safetensors"
    code, err = _run(["merge", "--method", "uniform", "--models", checkpoints["m1"], "--output", out], capsys)
    _assert_one_line_error(code, err, "at least 2 task models, got 1")
    code, err = _run(["merge", "--method", "consensus", "--base", checkpoints["base"], "--models", checkpoints["m1"],
                      checkpoints["m2"], "--min-tasks", "3", "--output", out], capsys)
    _assert_one_line_error(code, err, "min_tasks (--min-tasks) must be at most the 2 models given, got 3")
    assert not out.exists()


@pytest.mark.parametrize(
    "changes, fragments",
    [
        ({"model.iterations": "4"}, ["model.iterations=4 does not divide model.steps=6"]),
        ({"data.tasks": "[]"}, ["data.tasks: the task list is empty"]),
        ({"data.tasks": "[rot90, upsidedown]"}, ["unknown task 'upsidedown'", "rot180"]),
        ({"data.suite": "imagenet"}, ["data.suite: unknown suite 'imagenet'"]),
        ({"model.clip": "ViT-Nope"}, ["unknown open_clip architecture 'ViT-Nope'"]),
        ({"model.steps": "many"}, ["config:", "model.steps"]),
        ({"trainer.max_steps": "10"}, ["trainer.max_steps", "model.steps and model.iterations"]),
        ({"checkpoint_every": "weekly"}, ["--checkpoint_every must be 'segment', 'phase', a number", "'weekly'"]),
        ({"checkpoint_every": "-3"}, ["--checkpoint_every must be", "-3"]),
        ({"checkpoint_every": "0 phases"}, ["--checkpoint_every must be", "'K phases' (K >= 1)", "'0 phases'"]),
        ({"checkpoint_every": "2 weeks"}, ["--checkpoint_every must be", "a time such as 90s, 30min or 2h", "'2 weeks'"]),
        ({"checkpoint_every": "0min"}, ["--checkpoint_every must be", "or 0 (never)", "'0min'"]),
        ({"out": "runs/{config}-{lr}"}, ["--out runs/{config}-{lr}: only {config}, {iterations} and {seed}"]),
    ],
)
def test_fit_config_errors_are_one_line(tmp_path, small_clip, capsys, changes, fragments):
    code, err = _run(small_fit_argv(tmp_path, small_clip, **changes), capsys)
    _assert_one_line_error(code, err, *fragments)
    assert not (tmp_path / "run" / "final").exists()


def test_fit_fills_the_run_name_fields_of_out(tmp_path, small_clip, capsys):
    """--out with {config}, {iterations}, {seed}: a job submitted again finds its finished run."""
    config = tmp_path / "my-config.yaml"
    config.write_text("seed_everything: 7\n")
    argv = ["fit", "--config", str(config)] + small_fit_argv(tmp_path, small_clip, out=str(tmp_path / "{config}-N{iterations}-seed{seed}"))[1:]
    assert _run(argv, capsys)[0] == 0
    run = tmp_path / "my-config-N2-seed7"
    assert (run / "final" / "rot90.json").is_file() and not (run / "checkpoints").exists()
    code = main(argv + ["--ckpt_path", "last"])
    assert code == 0 and "has finished (final/ holds every task model); nothing to resume" in capsys.readouterr().out


def test_fit_refuses_to_overwrite_an_earlier_run(tmp_path, small_clip, capsys):
    assert _run(small_fit_argv(tmp_path, small_clip), capsys)[0] == 0
    before = (tmp_path / "run" / "final" / "rot90.safetensors").read_bytes()
    code, err = _run(small_fit_argv(tmp_path, small_clip, **{"model.lr": "0.01"}), capsys)
    _assert_one_line_error(code, err, "already holds a run", "--overwrite")
    assert (tmp_path / "run" / "final" / "rot90.safetensors").read_bytes() == before
    # --overwrite with a mistake found late (5 processes for the 4 default tasks, checked after the Trainer
    # exists; a typo in the config): refused, and the earlier run is still all there
    files_before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*"))
    for mistake in ({"trainer.devices": "5"}, {"model.iterations": "4"}):
        code, err = _run(small_fit_argv(tmp_path, small_clip, **mistake, overwrite="true"), capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*")) == files_before
        assert (tmp_path / "run" / "final" / "rot90.safetensors").read_bytes() == before
    # --overwrite with a run that fails before its first checkpoint (K = 3): the earlier run waits aside
    crash = {"model.lr": "0.01", "overwrite": "true", "trainer.callbacks+": "tests.helpers.RaiseAtStep",
             "trainer.callbacks.step": "1"}
    with pytest.raises(RuntimeError, match="RaiseAtStep"):
        _run(small_fit_argv(tmp_path, small_clip, **crash), capsys)
    aside = sorted((tmp_path / "run").glob(".replaced-*"))
    assert len(aside) == 1 and (aside[0] / "final" / "rot90.safetensors").read_bytes() == before
    assert _run(small_fit_argv(tmp_path, small_clip, **{"model.lr": "0.01", "overwrite": "true"}), capsys)[0] == 0
    assert (tmp_path / "run" / "final" / "rot90.safetensors").read_bytes() != before
    assert not list((tmp_path / "run").glob(".replaced-*"))  # removed once the new run had saved


def test_console_entry_point_reports_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mima", "merge", "--method", "nope", "--models", "a", "--output",
                             str(tmp_path / "o.safetensors")], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == f"mima merge: error: unknown merge method 'nope' ({KNOWN})"
    result = subprocess.run([sys.executable, "-m", "mima", "frobnicate"], capture_output=True, text=True)
    assert result.returncode == 2 and "unknown command 'frobnicate'" in result.stderr


def test_merge_rejects_a_truncated_safetensors_file(checkpoints, tmp_path, capsys):
    data = checkpoints["m2"].read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) - 100])
    out = tmp_path / "out.safetensors"
    code, err = _run(["merge", "--method", "uniform", "--models", checkpoints["m1"], truncated, "--output", out], capsys)
    _assert_one_line_error(code, err, "truncated.safetensors: truncated")
    assert not out.exists() and not list(tmp_path.glob(".out.safetensors*"))
