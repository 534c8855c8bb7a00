"""Experiment trackers (issue 39, item 1; mima.training.trackers): W&B (offline) and MLflow (a file
store) fed from W = 2 runs (the demo config, and the suite's small CLIP for the kill, stop and
failure cases), read back with their own files and client.

The reference for "each task's loss at every logged step, once" is the run's own per-process
metrics.csv files (every process writes its own tasks' rows). W&B's offline run file is read here
record by record (tests.wandb_records); MLflow's through its client."""

from __future__ import annotations

import csv
import json
import signal
from pathlib import Path

import pytest
import yaml

from tests.helpers import assert_identical, finals, logged_losses, run_command, run_job, write_config
from tests.wandb_records import history_rows, offline_runs

pytestmark = pytest.mark.slow
TASKS = ["rot90", "rot180", "rot270", "mirror"]  # the digits tasks of the small jobs and of configs/demo.yaml
DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


@pytest.fixture(autouse=True)
def tracker_environment(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch


def tracker_config(tmp_path: Path, clip: str, name: str, loggers: list[dict], callbacks=()) -> Path:
    path = write_config(tmp_path / f"{name}.yaml", clip, TASKS, 2, callbacks=list(callbacks))
    config = yaml.safe_load(path.read_text())
    config["trainer"]["logger"] = loggers or None
    config["trainer"]["log_every_n_steps"] = 1
    path.write_text(yaml.safe_dump(config))
    return path


DEMO_STEPS = 96  # S for the tracker test: the demo's 320 would take 2 minutes of CI for no other check


def demo_config(tmp_path: Path, name: str, devices: int, loggers: list[dict]) -> Path:
    """configs/demo.yaml (the embedded default; threads_per_process 1, so 1 and 2 processes give the
    same bits) at S = DEMO_STEPS (N = 4 phases of 24 steps, the warm-up as the demo's), with `devices`
    processes and these trackers."""
    config = yaml.safe_load(DEMO.read_text())
    config["model"]["steps"] = DEMO_STEPS
    config["trainer"].update(devices=devices, logger=loggers or None, enable_progress_bar=False, log_every_n_steps=1)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def wandb_logger(**extra) -> dict:
    return {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"project": "mima-test", **extra}}


def mlflow_logger(uri: str) -> dict:
    return {"class_path": "lightning.pytorch.loggers.MLFlowLogger",
            "init_args": {"tracking_uri": uri, "experiment_name": "mima-test"}}


def csv_losses(run: Path) -> dict[str, dict[int, float]]:
    """task -> step -> loss, from every process's metrics.csv."""
    losses: dict[str, dict[int, float]] = {}
    for file in sorted((run / "logs").rglob("metrics.csv")):
        for step, task, loss in logged_losses(file):
            assert step not in losses.setdefault(task, {}), f"{file}: step {step} of {task} twice"
            losses[task][step] = loss
    return losses


def csv_learning_rates(run: Path, task: str) -> list[float]:
    values = []
    for file in sorted((run / "logs").rglob("metrics.csv")):
        with file.open() as handle:
            values += [float(row[f"train/lr/{task}"]) for row in csv.DictReader(handle) if row.get(f"train/lr/{task}")]
    return sorted(values)


def warmup_constant_rates(lr: float, steps: int, warmup: int) -> list[float]:
    """The demo's schedule over a task's own steps, written out: linear warm-up, then constant."""
    return sorted(lr * ((s + 1) / warmup if s < warmup else 1.0) for s in range(steps))


