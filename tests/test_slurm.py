"""The project's own sbatch script on a real SLURM: preempted mid-run, requeued, resumed, identical.

Starts munged, slurmctld and slurmd (Debian's slurm-wlm) for the test and stops them afterwards.
Skipped, with the reason, only where SLURM is not installed or cannot be started (not root).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from mima.safetensors_io import load_state_dict
from tests.slurm_cluster import missing_requirement, start_cluster
from tests.test_distributed import job_environment

REPO = Path(__file__).resolve().parents[1]
TASKS = ["rot90", "mirror"]


@pytest.fixture
def slurm(tmp_path):
    reason = missing_requirement()
    if reason:
        pytest.skip(reason)
    cluster = start_cluster(tmp_path / "slurm", cpus=2)
    yield cluster
    cluster.stop()


def _wait(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_cpu_sbatch_job_survives_preemption(slurm, tmp_path, small_clip):
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "seed_everything": 0,
        "model": {"clip": small_clip, "steps": 800, "iterations": 4, "lr": 1e-3, "warmup_steps": 10},
        "data": {"suite": "digits", "tasks": TASKS, "batch_size": 32, "seed": 5},
        "trainer": {"enable_progress_bar": False, "enable_model_summary": False, "logger": False},
    }))
    # The uninterrupted run to compare with: the same two processes, outside SLURM.
    reference = tmp_path / "reference"
    fit = [sys.executable, "-m", "mima", "fit", "--config", str(config), "--trainer.accelerator", "cpu",
           "--trainer.devices", "2", "--threads_per_process", "1", "--out", str(reference)]
    result = subprocess.run(fit, cwd=REPO, capture_output=True, text=True, timeout=600, env=job_environment())
    assert result.returncode == 0, result.stderr[-3000:]

    runs, work = tmp_path / "runs", tmp_path / "work"
    work.mkdir()
    activate = f"export PATH={Path(sys.executable).parent}:$PATH"
    submitted = slurm.run(
        "sbatch", "--parsable", f"--chdir={work}", f"--output={work}/slurm-%j.out",
        f"--export=ALL,MIMA_CONFIG={config},MIMA_RUNS={runs},MIMA_ENV_ACTIVATE={activate}",
        str(REPO / "slurm" / "cpu.sbatch"), cwd=REPO,
    )
    job = submitted.stdout.strip().split(";")[0]
    run_dir, log = runs / job, work / f"slurm-{job}.out"
    started = time.monotonic()

    # Preempt once the run has saved its first checkpoint and is mid-way through the second phase.
    _wait(lambda: (run_dir / "checkpoints" / "last.ckpt").exists(), 300, "the first checkpoint")
    slurm.run("scancel", "--signal=USR1", job)
    _wait(lambda: int(slurm.job_field(job, "Restarts") or 0) >= 1, 120, "the job to be requeued")
    # A requeued job finishes COMPLETING, then waits ~2 minutes in PENDING (BeginTime); start it now.
    _wait(lambda: slurm.job_field(job, "JobState") == "PENDING", 120, "the requeued job to be pending")
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    _wait(lambda: slurm.job_field(job, "JobState") == "COMPLETED", 600, "the job to complete", interval=1)
    print(f"SLURM job {job}: submitted, preempted, requeued, resumed and completed in {time.monotonic() - started:.0f} s")

    text = log.read_text()
    assert "stopped by signal 10" in text and f"requeued SLURM job {job}" in text
    assert "restart 1" in text and "resuming from" in text
    for task in TASKS:
        a = load_state_dict(run_dir / "final" / f"{task}.safetensors")
        b = load_state_dict(reference / "final" / f"{task}.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a), task
