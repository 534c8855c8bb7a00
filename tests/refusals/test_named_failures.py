"""Every failure named (issue 49, items 1 and 5): what the config library (jsonargparse, through
LightningCLI) used to swallow into "Does not validate against any of the Union subtypes" and what
Lightning or the plan's arithmetic ended in a traceback or no answer, each one line on stderr, exit
status 2, no traceback, nothing written.

  * a class the config names that refuses its arguments (a tracker, a callback, a profiler) is one line
    naming the option, the class and the library's own message (mima.services.fit.construction,
    mima.training.trackers.build_trackers); mima's default MLflow store works without MLflow 3's
    file-store switch;
  * a value the config library refuses says what was given and what is expected
    (mima.config.parse_errors);
  * a device the machine lacks is refused before the model is loaded (plan_probes.accelerator_refusal);
  * `mima plan` with a device count no plan can hold or an infinite memory answers in one line, and
    its arithmetic does not walk the processes one by one (resource_plan.process_groups)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from mima.core.layout import TaskLayout
from mima.training.plan_probes import LAUNCHER_VARIABLES

from tests.helpers import assert_one_line, cli, fit_config, unchanged

TASKS = ["rot90", "mirror"]
MLFLOW = "lightning.pytorch.loggers.MLFlowLogger"
SWITCH = "MLFLOW_ALLOW_FILE_STORE"


def config_file(folder: Path, clip: str, **trainer) -> Path:
    """A quick fit of the small CLIP (S = 4, N = 2) as a --config file in `folder`, without --out."""
    config = fit_config(folder / "run", clip, TASKS, steps=4, iterations=2)
    del config["out"]
    config["trainer"].update(trainer)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def fit(folder: Path, clip: str, capfd, *options: str, **trainer):
    return cli(["fit", "--config", config_file(folder, clip, **trainer), "--out", folder / "run", *options], capfd)


@pytest.fixture
def no_file_store_switch(monkeypatch, tmp_path):
    """MLflow 3's file-store switch unset (set first, so that the test's end restores the environment
    even where mima sets it for its own store), and the working directory the test's folder: whatever
    a tracker writes there is seen."""
    monkeypatch.setenv(SWITCH, "unset")
    monkeypatch.delenv(SWITCH)
    monkeypatch.chdir(tmp_path)


# ------------------------------------------------------------------ trackers that cannot start
def mlflow(**init_args) -> dict:
    return {"class_path": MLFLOW, "init_args": {"experiment_name": "mima-test", **init_args}}


def store_is_a_file(tmp_path: Path) -> dict:
    """mima's default store (RUN/mlruns) where a file stands: the run folder holds nothing else."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "mlruns").write_text("not a folder\n")
    return mlflow()


TRACKER_CASES = {
    # MLflow 3 refuses a file store without its switch: the line says which (MLflow's own words)
    "file-store-without-the-switch": (lambda tmp_path: mlflow(tracking_uri=f"file:{tmp_path / 'store'}"), False,
                                      [f"{SWITCH}=true"]),
    "store-inside-a-file": (lambda tmp_path: mlflow(tracking_uri="file:/etc/passwd/mlruns"), True,
                            ["NotADirectoryError", "/etc/passwd/mlruns"]),
    "unknown-scheme": (lambda tmp_path: mlflow(tracking_uri="bogus://x"), True, ["'bogus://x'"]),
    "default-store-path-a-file": (store_is_a_file, False, ["NotADirectoryError", "mlruns"]),
}


@pytest.mark.parametrize("case", list(TRACKER_CASES))
def test_a_tracker_that_cannot_start_refuses_the_run_in_one_line(tmp_path, small_clip, capfd, no_file_store_switch,
                                                                  monkeypatch, case):
    logger, switch, fragments = TRACKER_CASES[case]
    entry = logger(tmp_path)
    if switch:
        monkeypatch.setenv(SWITCH, "true")
    path = config_file(tmp_path, small_clip, logger=[entry])
    with unchanged(tmp_path):  # no run folder, no store, nothing in the working directory
        outcome = cli(["fit", "--config", path, "--out", tmp_path / "run"], capfd)
    assert_one_line(outcome.code, outcome.err, f"mima fit: error: trainer.logger: {MLFLOW} could not be made: ",
                    *fragments)


