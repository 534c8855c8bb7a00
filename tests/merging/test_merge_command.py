"""`mima merge`'s hyperparameter flags come from the registry's declarations, its results carry the notes,
and a run folder's models merge through it (the shared N = 2 run, tests/conftest.py's `two_runs`).

The flag checks run before any file is read, so most tests here need no checkpoints at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mima.cli import main
from mima.commands.merge import parse
from mima.core.errors import MimaError
from mima.core.run_folder import RunFolder
from mima.merging import HYPERPARAMETERS, MERGE_METHODS, get_method
from mima.merging.selection import Selection
from mima.services.merge import check_hyperparameter_flags, report_results
from mima.services.merge_request import MergeRequest


def test_parse_gives_the_request_with_the_hyperparameters_given():
    options = parse(["--method", "ties", "--models", "a", "b", "--output", "o", "--lam", "0.5", "--trim", "per-tensor",
                     "--overwrite"])
    assert options == MergeRequest(method="ties", models=(Path("a"), Path("b")), output=Path("o"), overwrite=True,
                                   hyperparameters={"lam": 0.5, "trim": "per-tensor"})
    with pytest.raises(MimaError, match="unknown merge method 'nope'"):
        parse(["--method", "nope", "--models", "a", "--output", "o"])


def _one_line_error(argv, capsys, tmp_path) -> str:
    code = main(["merge", *argv, "--models", str(tmp_path / "a.safetensors"), "--output", str(tmp_path / "out.safetensors")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert not (tmp_path / "out.safetensors").exists()
    return err[0]


def test_help_lists_every_method_and_a_flag_for_every_declared_hyperparameter(capsys):
    with pytest.raises(SystemExit) as done:
        main(["merge", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out

    def words(paragraph: str) -> str:  # argparse wraps lines at spaces and after hyphens
        return " ".join(paragraph.split()).replace("- ", "-")

    assert all(name in text for name in MERGE_METHODS)  # those without hyperparameters too
    for spec in HYPERPARAMETERS.values():
        assert spec.flag in text, spec.flag
        assert words(spec.doc) in words(text), spec.doc  # what it controls, as declared
        takers = [m.name for m in MERGE_METHODS.values() if spec.name in m.defaults]
        assert takers and all(name in text for name in takers)


@pytest.mark.parametrize("method", sorted(MERGE_METHODS))
def test_each_default_given_as_a_flag_parses_back_to_itself(method):
    """The flag's type, choices and nargs read what the strategy declares: `--x <default>` gives the default."""
    defaults = MERGE_METHODS[method].defaults
    argv = ["--method", method, "--models", "a", "--output", "o"]
    for name, value in defaults.items():
        words = [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
        argv += [HYPERPARAMETERS[name].flag, *words]
    given = parse(argv).hyperparameters
    check_hyperparameter_flags(MERGE_METHODS[method], given)
    assert given == defaults
    assert all(type(given[name]) is type(value) for name, value in defaults.items())


def test_several_values_for_a_many_valued_flag():
    options = parse(["--method", "tall", "--models", "a", "--output", "o", "--mask-lam", "0.2", "0.5"])
    check_hyperparameter_flags(get_method("tall"), options.hyperparameters)
    assert options.hyperparameters == {"mask_lam": [0.2, 0.5]}


# A value outside each hyperparameter's documented range (`mima merge --help`), written here rather
# than found with the registry's own check; a word argparse cannot convert (int of '1.5') counts too.
WRONG_VALUES = {
    "ace_epsilon": "-1",  # a non-negative number
    "ace_rank_fraction": "1.5",  # a fraction in [0, 1]
    "ada_steps": "0",  # a positive whole number
    "adapt_on": "validation",  # test, val or train
    "alpha": "1.5",  # in [0, 1]
    "base_merge": "dare",  # task_arithmetic, ties or consensus
    "block_keys": "blocks",  # a regular expression with a group
    "common_space_fraction": "-0.1",  # in [0, 1]
    "density": "0",  # in (0, 1]
    "drop": "1",  # in [0, 1)
    "epsilon": "0.5",  # in [0, 0.5)
    "examples": "0",  # a positive whole number
    "gamma": "1",  # in [0, 1)
    "granularity": "block",  # task or layer
    "inner_hparams": "lam",  # '' or name=value pairs
    "inner_merge": "averaging",  # a registered merge method
    "iterations": "0",  # a positive whole number
    "k": "120",  # a percentage in (0, 100]
    "lam": "nan",  # a finite number
    "lines_alpha": "inf",  # 'auto' or a finite number
    "lines_beta": "nan",  # a finite number
    "lr": "0",  # a positive number
    "mask_lam": "-1",  # non-negative
    "matrix_keys": "(",  # a regular expression
    "min_tasks": "0",  # at least 1
    "mode": "medium",  # hard or soft
    "prior": "inf",  # a finite number
    "rank_ratio": "1.5",  # a fraction in [0, 1]
    "seed": "1.5",  # an integer
    "start": "random",  # pretrained, task_arithmetic or adamerging
    "step_size": "0",  # a positive number
    "steps": "0",  # a positive whole number
    "svc_alpha": "0",  # a positive number
    "trim": "per-row",  # global or per-tensor
}


def test_every_hyperparameter_has_a_wrong_value_here():
    assert sorted(WRONG_VALUES) == sorted(HYPERPARAMETERS)  # a new hyperparameter gets its wrong value above


@pytest.mark.parametrize("name", sorted(WRONG_VALUES))
def test_a_wrong_value_on_the_command_line_is_one_line_naming_the_flag(name, capsys, tmp_path):
    flag, wrong = "--" + name.replace("_", "-"), WRONG_VALUES[name]
    method = next(m for m in MERGE_METHODS.values() if name in m.defaults)
    line = _one_line_error(["--method", method.name, flag, wrong], capsys, tmp_path)
    assert flag in line and wrong in line, line


@pytest.mark.parametrize("method", sorted(MERGE_METHODS))
def test_a_flag_the_method_does_not_take_is_one_line(method, capsys, tmp_path):
    spec = next(s for s in HYPERPARAMETERS.values() if s.name not in MERGE_METHODS[method].defaults)
    value = spec.choices[0] if spec.choices else "1"
    line = _one_line_error(["--method", method, spec.flag, value], capsys, tmp_path)
    assert f"{spec.flag} does not apply to merge method '{method}'" in line


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--mode", "soft", "--lam", "0.5"], "--lam is not used with --mode=soft"),
        (["--mode", "soft", "--start", "pretrained"], "--start is not used with --mode=soft"),
        (["--start", "task_arithmetic", "--ada-steps", "5"], "--ada-steps is not used with --mode=hard, --start=task_arithmetic"),
    ],
)
def test_a_flag_the_chosen_mode_does_not_use_is_one_line(argv, fragment, capsys, tmp_path):
    line = _one_line_error(["--method", "fw_merging", *argv], capsys, tmp_path)
    assert fragment in line, line