def mlflow_losses(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    return {task: sorted((m.step, m.value) for m in client.get_metric_history(run_id, f"train/loss/{task}")) for task in TASKS}


def wandb_losses(run_files: list[Path]) -> dict[str, list[tuple[int, float]]]:
    losses: dict[str, list[tuple[int, float]]] = {task: [] for task in TASKS}
    for file in run_files:
        for row in history_rows(file):
            for task in TASKS:
                if f"train/loss/{task}" in row:
                    losses[task].append((int(row["trainer/global_step"]), float(row[f"train/loss/{task}"])))
    return {task: sorted(values) for task, values in losses.items()}


def assert_each_step_once(found: dict[str, list[tuple[int, float]]], expected: dict[str, dict[int, float]]) -> None:
    for task in TASKS:
        steps = [step for step, _ in found[task]]
        assert steps == sorted(expected[task]), f"{task}: steps {steps} vs the CSV's {sorted(expected[task])}"
        assert all(value == pytest.approx(expected[task][step], rel=1e-6) for step, value in found[task])


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, small_clip) -> Path:
    """The same W = 2 job without trackers."""
    tmp_path = tmp_path_factory.mktemp("plain")
    done = run_job(tracker_config(tmp_path, small_clip, "plain", []), tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / "run"


def test_both_trackers_get_every_task_loss_once_in_one_run(tmp_path):
    """The demo (configs/demo.yaml) on 2 processes with W&B (offline) and MLflow (a file store); the
    reference is the same demo on 1 process without trackers."""
    uri = f"file:{tmp_path / 'mlruns'}"
    plain = run_job(demo_config(tmp_path, "plain", 1, []), tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr[-3000:]
    done = run_job(demo_config(tmp_path, "tracked", 2, [wandb_logger(), mlflow_logger(uri)]), tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    run, steps = tmp_path / "run", DEMO_STEPS
    expected = csv_losses(run)
    assert sorted(expected) == sorted(TASKS) and all(len(task_steps) == steps for task_steps in expected.values())
    for task in TASKS:  # each step's learning rate beside its loss: the schedule, one value per task step
        assert csv_learning_rates(run, task) == pytest.approx(warmup_constant_rates(1e-3, steps, 32), rel=1e-9)
    record = yaml.safe_load((run / "tracker.json").read_text())
    # MLflow: one run in the experiment, each task's loss at every step the CSV files hold, once
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("mima-test")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [record["MLFlowLogger"]["run_id"]]
    assert_each_step_once(mlflow_losses(uri, runs[0].info.run_id), expected)
    assert runs[0].data.params["model/steps"] == str(steps)  # the run's config, flattened
    # W&B: one offline run (rank 0's), the same rows
    files = offline_runs(run / "wandb")
    assert [f.stem for f in files] == [f"run-{record['WandbLogger']['run_id']}"]
    assert_each_step_once(wandb_losses(files), expected)
    assert_identical(finals(run, TASKS), finals(tmp_path / "plain", TASKS))  # neither the trackers nor W change a bit
    # mima merge and mima evaluate log their tables to the same runs
    # (as commands of their own: W&B started in this process would leave its service, and the variable
    # naming it, to every later job of the test process)
    merged = run_command(["merge", "--method", "task_arithmetic", "--lam", "0.3", "--models", run, "--output",
                          tmp_path / "merged.safetensors", "--log-to-tracker"])
    assert merged.returncode == 0, merged.stderr[-3000:]
    table = json.loads((tmp_path / "merged.safetensors.results.json").read_text())["test_accuracy"]
    evaluated = run_command(["evaluate", run, "--out", tmp_path / "table", "--merges", "uniform", "--no-select",
                             "--log-to-tracker"])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    rows = json.loads((tmp_path / "table" / "results.json").read_text())
    uniform = {row["task"]: row["accuracy"] for row in rows if row["model"] == "uniform"}
    logged = client.get_run(runs[0].info.run_id).data.metrics
    for task in TASKS:
        assert logged[f"merge/task_arithmetic/{task}"] == pytest.approx(table[task], abs=1e-12)
        assert logged[f"evaluate/uniform/{task}"] == pytest.approx(uniform[task], abs=1e-12)
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [runs[0].info.run_id]
    later = offline_runs(run / "wandb")  # W&B: the same run id, resumed by each command
    assert len(later) == 3 and {f.stem for f in later} == {f"run-{record['WandbLogger']['run_id']}"}
    sent = {key: value for f in later[1:] for row in history_rows(f) for key, value in row.items()}
    assert sent["merge/task_arithmetic/mean"] == pytest.approx(table["mean"], abs=1e-12)


def stopped_and_resumed(tmp_path: Path, clip: str, loggers: list[dict], stop: tuple[str, dict], status: int) -> tuple[Path, dict]:
    """A tracked W = 2 run stopped at step 20 (SIGKILL of the whole job, or SLURM's USR1), resumed
    with --ckpt_path last; the run folder and its tracker record, checked to name the same tracker
    runs before and after the resume."""
    run = tmp_path / "run"
    stopped = run_job(tracker_config(tmp_path, clip, "stop", loggers, [stop]), run)
    assert stopped.returncode == status, stopped.stderr[-2000:]
    first = yaml.safe_load((run / "tracker.json").read_text())
    resumed = run_job(tracker_config(tmp_path, clip, "resume", loggers), run, "--ckpt_path", "last")
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    record = yaml.safe_load((run / "tracker.json").read_text())
    assert {name: entry["run_id"] for name, entry in record.items()} == {name: entry["run_id"] for name, entry in first.items()}
    return run, record


def test_after_a_sigkill_the_resumed_run_continues_the_same_tracker_runs(tmp_path, small_clip, plain_run):
    uri = f"file:{tmp_path / 'mlruns'}"
    run, record = stopped_and_resumed(tmp_path, small_clip, [wandb_logger(), mlflow_logger(uri)],
                                      ("KillAtStep", {"step": 20}), -signal.SIGKILL)
    expected = csv_losses(run)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("mima-test").experiment_id])
    assert [r.info.run_id for r in runs] == [record["MLFlowLogger"]["run_id"]]
    # MLflow's client writes as it is called: every step once, the killed attempt's included
    assert_each_step_once(mlflow_losses(uri, record["MLFlowLogger"]["run_id"]), expected)
    # W&B: the resumed attempt's offline file, and the killed one's if its service had created it by the
    # kill, all of the same run id. W&B's service held the killed attempt's rows in memory, so none of
    # them are in its file; the resume sends them again from RUN/tracker_outbox.jsonl
    files = offline_runs(run / "wandb")
    assert len(files) in (1, 2) and {f.stem for f in files} == {f"run-{record['WandbLogger']['run_id']}"}
    assert_each_step_once(wandb_losses(files), expected)
    assert not (run / "tracker_outbox.jsonl").exists()  # cleared once W&B's run had finished
    assert_identical(finals(run, TASKS), finals(plain_run, TASKS))


def test_after_a_stop_request_the_resumed_run_has_every_step_once_in_both(tmp_path, small_clip, plain_run):
    """SLURM's warning signal: the stopped attempt sends its rows and W&B writes them as the process
    exits; the resumed attempt continues the same runs."""
    uri = f"file:{tmp_path / 'mlruns'}"
    run, record = stopped_and_resumed(tmp_path, small_clip, [wandb_logger(), mlflow_logger(uri)],
                                      ("SignalAtStep", {"step": 20, "rank": 1}), 128 + signal.SIGUSR1)
    expected = csv_losses(run)
    assert_each_step_once(mlflow_losses(uri, record["MLFlowLogger"]["run_id"]), expected)
    files = offline_runs(run / "wandb")
    assert len(files) == 2 and {f.stem for f in files} == {f"run-{record['WandbLogger']['run_id']}"}
    assert_each_step_once(wandb_losses(files), expected)
    assert_identical(finals(run, TASKS), finals(plain_run, TASKS))


def test_unreachable_or_refused_trackers_leave_training_bit_identical(tmp_path, small_clip, plain_run, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # a key no server knows
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "20")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    config = tracker_config(tmp_path, small_clip, "failing", [wandb_logger(), mlflow_logger("http://127.0.0.1:9")])
    done = run_job(config, tmp_path / "run")
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "tracker failed" in line]
    assert len(warnings) == 2 and {"WandbLogger", "MLFlowLogger"} == {w.split("the ", 1)[1].split(" ")[0] for w in warnings}
    assert all("training and the CSV logs go on" in w for w in warnings)
    assert csv_losses(tmp_path / "run") == csv_losses(plain_run)
    assert_identical(finals(tmp_path / "run", TASKS), finals(plain_run, TASKS))