def test_mimas_default_mlflow_store_works_without_the_switch(tmp_path, small_clip, capfd, no_file_store_switch):
    outcome = fit(tmp_path, small_clip, capfd, logger=[mlflow()], log_every_n_steps=4)
    assert outcome.code == 0, outcome.err[-3000:]
    assert "Traceback" not in outcome.err and "tracker failed" not in outcome.err, outcome.err
    record = json.loads((tmp_path / "run" / "tracker.json").read_text())
    store = tmp_path / "run" / "mlruns"
    assert [path.name for path in store.glob(f"*/{record['MLFlowLogger']['run_id']}")] == [record["MLFlowLogger"]["run_id"]]
    assert not (tmp_path / "mlruns").exists()  # nothing in the working directory (Lightning's default save_dir)


# ------------------------------------------------------------------ other classes the config names
CLASS_CASES = {
    "callback": (["--trainer.callbacks+", "ModelCheckpoint", "--trainer.callbacks.mode", "bogus"],
                 ["trainer.callbacks[0]: lightning.pytorch.callbacks.ModelCheckpoint could not be made: ",
                  "`mode` can be min, max but got bogus"]),
    "profiler": (["--trainer.profiler", "PyTorchProfiler", "--trainer.profiler.sort_by_key", "bogus"],
                 ["trainer.profiler: lightning.pytorch.profilers.PyTorchProfiler could not be made: ",
                  "Found sort_by_key: bogus"]),
}


def refused_fit(tmp_path, small_clip, capfd, options):
    """`mima fit` of the small CLIP with `options`, which must leave tmp_path as it was."""
    path = config_file(tmp_path, small_clip)
    with unchanged(tmp_path):
        return cli(["fit", "--config", path, "--out", tmp_path / "run", *options], capfd)


@pytest.mark.parametrize("case", list(CLASS_CASES))
def test_a_class_the_config_names_that_refuses_its_arguments_is_one_line(tmp_path, small_clip, capfd, case):
    options, fragments = CLASS_CASES[case]
    outcome = refused_fit(tmp_path, small_clip, capfd, options)
    assert_one_line(outcome.code, outcome.err, *(f"mima fit: error: {fragments[0]}", *fragments[1:]))


# ------------------------------------------------------------------ values the config library refuses
VALUE_CASES = {
    "quick_gelu": (["--model.quick_gelu", "maybe"], "config: model.quick_gelu: 'maybe' is not true, false or 'auto'"),
    "lr_inf": (["--model.lr", "inf"], "config: model.lr: 'inf' is not a finite number > 0 and <= 10"),
    "steps_not_whole": (["--model.steps", "1.5"], "config: model.steps: '1.5' is not an integer in 1 .. 1000000000"),
    "max_epochs": (["--trainer.max_epochs", "x"], "config: trainer.max_epochs: 'x' is not an integer or null"),
    "nested_in_a_class": (["--trainer.callbacks+", "ModelCheckpoint", "--trainer.callbacks.every_n_epochs", "x"],
                          "config: trainer.callbacks: lightning.pytorch.callbacks.ModelCheckpoint: every_n_epochs: "
                          "'x' is not an integer or null"),
}


@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_a_refused_value_says_what_was_given_and_what_is_expected(tmp_path, small_clip, capfd, case):
    options, line = VALUE_CASES[case]
    outcome = refused_fit(tmp_path, small_clip, capfd, options)
    assert assert_one_line(outcome.code, outcome.err) == f"mima fit: error: {line}"


