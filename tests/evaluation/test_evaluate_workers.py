"""`mima evaluate` on a cluster node (issue "First contact with a GPU cluster", item 2): each process
has at most --num-workers loader workers alive, whatever the number of tasks and splits (counted
from /proc while a 4-task evaluation runs), with the same results as loading in the process itself;
the shared workers give every dataset's batches as a DataLoader of its own would, also after a pass
stopped half way; each process takes the GPU of its local rank before any CUDA call, and on the CPU
touches no CUDA at all."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from mima.cli import main
from mima.core.errors import MimaError
from mima.commands.evaluate import parse
from mima.services.evaluate.runs import evaluate_runs
from mima.services.evaluate.team import Team, team_for
from mima.evaluation.accuracy import EvalSettings, EvaluationStopped
from mima.evaluation.device import claim_device, device_index
from mima.evaluation.loader_pool import LoaderPool
from mima.pools import task_pool
from mima.commands.fit.run import run_fit
from tests.helpers import fit_config

TASKS = ["rot90", "rot180", "rot270", "mirror"]
WORKERS = 2


def child_processes() -> set[int]:
    """The pids of this process's children (zombies included: a worker not yet reaped still counts)."""
    parent = os.getpid()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended while we looked
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found.add(int(entry.name))
    return found