class _FixedEvaluator:
    def accuracy(self, state, tasks=None):
        return {"a": 0.5, "b": 1.0}


class _Pool:
    tasks = ["a", "b"]

    def evaluator(self, split):
        return _FixedEvaluator()


def test_results_carry_the_selections_notes(tmp_path):
    notes = {"coefficients": [[0.25, 0.75]], "entropy_before": 2.0, "entropy_after": 1.5}
    selection = Selection("adamerging", {"steps": 3}, None, [], {"w": torch.zeros(1)}, notes)
    report_results(tmp_path / "m.safetensors", get_method("adamerging"), selection, _Pool())
    report = json.loads((tmp_path / "m.safetensors.results.json").read_text())
    assert report["notes"] == notes and report["test_accuracy"] == {"a": 0.5, "b": 1.0, "mean": 0.75}
    report_results(tmp_path / "u.safetensors", get_method("uniform"), Selection("uniform", {}, None, [], {"w": torch.zeros(1)}), _Pool())
    assert json.loads((tmp_path / "u.safetensors.results.json").read_text())["notes"] is None


def test_the_merge_says_its_test_accuracy_and_the_files_it_wrote(tmp_path):
    """What `mima merge --config ...` prints after the merge line: each task's test accuracy, the mean,
    the chosen point's validation score and the results files (all read back from what it wrote)."""
    trials = [{"lam": 0.3, "score": 0.25}, {"lam": 0.5, "score": 0.625}]
    selection = Selection("task_arithmetic", {"lam": 0.5}, 0.625, trials, {"w": torch.zeros(1)})
    lines = report_results(tmp_path / "m.safetensors", get_method("task_arithmetic"), selection, _Pool())
    report = json.loads((tmp_path / "m.safetensors.results.json").read_text())
    assert report["test_accuracy"]["mean"] == 0.75 and report["validation_accuracy"] == 0.625
    assert lines == ["test accuracy (%): a 50.0, b 100.0; mean 75.0; validation 62.5 (the best of 2 grid points)",
                     f"wrote {tmp_path / 'm.safetensors.results.json'} and {tmp_path / 'm.safetensors.results.md'}"]


# ---------------------------------------------------------------------------- on a run folder
TASKS = ["rot90", "mirror"]


def test_select_on_val_through_the_cli_writes_a_results_table(tmp_path, two_runs, capsys):
    run = two_runs[1]  # N = 2
    out = tmp_path / "cart.safetensors"
    assert main(["merge", "--method", "cart", "--models", str(run), "--output", str(out), "--select-on", "val"]) == 0
    report = json.loads((tmp_path / "cart.safetensors.results.json").read_text())
    trials = report["trials"]
    assert len(trials) == 4 * 11 and report["selected_on"] == "val"
    best = max(trials, key=lambda t: t["score"])
    assert report["validation_accuracy"] == best["score"]
    assert (report["hparams"]["rank_ratio"], report["hparams"]["lam"]) == (best["rank_ratio"], best["lam"])
    assert set(report["test_accuracy"]) == {*TASKS, "mean"}
    assert (tmp_path / "cart.safetensors.results.md").read_text().startswith("# cart")
    out2 = tmp_path / "tall.safetensors"
    assert main(["merge", "--method", "tall", "--models", str(run), "--output", str(out2), "--select-on", "val"]) == 0
    tall = json.loads((tmp_path / "tall.safetensors.results.json").read_text())
    assert len(tall["hparams"]["mask_lam"]) == 2  # one lambda per task
    assert main(["merge", "--method", "fisher", "--models", str(run), "--output", str(tmp_path / "f.safetensors"),
                 "--examples", "4"]) == 0
    fisher = json.loads((tmp_path / "f.safetensors.results.json").read_text())
    assert fisher["hparams"] == {"examples": 4} and set(fisher["notes"]["fisher_norms"]) == set(TASKS)
    capsys.readouterr()
    # the run's task files, not the run folder: no config comes with them
    finals = [str(RunFolder(run).final_file(task)) for task in TASKS]
    code = main(["merge", "--method", "adamerging", "--models", *finals, "--base",
                 str(run / "pretrained.safetensors"), "--output", str(tmp_path / "a.safetensors")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "needs --config" in err and not (tmp_path / "a.safetensors").exists()
