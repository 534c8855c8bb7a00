"""Task-parallel runs with real processes (gloo): same results at any W, resume anywhere, failures.

Each job runs `python -m mima fit` in its own process group; faults come from tests/helpers.py.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import open_clip
import pytest
import torch
import yaml

from mima.cli import main
from mima.core.safetensors_io import load_state_dict
from mima.training.sync_merge import SyncMerge
from tests.helpers import (FOUR, group_ended, ITERATIONS, REFERENCE_RUNS, REPO, STEPS, TWO, assert_identical,
                           assert_killed_and_resumed_ends_as, assert_trained, dark_and_light_pngs, finals, job_environment, logged_losses, run_job, tree, write_config)


CHECKPOINTS = "checkpoints"  # the run-folder contract, spelled independently of mima.core.run_folder


@pytest.mark.slow
def test_one_two_and_four_processes_write_the_same_task_models(reference, small_clip):
    one = reference(1, FOUR)
    # every task trained (24 AdamW steps at lr 1e-3 move some weight by about 1e-2), so equal is not "all untrained"
    assert_trained(one, open_clip.create_model(small_clip).visual.state_dict(), at_least=1e-3)
    assert_identical(one, reference(2, FOUR))  # two tasks per process
    assert_identical(one, reference(4, FOUR))  # one task per process


@pytest.mark.slow
@pytest.mark.parametrize(
    "devices, tasks, kill_step, where",
    [
        (1, TWO, 13, "mid-phase, in the second task's segment"),
        (2, TWO, 9, "one step after a sync"),
        (2, FOUR, 16, "at a phase end, before its sync and checkpoint ran"),
        (2, TWO[:1], 12, "mid-phase, two processes on one task (DDP replicas)"),
    ],
)
def test_sigkill_and_resume_is_bit_identical(tmp_path, small_clip, reference, devices, tasks, kill_step, where):
    out = tmp_path / "run"
    killed = run_job(write_config(tmp_path / "kill.yaml", small_clip, tasks, devices, [("KillAtStep", {"step": kill_step})]), out)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (out / "final").exists() or len(list((out / "final").glob("*.safetensors"))) < len(tasks)
    resumed = run_job(write_config(tmp_path / "plain.yaml", small_clip, tasks, devices), out, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    # W <= T: the one-process run (the same at any such W: the first test); replicas sum their
    # gradients in another order, so W > T is compared with an uninterrupted run at the same W
    assert_identical(finals(out, tasks), reference(devices if devices > len(tasks) else 1, tasks))
    phases = [json.loads(line)["phase"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert phases == [1, 2, 3]  # no phase logged twice across the crash


def rank_states(out: Path, rank: int) -> list[str]:
    return sorted(p.name for p in (out / CHECKPOINTS / "ranks" / f"rank-{rank:05d}").glob("*.ckpt"))


# W = 3 on four tasks (a W that does not divide T): tests/checkpoints/test_checkpoint_schedule.py's
# test_two_phases_saves_exactly_at_every_second_sync ends with the one-process run's task models


@pytest.mark.slow
def test_kill_during_a_background_write_leaves_the_previous_state(tmp_path, small_clip, reference):
    out = tmp_path / "run"
    crash = write_config(tmp_path / "crash.yaml", small_clip, TWO, 2, [("KillDuringStateWrite", {"save": 2, "rank": 1})])
    result = run_job(crash, out, "--keep_checkpoints", "true")
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    # rank 1's first state (step 8) is complete; its second exists only as a cut-off temporary file
    assert rank_states(out, 1) == ["phase-0001-step-00000008.ckpt"]
    leftovers = list((out / CHECKPOINTS / "ranks" / "rank-00001").glob(".*.tmp"))
    assert len(leftovers) == 1
    resumed = run_job(write_config(tmp_path / "plain.yaml", small_clip, TWO, 2), out, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "mima fit: resuming from the states of phase 1 at process step 8 of all 2 processes (" in resumed.stdout
    assert_identical(finals(out, TWO), reference(1, TWO))  # the same at any W <= T (the first test)


@pytest.mark.slow
def test_a_damaged_newest_state_falls_back_to_an_older_consistent_cut(tmp_path, small_clip, reference):
    out = tmp_path / "run"
    killed = run_job(write_config(tmp_path / "kill.yaml", small_clip, FOUR, 2, [("KillAtStep", {"step": 44})]), out)
    assert killed.returncode == -signal.SIGKILL
    # rank 1 is somewhere in the last phase (no lockstep between syncs); its newest state (step 40) is cut
    # short. Only the newest generation of kept moments stays on disk, so an older state is complete only
    # where no newer moments replaced the ones it needs: in the last phase, which writes no moments, the
    # phase's first state (step 32) is.
    newest = sorted((out / CHECKPOINTS / "ranks" / "rank-00001").glob("*.ckpt"))[-1]
    newest.write_bytes(newest.read_bytes()[:1000])  # a truncated file, as a full disk would leave
    resumed = run_job(write_config(tmp_path / "plain.yaml", small_clip, FOUR, 2), out, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"skipping {newest} (unreadable" in resumed.stdout + resumed.stderr
    assert "mima fit: resuming from the states of phase " in resumed.stdout
    assert_identical(finals(out, FOUR), reference(2, FOUR))


STOP_HELPERS = {  # request -> (fault injection, exit status, what the log names as the cause)
    "signal": (("SignalAtStep", {"step": 11, "rank": 1}), 128 + signal.SIGUSR1, "signal 10"),
    "stop file": (("TouchStopAtStep", {"step": 11, "rank": 1}), 0, "STOP"),
}


def _stopped_run(folder: Path, small_clip: str, request_kind: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = folder / "run"
    return run_job(write_config(folder / "stop.yaml", small_clip, TWO, 2, [STOP_HELPERS[request_kind][0]]), out), out


@pytest.fixture(scope="module")
def stopped_by_file(tmp_path_factory, small_clip) -> tuple[subprocess.CompletedProcess, Path]:
    """A W = 2 run on two tasks that rank 1 stopped with RUN/STOP at step 11. Tests copy it before
    resuming it; test_bad_distributed_input_is_one_line reads it as it is."""
    return _stopped_run(tmp_path_factory.mktemp("stopped"), small_clip, "stop file")


@pytest.mark.slow
@pytest.mark.parametrize("request_kind", ["signal", "stop file"])
def test_a_stop_request_saves_at_the_next_step_and_resumes(tmp_path, small_clip, reference, stopped_by_file, request_kind):
    if request_kind == "signal":
        result, out = _stopped_run(tmp_path, small_clip, request_kind)
    else:
        result, stopped = stopped_by_file
        out = shutil.copytree(stopped, tmp_path / "run", symlinks=True)
    _, expected_code, cause = STOP_HELPERS[request_kind]
    assert result.returncode == expected_code, result.stderr[-3000:]
    where = "" if request_kind == "signal" else str(result.args[result.args.index("--out") + 1]) + "/"
    assert f"stopped by {where}{cause}" in result.stdout
    assert "phase-0001-step-00000011.ckpt" in rank_states(out, 1)  # rank 1 saved at the step it was asked
    assert not (out / "final").exists()
    if request_kind == "signal":
        return  # what a stopped run resumes to does not depend on how it was asked to stop
    resumed = run_job(write_config(tmp_path / "plain.yaml", small_clip, TWO, 2), out, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_identical(finals(out, TWO), reference(1, TWO))  # the same at any W <= T (the first test)
    # a finished job submitted again: test_resuming_a_finished_run_removes_its_leftover_checkpoints


@pytest.mark.slow
def test_every_process_logs_the_losses_of_its_own_tasks(tmp_path, small_clip):
    config_file = write_config(tmp_path / "logged.yaml", small_clip, FOUR, 2)
    config = yaml.safe_load(config_file.read_text())
    config["trainer"].update(logger=True, log_every_n_steps=1)
    config_file.write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    result = run_job(config_file, out)
    assert result.returncode == 0, result.stderr[-3000:]
    # rank r owns tasks r and r + 2 (round-robin); rank 0 logs into logs/, rank 1 into logs/rank-00001/
    logs = {0: out / "logs" / "metrics.csv", 1: out / "logs" / "rank-00001" / "metrics.csv"}
    owned = {0: FOUR[0::2], 1: FOUR[1::2]}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_per_phase = STEPS // ITERATIONS
    for rank, file in logs.items():
        with file.open() as handle:
            rows = list(csv.DictReader(handle))
        columns = {key for row in rows for key, value in row.items() if key.startswith("train/loss/") and value}
        assert columns == {f"train/loss/{task}" for task in owned[rank]}, (rank, columns)
        # the same scalars as TensorBoard events in the same folder (the `tensorboard` extra; in `test`)
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(file.parent))
        events.Reload()
        for task in owned[rank]:
            losses = [float(row[f"train/loss/{task}"]) for row in rows if row.get(f"train/loss/{task}")]
            assert len(losses) == STEPS
            assert [e.value for e in events.Scalars(f"train/loss/{task}")] == pytest.approx(losses, rel=1e-6)
            # the per-phase means that the phase sync gathered from every process (metrics.jsonl)
            for phase, record in enumerate(records):
                phase_losses = losses[phase * steps_per_phase : (phase + 1) * steps_per_phase]
                assert record["loss"][task] == pytest.approx(sum(phase_losses) / steps_per_phase, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("dead_rank", [1, 0])
def test_a_dead_process_fails_the_job_without_hanging(tmp_path, small_clip, dead_rank):
    config = write_config(tmp_path / "die.yaml", small_clip, TWO, 2, [("KillAtStep", {"step": 5, "rank": dead_rank, "group": False})],
                          collective_timeout=60)
    command = [sys.executable, "-m", "mima", "fit", "--config", str(config), "--out", str(tmp_path / "run")]
    job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                           env=job_environment())
    # at the latest the survivor's collective times out (60 s) and it exits; a hung job runs past this
    job.communicate(timeout=240)
    assert job.returncode != 0
    assert group_ended(job.pid, within_s=60), "a process of the job is still running"  # the other rank must go too


def _one_line_error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.slow
def test_bad_distributed_input_is_one_line(tmp_path, small_clip, capsys, stopped_by_file):
    three = write_config(tmp_path / "three.yaml", small_clip, TWO, 3)
    line = _one_line_error(capsys, ["fit", "--config", str(three), "--out", str(tmp_path / "a")])
    assert "3 processes" in line and "do not fit 2 tasks" in line and "1 .. 2, 4, 6" in line

    result, out = stopped_by_file  # saved by 2 processes, one per task; every refusal below leaves it as it is
    assert result.returncode == 0, result.stderr[-3000:]
    two = write_config(tmp_path / "two.yaml", small_clip, TWO, 2)
    before = tree(out)
    line = _one_line_error(capsys, ["fit", "--config", str(two), "--out", str(out), "--ckpt_path", "last",
                                    "--model.iterations", "4"])
    assert "written by a run with iterations=3" in line and "this run has iterations=4" in line
    line = _one_line_error(capsys, ["fit", "--config", str(two), "--out", str(out), "--ckpt_path", "last",
                                    "--data.tasks", "[rot90, rot180]"])
    assert "tasks=['rot90', 'mirror']" in line
    # one process per task -> two per task (they would split each batch): refused, naming the W that can resume
    line = _one_line_error(capsys, ["fit", "--config", str(two), "--out", str(out), "--ckpt_path", "last",
                                    "--trainer.devices", "4"])
    assert "written by 2 processes (1 per task)" in line and "has 4 (2 per task)" in line and "use 1 .. 2 processes" in line
    line = _one_line_error(capsys, ["fit", "--config", str(two), "--out", str(out), "--ckpt_path",
                                    str(tmp_path / "nope.ckpt")])
    assert "nope.ckpt: no such checkpoint" in line
    line = _one_line_error(capsys, ["fit", "--config", str(two), "--out", str(tmp_path / "new"), "--ckpt_path",
                                    str(out / CHECKPOINTS)])
    assert "resumes in its own folder" in line
    assert tree(out) == before


def test_a_resumed_run_keeps_the_log_from_before_it(tmp_path, small_clip):
    """The CSV log of a run stopped at step 11 and resumed holds every step once, with the losses of the
    same run uninterrupted (resuming is bit-identical, so the losses are too)."""
    def logged_config(name: str, callbacks=()) -> Path:
        path = write_config(tmp_path / name, small_clip, TWO, 1, callbacks)
        config = yaml.safe_load(path.read_text())
        config["trainer"].update(logger=True, log_every_n_steps=1)
        path.write_text(yaml.safe_dump(config))
        return path

    whole = run_job(logged_config("whole.yaml"), tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = tmp_path / "run"
    stopped = run_job(logged_config("stop.yaml", [("TouchStopAtStep", {"step": 11})]), out)
    assert stopped.returncode == 0 and "stopped by" in stopped.stdout, stopped.stderr[-3000:]
    assert max(step for step, _, _ in logged_losses(out / "logs" / "metrics.csv")) >= 10  # the first attempt logged
    resumed = run_job(logged_config("plain.yaml"), out, "--ckpt_path", "last")
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-3000:]
    expected = logged_losses(tmp_path / "whole" / "logs" / "metrics.csv")
    assert len(expected) == len(TWO) * STEPS  # one loss per step of each task
    assert sorted(logged_losses(out / "logs" / "metrics.csv")) == sorted(expected)
    # TensorBoard too: the earlier attempt's events from the resumed step on are dropped (TensorBoard
    # purges events a restarted writer logs again), the rest kept
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "logs"))
    events.Reload()
    assert len(list((out / "logs").glob("events.out.tfevents.*"))) == 2  # one file per attempt
    for task in TWO:
        shown = [(event.step, event.value) for event in events.Scalars(f"train/loss/{task}")]
        wanted = sorted((step, loss) for step, name, loss in expected if name == task)
        assert [step for step, _ in shown] == [step for step, _ in wanted]  # every step once, in order
        assert [value for _, value in shown] == pytest.approx([loss for _, loss in wanted], rel=1e-6)


# ---------------------------------------------------------------- the phase-end operator and schedules
TIES_AT_SYNC = {"sync_merge": "ties", "sync_merge_args": {"k": 50.0, "lam": 0.9}}


@pytest.mark.slow
def test_ties_at_the_sync_is_the_same_at_w2_after_a_sigkill(tmp_path, small_clip, reference):
    one = tmp_path / "w1"
    assert run_job(write_config(tmp_path / "w1.yaml", small_clip, FOUR, 1, model=TIES_AT_SYNC), one).returncode == 0
    expected = finals(one, FOUR)
    changed = [task for task in FOUR if any(not torch.equal(expected[task][k], reference(1, FOUR)[task][k])
                                            for k in expected[task])]
    assert changed == FOUR  # the operator made a difference: every task model differs from MIMA's
    # W = 2, killed mid-run and resumed, ends with the one-process run's task models
    assert_killed_and_resumed_ends_as(tmp_path, small_clip, FOUR, TIES_AT_SYNC, expected)


def test_task_arithmetic_at_one_over_t_is_the_average(tmp_path, small_clip, reference):
    """ATM with lam = 1/T: theta_0 + (1/T) sum_t (theta_t - theta_0) = mean_t theta_t, up to rounding."""
    out = tmp_path / "atm"
    model = {"sync_merge": "task_arithmetic", "sync_merge_args": {"lam": 1 / len(TWO)}}
    result = run_job(write_config(tmp_path / "atm.yaml", small_clip, TWO, 1, model=model), out)
    assert result.returncode == 0, result.stderr[-3000:]
    mima = reference(1, TWO)
    pretrained = load_state_dict(out / "pretrained.safetensors")
    assert any(not torch.equal(mima[TWO[0]][k], pretrained[k]) for k in pretrained)  # training moved the weights
    # one sync: the operator's output is the average up to float rounding (theta_0 + 0.5 (tau_1 + tau_2)
    # rounds differently from (theta_1 + theta_2) / 2) ...
    merged = SyncMerge("task_arithmetic", {"lam": 0.5}).apply([mima[task] for task in TWO], pretrained)
    for key in merged:
        average = (mima[TWO[0]][key].double() + mima[TWO[1]][key].double()) / 2
        torch.testing.assert_close(merged[key].double(), average, rtol=1e-6, atol=1e-7)
    # ... and two syncs and 24 AdamW steps later those roundings are still far below the training's own
    # changes. Measured over the whole model, not per element: AdamW divides each gradient by its own
    # running scale, so an element whose gradient is near zero can turn a rounding into a step of up to
    # lr (1e-3) in either direction (seen: 2.2e-4 on one of 96 entries of a bias).
    for task in TWO:
        atm = finals(out, TWO)[task]
        difference = sum(float((atm[key].double() - mima[task][key].double()).square().sum()) for key in atm) ** 0.5
        moved = sum(float((mima[task][key].double() - pretrained[key].double()).square().sum()) for key in atm) ** 0.5
        assert difference < 1e-2 * moved, f"{task}: ATM at 1/T is {difference:.3g} from MIMA, training moved {moved:.3g}"


@pytest.mark.slow
def test_a_geometric_schedule_logs_each_phase_length_and_is_the_same_at_w2(tmp_path, small_clip):
    schedule = {"phase_schedule": "geometric", "phase_ratio": 2.0, "steps": 21, "iterations": 3}  # K = 3, 6, 12
    runs = {}
    for devices in (1, 2):
        out = tmp_path / f"w{devices}"
        result = run_job(write_config(tmp_path / f"w{devices}.yaml", small_clip, TWO, devices, model=schedule), out)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[devices] = finals(out, TWO)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [(r["phase"], r["K"], r["step"]) for r in records] == [(1, 3, 3), (2, 6, 9), (3, 12, 21)]
    assert_identical(runs[2], runs[1])


def _folder_task(folder: Path, seed: int) -> None:
    """Two classes of PNGs of mixed sizes and aspect ratios (a random resized crop of each differs)."""
    dark_and_light_pngs(folder, seed, per_class=14, smallest=16, noise=50)


def _folder_config(path: Path, clip: str, root: Path, devices: int, workers: int, callbacks=()) -> Path:
    """write_config's run on two custom folder tasks: the per-image path, with open_clip's training
    transform (RandomResizedCrop) on their training splits, read by `workers` DataLoader workers."""
    config = yaml.safe_load(write_config(path, clip, TWO, devices, callbacks).read_text())
    config["data"] = {"suite": None, "batch_size": 8, "seed": 3, "num_workers": workers,
                      "custom_tasks": [{"name": name, "path": str(root / name)} for name in ("one", "two")]}
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_augmented_per_image_runs_are_bit_identical_after_a_kill_and_at_two_processes(tmp_path, small_clip):
    """Each training example's random crop is drawn from (data seed, task, per-task step, position in
    the batch), not from a worker's RNG: a run SIGKILLed mid-phase and resumed (with workers), and the
    run at W = 2, end with the uninterrupted W = 1 run's task models, bit for bit."""
    _folder_task(tmp_path / "data" / "one", seed=1)
    _folder_task(tmp_path / "data" / "two", seed=2)
    tasks = ["one", "two"]
    whole = run_job(_folder_config(tmp_path / "whole.yaml", small_clip, tmp_path / "data", 1, 0), tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    reference = finals(tmp_path / "whole", tasks)

    out = tmp_path / "run"
    killed = run_job(_folder_config(tmp_path / "kill.yaml", small_clip, tmp_path / "data", 1, 0, [("KillAtStep", {"step": 13})]), out)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = run_job(_folder_config(tmp_path / "plain.yaml", small_clip, tmp_path / "data", 1, 2), out, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    assert_identical(finals(out, tasks), reference)

    two = run_job(_folder_config(tmp_path / "two.yaml", small_clip, tmp_path / "data", 2, 1), tmp_path / "two")
    assert two.returncode == 0, two.stderr[-3000:]
    assert_identical(finals(tmp_path / "two", tasks), reference)


# ---------------------------------------------------------------- elastic resume: another W on resume
def _stop_config(folder: Path, small_clip: str, devices: int, step: int) -> Path:
    return write_config(folder / "stop.yaml", small_clip, FOUR, devices, [("TouchStopAtStep", {"step": step})])


@pytest.fixture(scope="module")
def stopped_w2_on_four(tmp_path_factory, small_clip) -> tuple[subprocess.CompletedProcess, Path]:
    """A W = 2 run on four tasks that RUN/STOP stopped at step 12 (rank 0's), which the elastic tests
    copy and resume at other W."""
    folder = tmp_path_factory.mktemp("stopped-w2")
    return run_job(_stop_config(folder, small_clip, 2, 12), folder / "run"), folder / "run"


@pytest.mark.slow
@pytest.mark.parametrize(
    "stop_devices, stop_step, resume_devices, finished_before",
    [
        # rank 0 stops inside its second task (rot270); rank 1 stops where it sees RUN/STOP: before or
        # after finishing rot180 (processes are not in lockstep between syncs)
        (2, 12, 1, {1, 2}),
        (2, 12, 3, {1, 2}),  # with rot180 finished, rank 1 of W = 3 (rot180 only) resumes at its sync
        (1, 20, 2, {2}),  # the one process is inside its third task (rot270): rot90 and rot180 are kept
    ],
)
def test_a_run_stopped_at_one_w_resumes_at_another_and_ends_bit_identical(
        tmp_path, small_clip, reference, stopped_w2_on_four, stop_devices, stop_step, resume_devices, finished_before):
    out = tmp_path / "run"
    if (stop_devices, stop_step) == (2, 12):
        stopped, shared = stopped_w2_on_four
        shutil.copytree(shared, out, symlinks=True)
    else:
        stopped = run_job(_stop_config(tmp_path, small_clip, stop_devices, stop_step), out)
    assert stopped.returncode == 0 and "stopped by" in stopped.stdout, stopped.stderr[-3000:]
    assert not (out / "final").exists()
    resumed = run_job(write_config(tmp_path / "plain.yaml", small_clip, FOUR, resume_devices), out, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    process = "process" if stop_devices == 1 else "processes"
    line = re.search(rf"elastic resume: the cut saved by {stop_devices} {process} is dealt to {resume_devices}; "
                     r"phase 1 of 3: (\d) of 4 task segments finished", resumed.stdout)
    assert line and int(line.group(1)) in finished_before, resumed.stdout[-3000:]
    # the uninterrupted run (the same at any W <= T: test_one_two_and_four_processes_write_the_same_task_models)
    expected = reference(1, FOUR)
    assert_identical(finals(out, FOUR), expected)
    pretrained = load_state_dict(out / "pretrained.safetensors")
    assert all(any(not torch.equal(expected[task][k], pretrained[k]) for k in pretrained) for task in FOUR)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in records] == [1, 2, 3]
    assert [len(r["wait_s"]) for r in records] == [resume_devices] * 3  # phase 1's sync ran on the new layout
    whole = [json.loads(line) for line in (REFERENCE_RUNS[(1, tuple(FOUR), ())] / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == [r["loss"] for r in whole]  # kept loss sums of the finished segments


@pytest.mark.slow
def test_an_elastic_resume_that_dies_resumes_again_from_the_set_aside_states(tmp_path, small_clip, reference,
                                                                             stopped_w2_on_four):
    """W = 2 -> 3 moves the W = 2 states out of checkpoints/ranks/; killed before W = 3 has a cut of its
    own, the next resume (at W = 2 again) still finds them and ends bit-identical."""
    stopped, shared = stopped_w2_on_four
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    out = shutil.copytree(shared, tmp_path / "run", symlinks=True)
    # how many states rank 1 left depends on where it saw RUN/STOP (inside rot180 or at its end)
    w2_states = sorted(p.relative_to(out / CHECKPOINTS / "ranks") for p in (out / CHECKPOINTS / "ranks").glob("rank-*/*.ckpt"))
    assert {p.parent.name for p in w2_states} == {"rank-00000", "rank-00001"}
    # rank 2 of W = 3 (rot270 only) kills the job 4 steps in, before any process of W = 3 has saved
    killed = run_job(write_config(tmp_path / "kill.yaml", small_clip, FOUR, 3,
                                  [("KillAtStep", {"step": 4, "rank": 2, "wait_for_others": False})]),
                     out, "--ckpt_path", "last")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "elastic resume" in killed.stdout
    # every W = 2 state moved, none lost, none left among W = 3's names
    set_aside = out / CHECKPOINTS / "layouts" / "w00002"
    assert sorted(p.relative_to(set_aside) for p in set_aside.glob("rank-*/*.ckpt")) == w2_states
    assert sorted((out / CHECKPOINTS / "layouts").glob("*/rank-*/*.ckpt")) == sorted(set_aside / p for p in w2_states)
    again = run_job(write_config(tmp_path / "plain.yaml", small_clip, FOUR, 2), out, "--ckpt_path", "last")
    assert again.returncode == 0, again.stderr[-3000:]
    # rank 0's stop at 12; rank 1 where it saw it (12 too, or a later step: the steps are printed once each)
    resumed_steps = re.search(r"resuming from the states of phase \d+ (?:at process step (\d+) of all 2 processes|"
                              r"with process 0 at step (\d+), process 1 at step (\d+) )", again.stdout)
    assert resumed_steps and "12" in resumed_steps.groups(), again.stdout[-3000:]
    assert "elastic resume:" not in again.stdout
    assert_identical(finals(out, FOUR), reference(1, FOUR))


def test_resuming_a_finished_run_removes_its_leftover_checkpoints(tmp_path, small_clip):
    """A finished run whose clean-up was cut short (checkpoints/ half deleted) is finished: the next
    resume says so and removes what was left, instead of keeping it for good."""
    config = write_config(tmp_path / "run.yaml", small_clip, TWO, 1)
    out = tmp_path / "run"
    assert run_job(config, out).returncode == 0
    leftover = out / CHECKPOINTS / "ranks" / "rank-00000" / "step-00000016.ckpt"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"half of a deleted state")
    before = {task: value for task, value in finals(out, TWO).items()}
    again = run_job(config, out, "--ckpt_path", "last")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "has finished" in again.stdout and "removed the leftover" in again.stdout
    assert not (out / CHECKPOINTS).exists()
    assert_identical(finals(out, TWO), before)