# ------------------------------------------------------------------ a device the machine lacks
@pytest.fixture
def no_model_load(monkeypatch):
    """Loading the model fails the test: the device check comes before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the device check")

    monkeypatch.setattr("mima.training.module.load_clip", refuse)


def test_an_accelerator_the_machine_lacks_is_one_line_before_the_model_loads(tmp_path, small_clip, capfd, monkeypatch,
                                                                             no_model_load):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    path = config_file(tmp_path, small_clip)
    with unchanged(tmp_path):
        outcome = cli(["fit", "--config", path, "--out", tmp_path / "run", "--trainer.accelerator", "gpu"], capfd)
    assert_one_line(outcome.code, outcome.err, "mima fit: error: trainer.accelerator='gpu': this machine has no CUDA GPU, "
                    "only the CPU", "use --trainer.accelerator cpu")


def test_more_gpus_than_the_machine_has_is_one_line_before_the_model_loads(tmp_path, small_clip, capfd, monkeypatch,
                                                                          no_model_load):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for variable in LAUNCHER_VARIABLES:  # a process a launcher made is Lightning's to judge (one GPU per task)
        monkeypatch.delenv(variable, raising=False)
    path = config_file(tmp_path, small_clip)
    with unchanged(tmp_path):
        outcome = cli(["fit", "--config", path, "--out", tmp_path / "run", "--trainer.accelerator", "gpu",
                       "--trainer.devices", "2"], capfd)
    assert_one_line(outcome.code, outcome.err, "mima fit: error: trainer.devices=2 with trainer.accelerator='gpu': "
                    "this machine has 1 CUDA GPU", "give --trainer.devices 1 or fewer")


# ------------------------------------------------------------------ mima plan
WALK_BOUND = 50  # asks of the layout for one process's tasks or steps a plan may make (a few per task)


@pytest.fixture
def bounded_walk(monkeypatch) -> list[str]:
    """The layout's per-process questions counted, and refused beyond WALK_BOUND: a plan that walks its
    W processes one by one (W^2 steps: no answer for hours at W = 10^6) fails at once, not after hours."""
    asked: list[str] = []
    for name in ("local_tasks", "phase_steps"):
        real = getattr(TaskLayout, name)

        def counted(self, *args, _real=real, _name=name):
            asked.append(_name)
            assert len(asked) <= WALK_BOUND, f"the plan walks the processes one by one ({_name})"
            return _real(self, *args)

        monkeypatch.setattr(TaskLayout, name, counted)
    return asked


@pytest.mark.parametrize("options, line", [
    (["--device-memory", "inf"], "--device-memory inf: expected a positive number of GiB, at most 1073741824"),
    (["--device-memory", "nan"], "--device-memory nan: expected a positive number of GiB, at most 1073741824"),
    (["--trainer.devices", "1000000"], "--trainer.devices 1000000: expected at most 65536 processes per node"),
    (["--trainer.num_nodes", "1000000"], "--trainer.num_nodes 1000000: expected at most 65536 nodes"),
    # W = 2^32 processes: more sharing each task than the batch has examples, refused before any arithmetic
    (["--trainer.devices", "65536", "--trainer.num_nodes", "65536"],
     "data.batch_size=16 does not split evenly over the 2147483648 processes that share each task"),
])
def test_a_plan_no_run_can_hold_is_one_line(tmp_path, small_clip, capfd, bounded_walk, options, line):
    path = config_file(tmp_path, small_clip)
    with unchanged(tmp_path):
        outcome = cli(["plan", "--config", path, *options], capfd)
    assert assert_one_line(outcome.code, outcome.err).startswith(f"mima plan: error: {line}")


def test_the_plan_of_many_processes_is_computed_per_task_group(tmp_path, small_clip, capfd, bounded_walk):
    """W = 2^18 processes (4 nodes of 65536) on 2 tasks: the plan's arithmetic walks the task groups,
    not the processes."""
    path = config_file(tmp_path, small_clip)
    outcome = cli(["plan", "--config", path, "--trainer.devices", "65536", "--trainer.num_nodes", "4",
                   "--data.batch_size", str(2**17), "--checkpoint_every", "1", "--json"], capfd)
    assert outcome.code == 0, outcome.err
    plan = json.loads(outcome.out)
    assert plan["world_size"] == 2**18 and len(plan["tasks_per_process"]) == 2**18
    assert plan["tasks_per_process"][2**17] == ["mirror"] and plan["steps_per_phase"][-1] == 2
    assert 0 < len(bounded_walk) <= WALK_BOUND
