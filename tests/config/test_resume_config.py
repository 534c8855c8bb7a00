"""Issue 26, item 1: a resume goes on with the config its run was trained with.

A run stopped part-way (checkpoints, no final/) is resumed with one value changed. A change that alters
the weights (batch size, optimiser state, data seed, learning rate, seed) is refused in one line naming
the key with its old and new value, and the run folder is left exactly as it was (the old code took the
new value, or silently ignored it, and recorded it in config.yaml either way). A change that cannot alter
the weights (the progress bar, the checkpoint interval) is accepted: the resumed run ends with the
uninterrupted run's weights, config.yaml holds the new value and config_changes.jsonl the change.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from mima.core.safetensors_io import load_state_dict
from tests.helpers import assert_one_line, cli, copy_run, fit_argv, temporaries, unchanged

TASKS = ("rot90", "mirror")


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, small_clip) -> Path:
    """A finished run (S = 4, N = 2) that kept its checkpoints (process steps 2, 4, 6)."""
    from mima.cli import main

    run = tmp_path_factory.mktemp("resume-config") / "run"
    assert main([str(a) for a in fit_argv(small_clip, run, keep_checkpoints="true")]) == 0
    return run


@pytest.fixture
def stopped_run(whole_run, tmp_path) -> Path:
    """The same run as a job stopped after process step 6 leaves it: checkpoints, no final/."""
    run = copy_run(whole_run, tmp_path / "run")
    shutil.rmtree(run / "final")
    return run


REFUSED = {
    "batch-size": ({"data.batch_size": "8"}, "data.batch_size: 128 -> 8"),
    "optimizer-state": ({"model.optimizer_state": "reset"}, 'model.optimizer_state: "keep" -> "reset"'),
    "data-seed": ({"data.seed": "4"}, "data.seed: 0 -> 4"),
    "lr": ({"model.lr": "0.01"}, "model.lr: 1e-05 -> 0.01"),
    "seed": ({"seed_everything": "5"}, "seed_everything: 0 -> 5"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_change_that_alters_the_weights_is_refused_and_nothing_is_written(stopped_run, small_clip, tmp_path, capfd, case):
    changes, fragment = REFUSED[case]
    stored = yaml.safe_load((stopped_run / "config.yaml").read_text())
    with unchanged(tmp_path):
        result = cli(fit_argv(small_clip, stopped_run, ckpt_path="last", **changes), capfd)
    line = assert_one_line(result.code, result.err, "--ckpt_path", str(stopped_run / "config.yaml"), fragment)
    assert line.count("->") == 1, line  # only the key that changed is named
    assert yaml.safe_load((stopped_run / "config.yaml").read_text()) == stored


def test_every_changed_key_is_named_in_the_one_line(stopped_run, small_clip, tmp_path, capfd):
    with unchanged(tmp_path):
        result = cli(fit_argv(small_clip, stopped_run, ckpt_path="last", **{"model.lr": "0.01", "data.batch_size": "8",
                                                                              "trainer.enable_progress_bar": "true"}), capfd)
    line = assert_one_line(result.code, result.err, "data.batch_size: 128 -> 8", "model.lr: 1e-05 -> 0.01")
    assert "enable_progress_bar" not in line  # harmless, not a reason to refuse


def test_a_resume_of_a_finished_run_with_another_value_is_refused_too(whole_run, small_clip, tmp_path, capfd):
    run = copy_run(whole_run, tmp_path / "run")
    shutil.rmtree(run / "checkpoints")
    with unchanged(tmp_path):
        result = cli(fit_argv(small_clip, run, ckpt_path="last", **{"model.lr": "0.01"}), capfd)
    assert_one_line(result.code, result.err, "model.lr: 1e-05 -> 0.01")


def test_a_harmless_change_is_accepted_recorded_and_gives_the_same_weights(whole_run, stopped_run, small_clip, capfd):
    changes = {"trainer.enable_progress_bar": "true", "checkpoint_every": "phase"}
    result = cli(fit_argv(small_clip, stopped_run, ckpt_path="last", **changes), capfd)
    assert result.code == 0 and "Traceback" not in result.err, result.err
    assert "mima fit: resuming from the state of phase " in result.out, result.out[:600]
    for task in TASKS:
        resumed = load_state_dict(stopped_run / "final" / f"{task}.safetensors")
        uninterrupted = load_state_dict(whole_run / "final" / f"{task}.safetensors")
        assert resumed.keys() == uninterrupted.keys() and all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)
    config = yaml.safe_load((stopped_run / "config.yaml").read_text())
    assert config["trainer"]["enable_progress_bar"] is True and config["checkpoint_every"] == "phase"
    history = [json.loads(line) for line in (stopped_run / "config_changes.jsonl").read_text().splitlines()]
    assert len(history) == 1
    assert history[0]["changes"]["trainer.enable_progress_bar"] == [False, True]
    assert history[0]["changes"]["checkpoint_every"] == ["auto", "phase"]
    # how the command was called (--ckpt_path, --out: the copy is in another folder) is not a config change
    assert set(history[0]["changes"]) == {"trainer.enable_progress_bar", "checkpoint_every", "keep_checkpoints"}
    assert not temporaries(stopped_run)


def test_a_number_of_processes_that_changes_the_processes_per_task_is_refused(stopped_run, small_clip, tmp_path, capfd):
    """trainer.devices may change where each task keeps its number of processes (elastic resume,
    tests/distributed/test_distributed.py); 1 -> 4 processes on two tasks would split each task's batch."""
    with unchanged(tmp_path):
        result = cli(fit_argv(small_clip, stopped_run, ckpt_path="last", **{"trainer.devices": "4"}), capfd)
    assert_one_line(result.code, result.err, "written by 1 process (1 per task)", "has 4 (2 per task)")


def test_a_layout_change_that_keeps_the_processes_per_task_is_harmless():
    from functools import partial

    from mima.config.config_changes import compare_configs
    from mima.training.trainer import same_layout

    four_tasks, two_tasks = partial(same_layout, num_tasks=4), partial(same_layout, num_tasks=2)
    stored = {"trainer": {"devices": 2, "num_nodes": 1}, "model": {"lr": 0.1}}
    moved = {"trainer": {"devices": 1, "num_nodes": 2}, "model": {"lr": 0.1}}
    changes = compare_configs(stored, moved, two_tasks)
    assert changes.refused == {} and set(changes.harmless) == {"trainer.devices", "trainer.num_nodes"}
    grown = {"trainer": {"devices": 4, "num_nodes": 1}, "model": {"lr": 0.1}}
    assert compare_configs(stored, grown, four_tasks).refused == {}  # 2 -> 4 processes, one per task
    assert set(compare_configs(stored, grown, two_tasks).refused) == {"trainer.devices"}  # two per task
    auto = {"trainer": {"devices": "auto", "num_nodes": 1}, "model": {"lr": 0.1}}
    assert set(compare_configs(stored, auto, four_tasks).refused) == {"trainer.devices"}  # not known before the launch
    # a key this version does not know is not assumed harmless
    assert set(compare_configs(stored, {**stored, "trainer": {**stored["trainer"], "precision": "bf16"}}, two_tasks).refused) == {"trainer.precision"}