class ChildCounter:
    """Counts, every few milliseconds in a thread, the children this process started after it began:
    here the evaluation's loader workers (an evaluation with one device starts no other process)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.earlier = child_processes()  # e.g. the tests' job server
        self.counts: list[int] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.done.is_set():
            self.counts.append(len(child_processes() - self.earlier))
            self.done.wait(self.interval_s)

    def __enter__(self) -> ChildCounter:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


@pytest.fixture(scope="module")
def four_task_run(tmp_path_factory, small_clip) -> Path:
    folder = tmp_path_factory.mktemp("four-tasks")
    return run_fit(fit_config(folder / "N1", small_clip, TASKS, steps=4, iterations=1)).run_dir


def test_a_four_task_evaluation_with_two_workers_never_has_more_than_two_alive(four_task_run, tmp_path):
    out = tmp_path / "workers"
    # test and validation splits of 4 tasks: zero-shot, fine-tuned, uniform and task_arithmetic's 21-point grid
    argv = ["evaluate", str(four_task_run), "--merges", "uniform", "task_arithmetic", "--val-examples", "32"]
    with ChildCounter() as counter:
        assert main([*argv, "--out", str(out), "--num-workers", str(WORKERS)]) == 0
    assert len(counter.counts) > 100, "too few samples to see the workers"
    assert max(counter.counts) == WORKERS  # reached (the count can see workers) and never exceeded
    assert child_processes() - counter.earlier == set()  # none outlives the evaluation
    # the same numbers as loading every batch in this process
    alone = tmp_path / "in-process"
    with ChildCounter() as counter:
        assert main([*argv, "--out", str(alone), "--num-workers", "0"]) == 0
    assert max(counter.counts) == 0
    assert json.loads((out / "results.json").read_text()) == json.loads((alone / "results.json").read_text())


def test_shared_workers_give_each_dataset_the_batches_of_its_own_loader():
    torch.manual_seed(0)
    datasets = [TensorDataset(torch.randn(size, 3), torch.arange(size)) for size in (10, 7, 1, 16)]
    settings = EvalSettings(batch_size=4, num_workers=WORKERS)
    pool = LoaderPool()
    pool.know(datasets[:2])
    earlier = child_processes()
    for dataset in [*datasets, datasets[0], datasets[3]]:  # two datasets it meets in a pass, two again
        expected = list(DataLoader(dataset, batch_size=4))
        got = list(pool.one_pass(dataset, settings))
        assert len(got) == len(expected) and all(torch.equal(a, b) for x, y in zip(got, expected) for a, b in zip(x, y))
        assert len(child_processes() - earlier) == WORKERS  # alive between passes, never more
    pool.close()
    assert child_processes() - earlier == set()


def test_a_pass_stopped_half_way_leaves_the_next_pass_exact(four_task_run):
    pool = task_pool(four_task_run)
    evaluator = pool.evaluator("test", EvalSettings(batch_size=8, num_workers=WORKERS))
    earlier = child_processes()
    asked: list[int] = []

    def second_batch() -> bool:  # asked before each batch: stop at the second one
        asked.append(len(child_processes() - earlier))
        return len(asked) == 2

    weights = pool.encoder.state_dict()
    with pytest.raises(EvaluationStopped):
        evaluator.counts(weights, [TASKS[0]], should_stop=second_batch)
    assert asked == [WORKERS, WORKERS]
    # the batches prefetched for the stopped pass are dropped, not counted in the next one
    assert evaluator.counts(weights, TASKS) == task_pool(four_task_run).evaluator("test", EvalSettings(batch_size=8)).counts(weights, TASKS)
    assert len(child_processes() - earlier) == WORKERS
    pool.loaders.close()
    assert child_processes() - earlier == set()


def test_the_workers_option_is_checked_in_one_line(four_task_run, tmp_path, capsys):
    out = tmp_path / "table"
    assert main(["evaluate", str(tmp_path / "no-run"), "--out", str(out), "--num-workers", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--num-workers -1: expected 0 or more" in err[0], err
    assert not out.exists()
    # the options, however made, are checked when made (the command's checks live there, once)
    with pytest.raises(MimaError, match=r"^--num-workers -3: expected 0 or more loader worker processes$"):
        dataclasses.replace(parse([str(four_task_run), "--out", str(out)]), num_workers=-3)
    # evaluate_runs called directly: its loader settings refuse it, before anything is written
    with pytest.raises(MimaError, match=r"workers -3 .*expected >= 1 / >= 0 / >= 1"):
        evaluate_runs([four_task_run], out, ["uniform"], num_workers=-3)
    assert not out.exists()


SRUN_TASK_1 = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "evaluate_sweep.sbatch", "SLURM_NTASKS": "2",
               "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
               "SLURM_RESTART_COUNT": "3"}


@pytest.fixture
def launcher(monkeypatch):
    """Sets a launcher's variables for team_for (none of this process's own)."""
    for variable in [*SRUN_TASK_1, "LOCAL_RANK", Team.RANK_ENV, Team.WORLD_ENV, Team.SESSION_ENV]:
        monkeypatch.delenv(variable, raising=False)

    def set_environment(environment: dict) -> None:
        for variable, value in environment.items():
            monkeypatch.setenv(variable, value)
    return set_environment


def test_an_srun_task_is_its_own_rank_of_the_step(launcher):
    launcher(SRUN_TASK_1)
    team = team_for(None, ["runs/N1", "--out", "table"])
    assert (team.rank, team.world, team.local_rank, team.session, team.argv) == (1, 2, 1, "slurm4242.0.r3", None)
    assert team_for(2).world == 2
    with pytest.raises(MimaError, match=r"^--devices 4: this srun step has 2 tasks \(one process each\); omit --devices$"):
        team_for(4)


def test_a_child_of_process_0_takes_its_rank_and_session(launcher):
    launcher({**SRUN_TASK_1, Team.RANK_ENV: "3", Team.WORLD_ENV: "4", Team.SESSION_ENV: "host-1-2"})
    team = team_for(4)
    assert (team.rank, team.world, team.local_rank, team.session) == (3, 4, 3, "host-1-2")


def test_one_process_by_hand_takes_its_launchers_local_rank(launcher):
    launcher({"LOCAL_RANK": "1"})
    team = team_for(None, ["runs/N1"])
    assert (team.rank, team.world, team.local_rank, team.argv) == (0, 1, 1, None)
    launcher({"LOCAL_RANK": "x"})
    with pytest.raises(MimaError, match=r"^LOCAL_RANK='x': expected the process's local rank, a whole number$"):
        team_for(None)


@pytest.mark.parametrize("rank, visible, index", [
    (0, 8, 0), (5, 8, 5), (7, 8, 7),
    (0, 1, 0), (5, 1, 0),  # bound to one GPU per task (--gpus-per-task=1): its GPU is index 0
])
def test_each_local_rank_takes_its_own_gpu(rank, visible, index):
    assert device_index(rank, visible) == index


def test_a_local_rank_beyond_the_visible_gpus_is_one_line():
    with pytest.raises(MimaError, match=r"^local rank 4: this process sees 4 GPUs"):
        device_index(4, 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA: on a GPU machine evaluation uses CUDA by design, and the GPU test below runs instead")
def test_on_the_cpu_cuda_is_never_touched(four_task_run, tmp_path):
    assert claim_device(3) == torch.device("cpu")
    out = tmp_path / "table"
    assert evaluate_runs([four_task_run], out, ["uniform"], team=Team(session="cpu", local_rank=3)) is not None
    assert not torch.cuda.is_initialized()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_process_evaluates_on_the_gpu_of_its_local_rank(four_task_run, tmp_path):
    """The last GPU's local rank (with one GPU: rank 1, as at a site that binds one GPU per task, where
    the old code asked for cuda:1 and failed)."""
    visible = torch.cuda.device_count()
    rank = visible - 1 if visible > 1 else 1
    previous = torch.cuda.current_device()
    try:
        results = evaluate_runs([four_task_run], tmp_path / "table", ["uniform"], num_workers=WORKERS,
                                team=Team(session="gpu", local_rank=rank))
        assert results and torch.cuda.current_device() == device_index(rank, visible)
    finally:
        torch.cuda.set_device(previous)


def test_merge_device_cpu_computes_the_merges_there_and_an_absent_gpu_is_refused(four_task_run, tmp_path, capfd):
    """--merge-device: the merges (here TSV's SVDs) through the device path of mima.merging on the CPU
    give the results the default gives; a GPU this machine lacks is one line before any work. (On a
    GPU machine the default is the GPU, whose merges agree with the CPU's to rounding, not bit for bit:
    the test below compares them there; this was seen on an H100 on 2026-11-27.)"""
    argv = ["evaluate", str(four_task_run), "--merges", "uniform", "tsv", "--no-select", "--num-workers", "0"]
    if not torch.cuda.is_available():
        assert main([*argv, "--out", str(tmp_path / "default")]) == 0
        assert main([*argv, "--out", str(tmp_path / "cpu"), "--merge-device", "cpu"]) == 0
        default = json.loads((tmp_path / "default" / "results.json").read_text())
        on_cpu = json.loads((tmp_path / "cpu" / "results.json").read_text())
        assert on_cpu == default and any(row["model"] == "tsv" for row in on_cpu)
        capfd.readouterr()
        assert main([*argv, "--out", str(tmp_path / "gpu"), "--merge-device", "cuda"]) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--merge-device cuda: torch sees no CUDA device" in err[0], err
        assert not (tmp_path / "gpu").exists()
    assert main([*argv, "--out", str(tmp_path / "bad"), "--merge-device", "gpu"]) == 2
    assert "argument --merge-device: expected auto, cpu, cuda or cuda:N" in capfd.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_merges_on_the_gpu_agree_with_the_cpu(four_task_run, tmp_path):
    argv = ["evaluate", str(four_task_run), "--merges", "uniform", "ties", "tsv", "cart", "--no-select"]
    assert main([*argv, "--out", str(tmp_path / "cpu"), "--merge-device", "cpu"]) == 0
    assert main([*argv, "--out", str(tmp_path / "gpu"), "--merge-device", "cuda"]) == 0
    cpu = json.loads((tmp_path / "cpu" / "results.json").read_text())
    gpu = json.loads((tmp_path / "gpu" / "results.json").read_text())
    # within an image or two per task: the merged weights agree to float32 rounding (1e-5 relative)
    for a, b in zip(cpu, gpu):
        assert (a["model"], a["task"]) == (b["model"], b["task"]) and abs(a["accuracy"] - b["accuracy"]) < 1.0, (a, b)
