"""The project's own sbatch scripts on a real SLURM: cpu.sbatch preempted mid-run, requeued, resumed,
identical; sweep_n.sbatch as a job array whose elements each fit one N and evaluate it.

Starts munged, slurmctld and slurmd (Debian's slurm-wlm) for the test and stops them afterwards.
Skipped, with the reason, only where SLURM is not installed or cannot be started (not root); under
CI (MIMA_CI=1 or CI=true) that is a failure instead (tests/ci_mode.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from mima.core.safetensors_io import load_state_dict
from tests.ci_mode import require
from tests.slurm_cluster import missing_requirement, start_cluster
from tests.test_distributed import job_environment

REPO = Path(__file__).resolve().parents[1]
TASKS = ["rot90", "mirror"]


def _cluster(folder: Path, nodes: int):
    require(missing_requirement())
    cluster = start_cluster(folder, cpus=2, nodes=nodes)
    yield cluster
    cluster.stop()


@pytest.fixture
def slurm(tmp_path):
    yield from _cluster(tmp_path / "slurm", nodes=1)


@pytest.fixture
def slurm_two_nodes(tmp_path):
    yield from _cluster(tmp_path / "slurm", nodes=2)


@pytest.fixture(scope="module")
def job(tmp_path_factory, small_clip):
    """The job's config and its uninterrupted run: the same two processes, outside SLURM."""
    require(missing_requirement())
    folder = tmp_path_factory.mktemp("slurm-job")
    config = folder / "job.yaml"
    config.write_text(yaml.safe_dump({
        "seed_everything": 0,
        "model": {"clip": small_clip, "steps": 800, "iterations": 4, "lr": 1e-3, "warmup_steps": 10},
        "data": {"suite": "digits", "tasks": TASKS, "batch_size": 32, "seed": 5},
        "trainer": {"enable_progress_bar": False, "enable_model_summary": False, "logger": False},
    }))
    reference = folder / "reference"
    fit = [sys.executable, "-m", "mima", "fit", "--config", str(config), "--trainer.accelerator", "cpu",
           "--trainer.devices", "2", "--threads_per_process", "1", "--out", str(reference)]
    result = subprocess.run(fit, cwd=REPO, capture_output=True, text=True, timeout=600, env=job_environment())
    assert result.returncode == 0, result.stderr[-3000:]
    return config, reference


def _submit(cluster, config: Path, work: Path, runs: Path, *options: str, exports: str = "",
            script: str = "cpu.sbatch", args: tuple[str, ...] = ()) -> str:
    work.mkdir(exist_ok=True)
    activate = f"export PATH={Path(sys.executable).parent}:$PATH"
    submitted = cluster.run(
        "sbatch", "--parsable", f"--chdir={work}", f"--output={work}/slurm-%j.out", *options,
        f"--export=ALL,MIMA_CONFIG={config},MIMA_RUNS={runs},MIMA_ENV_ACTIVATE={activate}{exports}",
        str(REPO / "slurm" / script), *args, cwd=REPO,
    )
    return submitted.stdout.strip().split(";")[0]


def _drive_to_completion(cluster, job_id: str, timeout: float) -> list[str]:
    """Wait for COMPLETED. A requeued job waits ~2 minutes in PENDING (reason BeginTime) before it may
    start again: start it at once. Returns the (state, reason) transitions seen, for the report."""
    history: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state, reason = cluster.job_field(job_id, "JobState"), cluster.job_field(job_id, "Reason")
        if not history or history[-1] != f"{state}/{reason}":
            history.append(f"{state}/{reason}")
        if state == "COMPLETED":
            return history
        if state in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        if state == "PENDING" and reason == "BeginTime":
            # SLURM's delay lets slurmd's revocation of the old job credential (kept per second) pass;
            # started within that second the job dies with "Job credential revoked" (seen in CI)
            time.sleep(2)
            cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)
        time.sleep(0.5)
    log = (cluster.folder / "slurmctld.log").read_text()[-3000:]
    raise AssertionError(f"job {job_id} did not complete; states {history}; slurmctld log tail:\n{log}")


def _assert_same_final(run_dir: Path, reference: Path) -> None:
    for task in TASKS:
        a = load_state_dict(run_dir / "final" / f"{task}.safetensors")
        b = load_state_dict(reference / "final" / f"{task}.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), task


def _wait(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_cpu_sbatch_job_survives_preemption(slurm, tmp_path, job):
    config, reference = job
    runs, work = tmp_path / "runs", tmp_path / "work"
    job_id = _submit(slurm, config, work, runs)
    run_dir, log = runs / job_id, work / f"slurm-{job_id}.out"
    started = time.monotonic()

    # Preempt once the run has saved its first checkpoint and is on its way through the next phase.
    _wait(lambda: (run_dir / "checkpoints" / "last.ckpt").exists(), 300, "the first checkpoint")
    slurm.run("scancel", "--signal=USR1", job_id)
    history = _drive_to_completion(slurm, job_id, timeout=600)
    print(f"SLURM job {job_id}: submitted, preempted, requeued, resumed and completed in "
          f"{time.monotonic() - started:.0f} s; states: {history}")
    assert int(slurm.job_field(job_id, "Restarts")) == 1

    text = log.read_text()
    assert "stopped by signal 10" in text and f"requeued SLURM job {job_id}" in text
    assert "restart 1" in text and "resuming from" in text
    _assert_same_final(run_dir, reference)


def test_cpu_sbatch_on_two_nodes_matches_one_node(slurm_two_nodes, tmp_path, job):
    config, reference = job
    runs, work = tmp_path / "runs", tmp_path / "work"
    job_id = _submit(slurm_two_nodes, config, work, runs, "--nodes=2", "--ntasks-per-node=1",
                     exports=",MASTER_ADDR=127.0.0.1")  # the test's node names do not resolve
    started = time.monotonic()
    _drive_to_completion(slurm_two_nodes, job_id, timeout=600)
    print(f"SLURM job {job_id} on 2 nodes completed in {time.monotonic() - started:.0f} s")
    assert "2 node(s) x 1 process(es)" in (work / f"slurm-{job_id}.out").read_text()
    _assert_same_final(runs / job_id, reference)


SWEEP_MODELS = ("zero_shot", "fine_tuned", "uniform", "task_arithmetic", "ties", "cart")


def test_sweep_array_fits_and_evaluates_each_n(slurm, tmp_path, small_clip):
    """slurm/sweep_n.sbatch as a user submits it, with the GPU site settings overridden for this CPU
    cluster: elements 0 and 3 (N = 1 and N = 8) each fit in runs/<array id>_N<n>/ and then write
    their own results table."""
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump({
        "seed_everything": 0,
        "model": {"clip": small_clip, "steps": 40, "iterations": 1, "lr": 1e-3, "warmup_steps": 4},
        "data": {"suite": "digits", "tasks": TASKS, "batch_size": 16, "seed": 5},
        "trainer": {"enable_progress_bar": False, "enable_model_summary": False, "logger": False},
    }))
    runs, work = tmp_path / "runs", tmp_path / "work"
    # --gres=none drops the script's GPU request (this cluster has no GRES); the partition and CPU
    # counts replace its GPU-node settings. One process per element lets both elements run at once.
    array_id = _submit(
        slurm, config, work, runs, "--array=0,3", "--partition=debug", "--gres=none", "--ntasks-per-node=1",
        "--cpus-per-task=1", f"--output={work}/slurm-%A_%a.out",
        exports=",MIMA_ACCELERATOR=cpu", script="sweep_n.sbatch", args=("--threads_per_process", "1"),
    )
    started = time.monotonic()
    for index in (0, 3):
        _drive_to_completion(slurm, f"{array_id}_{index}", timeout=300)
    print(f"SLURM array {array_id} (N = 1 and N = 8): fitted and evaluated in {time.monotonic() - started:.0f} s")

    for index, n in ((0, 1), (3, 8)):
        run_dir = runs / f"{array_id}_N{n}"
        log = (work / f"slurm-{array_id}_{index}.out").read_text()
        assert f"N={n} finished" in log, log[-3000:]
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["iterations"] == n
        assert all((run_dir / "final" / f"{task}.safetensors").is_file() for task in TASKS)
        rows = json.loads((run_dir / "evaluation" / "results.json").read_text())
        assert {row["N"] for row in rows} == {n}
        assert {(row["model"], row["task"]) for row in rows} == {
            (model, task) for model in SWEEP_MODELS for task in (*TASKS, "mean")
        }
        assert all(0.0 <= row["accuracy"] <= 1.0 for row in rows)
