"""The project's own SLURM scripts on a real SLURM: cpu.sbatch preempted mid-run, requeued, resumed,
identical; cpu.sbatch cancelled with scancel and submitted again (a new job id), resumed in the same
run folder, identical; the sweep as submit_sweep.sh submits it: a fit-only job array over N and
seeds, then an evaluation job that waits for it (afterany) and writes the table with the mean and
standard deviation over seeds. Without SLURM: the srun command launch.sh builds, and the
one-GPU-per-task variant (gpus_per_task.sbatch, one_gpu_task.sh) against the installed Lightning
with one visible GPU simulated (no GPU here).

Starts munged, slurmctld and slurmd (Debian's slurm-wlm) for the test and stops them afterwards.
Skipped, with the reason, only where SLURM is not installed or cannot be started (not root); under
CI (MIMA_CI=1 or CI=true) that is a failure instead (tests/ci_mode.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import yaml

from mima.core.errors import MimaError
from mima.core.safetensors_io import load_state_dict
from tests.ci_mode import require
from tests.slurm_cluster import free_port, missing_requirement, start_cluster
from tests.helpers import fit_config, run_job

REPO = Path(__file__).resolve().parents[2]
TASKS = ["rot90", "mirror"]
RUN_NAME = "job-N4-seed0"  # launch.sh's {config}-N{iterations}-seed{seed} for the job fixture's job.yaml


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


def _job_config(clip: str, steps: int, iterations: int, warmup_steps: int, batch_size: int) -> dict:
    """A SLURM job's `mima fit` config: the small CLIP on TASKS, no accelerator or device count (the
    job's allocation and SLURM's environment decide them)."""
    return {
        "seed_everything": 0,
        "model": {"clip": clip, "steps": steps, "iterations": iterations, "lr": 1e-3, "warmup_steps": warmup_steps},
        "data": {"suite": "digits", "tasks": TASKS, "batch_size": batch_size, "seed": 5},
        "trainer": {"enable_progress_bar": False, "enable_model_summary": False, "logger": False},
    }


@pytest.fixture(scope="module")
def job(tmp_path_factory, small_clip):
    """The job's config and its uninterrupted run, outside SLURM, in one process (the SLURM jobs run two:
    the task models are the same at any W, tests/distributed/test_distributed.py)."""
    require(missing_requirement())
    folder = tmp_path_factory.mktemp("slurm-job")
    config = folder / "job.yaml"
    config.write_text(yaml.safe_dump(_job_config(small_clip, steps=800, iterations=4, warmup_steps=10, batch_size=32)))
    reference = folder / "reference"
    result = run_job(config, reference, "--trainer.accelerator", "cpu", "--threads_per_process", "1")
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


def _wait_for_checkpoint(cluster, job_id: str, run_dir: Path, log: Path) -> None:
    """Until training is under way: something saved under RUN/checkpoints (its layout is mima fit's
    business; a stop request makes it save a consistent state before it exits). Fails at once,
    with the job's log, if the job ends first."""
    def saved() -> bool:
        if cluster.job_field(job_id, "JobState") not in ("PENDING", "CONFIGURING", "RUNNING"):
            text = log.read_text()[-3000:] if log.exists() else "(no log)"
            raise AssertionError(f"job {job_id} ended before its first checkpoint; log tail:\n{text}")
        return any(path.is_file() for path in (run_dir / "checkpoints").rglob("*"))

    _wait(saved, 300, f"the first checkpoint of job {job_id}")


@pytest.mark.slow
def test_cpu_sbatch_job_survives_preemption(slurm, tmp_path, job):
    config, reference = job
    runs, work = tmp_path / "runs", tmp_path / "work"
    job_id = _submit(slurm, config, work, runs)
    run_dir, log = runs / RUN_NAME, work / f"slurm-{job_id}.out"
    started = time.monotonic()

    # Preempt once the run has saved its first checkpoint and is on its way through the next phase.
    _wait_for_checkpoint(slurm, job_id, run_dir, log)
    slurm.run("scancel", "--signal=USR1", job_id)
    history = _drive_to_completion(slurm, job_id, timeout=600)
    print(f"SLURM job {job_id}: submitted, preempted, requeued, resumed and completed in "
          f"{time.monotonic() - started:.0f} s; states: {history}")
    assert int(slurm.job_field(job_id, "Restarts")) == 1

    text = log.read_text()
    assert "stopped by signal 10" in text and f"requeueing SLURM job {job_id}" in text
    assert "restart 1" in text and "resuming from" in text
    assert f"-> {runs}/job-N{{iterations}}-seed{{seed}}" in text  # launch.sh names the run, not the job id
    _assert_same_final(run_dir, reference)
    assert not (run_dir / "checkpoints").exists()  # removed once the run has finished


@pytest.mark.slow
def test_cancelled_job_submitted_again_resumes_its_run(slurm, tmp_path, job):
    """`scancel` (not a requeue) mid-run, then the same sbatch again: a new job id, the same run name,
    so the new job resumes the run folder and ends with the uninterrupted run's final models."""
    config, reference = job
    runs, work = tmp_path / "runs", tmp_path / "work"
    run_dir = runs / RUN_NAME
    first = _submit(slurm, config, work, runs)
    started = time.monotonic()
    _wait_for_checkpoint(slurm, first, run_dir, work / f"slurm-{first}.out")
    slurm.run("scancel", first)  # SIGTERM to every process, SIGKILL after KillWait (30 s)
    _wait(lambda: slurm.job_field(first, "JobState") not in ("RUNNING", "COMPLETING"), 120, f"job {first} to end")
    # A cancelled job must stay cancelled. If the stopped fit requeued it, it would start again
    # later on the same run folder as the job submitted below: cancel the requeued copy so that it
    # cannot disturb the rest of the test, and fail at the end.
    requeued_after_cancel = slurm.job_field(first, "JobState") != "CANCELLED"
    if requeued_after_cancel:
        slurm.run("scancel", first)
        _wait(lambda: slurm.job_gone(first), 120, f"the requeued job {first} to be cancelled")
    first_log = (work / f"slurm-{first}.out").read_text()
    assert "stopped by signal 15" in first_log, first_log[-3000:]  # SIGTERM: saved, then stopped

    second = _submit(slurm, config, work, runs)
    assert second != first
    history = _drive_to_completion(slurm, second, timeout=600)
    print(f"SLURM job {first} cancelled mid-run, job {second} submitted again: resumed and completed in "
          f"{time.monotonic() - started:.0f} s; states: {history}")
    text = (work / f"slurm-{second}.out").read_text()
    assert "restart 0" in text and "resuming from" in text, text[-3000:]
    _assert_same_final(run_dir, reference)
    assert not requeued_after_cancel, (
        f"job {first} was requeued after `scancel` (state {slurm.job_field(first, 'JobState')}, "
        f"restarts {slurm.job_field(first, 'Restarts')}): `mima fit` ran `scontrol requeue` on SIGTERM, which "
        "SLURM accepts for a job being cancelled; it should requeue only on the time-limit signal (SIGUSR1)"
    )


@pytest.mark.slow
def test_cpu_sbatch_on_two_nodes_matches_one_node(slurm_two_nodes, tmp_path, job):
    config, reference = job
    runs, work = tmp_path / "runs", tmp_path / "work"
    # The test's node names do not resolve: MASTER_ADDR. MASTER_PORT set by hand, as launch.sh's header
    # says to do when the default port is taken: srun hands it to the processes on both nodes.
    job_id = _submit(slurm_two_nodes, config, work, runs, "--nodes=2", "--ntasks-per-node=1",
                     exports=f",MASTER_ADDR=127.0.0.1,MASTER_PORT={free_port()}")
    started = time.monotonic()
    _drive_to_completion(slurm_two_nodes, job_id, timeout=600)
    print(f"SLURM job {job_id} on 2 nodes completed in {time.monotonic() - started:.0f} s")
    assert "2 node(s) x 1 process(es)" in (work / f"slurm-{job_id}.out").read_text()
    _assert_same_final(runs / RUN_NAME, reference)


SWEEP_MODELS = ("zero_shot", "fine_tuned", "uniform", "task_arithmetic", "ties", "cart")
SWEEP_N = (2,)  # one N, two seeds: two array elements, both at once on this 2-CPU cluster


@pytest.mark.slow
def test_sweep_fits_an_array_then_a_dependent_job_evaluates(slurm, tmp_path, small_clip):
    """slurm/submit_sweep.sh as a user runs it, with the GPU site settings overridden for this CPU
    cluster: a fit-only array over N in {2} and seeds {0, 1}, each run in <config>-N<n>-seed<s>/ (which
    element gets which N and seed: test_sweep_element_passes_its_n_and_seed, for several N),
    then the evaluation job (afterany on the array): the combined table, whose rows over seeds are
    checked by hand; submitted again, it finds every cell done and writes the same table."""
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(_job_config(small_clip, steps=40, iterations=1, warmup_steps=4, batch_size=16)))
    runs, work = tmp_path / "runs", tmp_path / "work"
    work.mkdir()
    environment = {
        "MIMA_CONFIG": str(config), "MIMA_RUNS": str(runs), "MIMA_ACCELERATOR": "cpu",
        "MIMA_ENV_ACTIVATE": f"export PATH={Path(sys.executable).parent}:$PATH",
        "MIMA_ITERATIONS": " ".join(map(str, SWEEP_N)), "MIMA_SEEDS": "0 1",
        # one process per element lets two elements run at once on this 2-CPU cluster
        "MIMA_FIT_SBATCH": f"--ntasks-per-node=1 --cpus-per-task=1 --output={work}/slurm-%A_%a.out",
        "MIMA_EVAL_SBATCH": f"--ntasks-per-node=1 --cpus-per-task=2 --output={work}/slurm-eval-%j.out",
    }
    # --gres=none drops the scripts' GPU request (this cluster has no GRES); the partition replaces theirs
    submitted = slurm.run("bash", str(REPO / "slurm" / "submit_sweep.sh"), f"--chdir={work}", "--partition=debug",
                          "--gres=none", "--", "--threads_per_process", "1", cwd=REPO, extra_env=environment, check=False)
    assert submitted.returncode == 0, submitted.stderr
    array_id = re.search(rf"fit array job (\d+) \({2 * len(SWEEP_N)} runs", submitted.stdout).group(1)
    evaluation_id = re.search(r"evaluation job (\d+)", submitted.stdout).group(1)
    assert slurm.job_field(evaluation_id, "Dependency").startswith(f"afterany:{array_id}")
    started = time.monotonic()
    _drive_to_completion(slurm, evaluation_id, timeout=600)
    print(f"SLURM array {array_id} (N = {SWEEP_N} x seeds 0, 1) fitted and job {evaluation_id} evaluated it in "
          f"{time.monotonic() - started:.0f} s")
    assert all(slurm.job_field(f"{array_id}_{index}", "JobState") == "COMPLETED" for index in range(2 * len(SWEEP_N)))

    runs_of = {(n, seed): runs / f"tiny-N{n}-seed{seed}" for n in SWEEP_N for seed in (0, 1)}
    for (n, seed), run_dir in runs_of.items():
        written = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert (written["model"]["iterations"], written["seed_everything"], written["data"]["seed"]) == (n, seed, seed)
        assert all((run_dir / "final" / f"{task}.safetensors").is_file() for task in TASKS)
    rows = json.loads((runs / "tiny-sweep" / "results.json").read_text())
    per_run = {(r["N"], r["seed"], r["model"], r["task"]): r["accuracy"] for r in rows if r["seed"] != "mean"}
    assert set(per_run) == {(n, seed, model, task) for n in SWEEP_N for seed in (0, 1) for model in SWEEP_MODELS
                            for task in (*TASKS, "mean")}
    assert all(0.0 <= value <= 1.0 for value in per_run.values())
    aggregate = {(r["N"], r["model"], r["task"]): r for r in rows if r["seed"] == "mean"}
    assert set(aggregate) == {(n, model, task) for n in SWEEP_N for model in SWEEP_MODELS for task in (*TASKS, "mean")}
    for (n, model, task), row in aggregate.items():
        a, b = per_run[(n, 0, model, task)], per_run[(n, 1, model, task)]
        if model == "zero_shot":  # theta_0, evaluated once with seed 0's run: that one value, no spread
            assert a == b and (row["seeds"], row["accuracy"], row["accuracy_std"]) == ([0], a, None)
            continue
        # two seeds: mean (a + b) / 2, sample standard deviation |a - b| / sqrt(2)
        assert row["seeds"] == [0, 1]
        assert math.isclose(row["accuracy"], (a + b) / 2, abs_tol=1e-12)
        assert math.isclose(row["accuracy_std"], abs(a - b) / math.sqrt(2), abs_tol=1e-12)
    assert any((row["accuracy_std"] or 0) > 0 for row in aggregate.values())  # the seeds trained different models

    # The evaluation submitted again (as after a preemption): every cell is found, none is evaluated again.
    again = slurm.run("sbatch", "--parsable", f"--chdir={work}", "--partition=debug", "--gres=none",
                      "--ntasks-per-node=1", "--cpus-per-task=2", f"--output={work}/slurm-eval-%j.out", str(REPO / "slurm" / "evaluate_sweep.sbatch"),
                      cwd=REPO, extra_env=environment).stdout.strip().split(";")[0]
    _drive_to_completion(slurm, again, timeout=300)
    log = (work / f"slurm-eval-{again}.out").read_text()
    cells = sum(path.read_text().count("\n") for path in (runs / "tiny-sweep" / "cells").glob("*.jsonl"))
    assert f"{cells} cells already done" in log, log[-3000:]
    assert json.loads((runs / "tiny-sweep" / "results.json").read_text()) == rows


# ------------------------------------------------------------------- launch.sh without SLURM
def _fake_srun(tmp_path: Path, script: str, **variables: str) -> list[str]:
    """The arguments that `script` (an sbatch script or launch.sh) hands to srun, with srun replaced
    by a stub that records them, in the environment a SLURM job on node n1 would have."""
    stub = tmp_path / "bin" / "srun"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$SRUN_ARGUMENTS"\n')
    stub.chmod(0o755)
    recorded = tmp_path / "srun-arguments"
    environment = {
        "PATH": f"{stub.parent}:{os.environ['PATH']}", "SRUN_ARGUMENTS": str(recorded), "SLURM_SUBMIT_DIR": str(REPO),
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n1", "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "8",
        "SLURM_CPUS_PER_TASK": "6", "MIMA_CONFIG": "configs/clip/ViT-B-32.yaml", "MIMA_ENV_ACTIVATE": "true",
        **variables,
    }
    result = subprocess.run(["bash", str(REPO / "slurm" / script), "--data.root", "/data/clip"], cwd=tmp_path,
                            env=environment, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return recorded.read_text().splitlines()


def test_launch_names_the_run_by_config_n_and_seed(tmp_path):
    fit = ["mima", "fit", "--config", "configs/clip/ViT-B-32.yaml", "--trainer.accelerator", "gpu", "--trainer.devices",
           "8", "--trainer.num_nodes", "1"]
    arguments = _fake_srun(tmp_path, "one_node.sbatch", MIMA_RUNS="/scratch/me/mima-runs")
    assert arguments == ["--kill-on-bad-exit=1", "--cpus-per-task=6", *fit,
                         "--out", "/scratch/me/mima-runs/{config}-N{iterations}-seed{seed}", "--ckpt_path", "last",
                         "--data.root", "/data/clip"]
    named = _fake_srun(tmp_path, "one_node.sbatch", MIMA_RUN_NAME="lr-1e-4-N{iterations}")
    assert named[named.index("--out") + 1] == "runs/lr-1e-4-N{iterations}"


def test_sweep_element_passes_its_n_and_seed(tmp_path):
    # MIMA_ITERATIONS "1 4 16" x MIMA_SEEDS "0 7": element 4 is N = 4 (4 % 3 = 1) with seed 7 (4 // 3 = 1)
    arguments = _fake_srun(tmp_path, "sweep_n.sbatch", SLURM_ARRAY_TASK_ID="4", MIMA_ITERATIONS="1 4 16",
                           MIMA_SEEDS="0 7")
    tail = arguments[arguments.index("last") + 1:]
    assert tail == ["--model.iterations", "4", "--seed_everything", "7", "--data.seed", "7", "--data.root", "/data/clip"]


def test_gpus_per_task_variant_unbinds_and_wraps_each_process(tmp_path):
    arguments = _fake_srun(tmp_path, "gpus_per_task.sbatch")
    wrapper = str(REPO / "slurm" / "one_gpu_task.sh")
    assert arguments[:6] == ["--kill-on-bad-exit=1", "--cpus-per-task=6", "--gpu-bind=none", "bash", wrapper, "mima"]
    bound = _fake_srun(tmp_path, "gpus_per_task.sbatch", MIMA_GPU_BIND="")  # keep Slurm's binding
    assert bound[:4] == ["--kill-on-bad-exit=1", "--cpus-per-task=6", "bash", wrapper]


def _task_environment(**variables: str) -> dict[str, str]:
    """The environment slurm/one_gpu_task.sh gives the command it starts."""
    base = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "4242", "SLURM_NTASKS_PER_NODE": "8", "SLURM_LOCALID": "5"}
    result = subprocess.run(["bash", str(REPO / "slurm" / "one_gpu_task.sh"), "env"], env={**base, **variables},
                            capture_output=True, text=True, check=True)
    return dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)


def test_one_gpu_task_changes_only_a_process_that_sees_one_gpu():
    one = _task_environment(CUDA_VISIBLE_DEVICES="3")
    assert one["SLURM_LOCALID"] == "0" and one["TORCHELASTIC_RUN_ID"] == "4242"
    for unchanged in (_task_environment(CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"),
                      _task_environment(CUDA_VISIBLE_DEVICES="3", SLURM_NTASKS_PER_NODE="1")):
        assert unchanged["SLURM_LOCALID"] == "5" and "TORCHELASTIC_RUN_ID" not in unchanged


def test_lightning_runs_a_process_that_sees_one_gpu(tmp_path, small_clip):
    """Process 5 of 8 on one node (local id 5) bound to its own GPU: mima's Trainer, built by the
    installed Lightning with one visible CUDA device simulated, fails as Lightning issue #16828
    describes; in one_gpu_task.sh's environment it keeps SLURM's ranks and takes cuda:0. (Only the
    device choice: no GPU here, nothing is trained.)"""
    import lightning.fabric.accelerators.cuda as lightning_cuda
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from mima.commands.fit.parser import build_cli
    from mima.services.fit.build import build_trainer
    from mima.services.fit.program import fit_settings

    job = {"SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "8", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
           "SLURM_PROCID": "5", "SLURM_LOCALID": "5", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "mima",
           "SLURM_NODELIST": "n1", "CUDA_VISIBLE_DEVICES": "3"}
    wrapped = _task_environment(**job)
    shell_own = ("PATH", "PWD", "OLDPWD", "SHLVL", "_")  # what bash itself sets
    changed = {key: value for key, value in wrapped.items() if job.get(key) != value and key not in shell_own}
    assert changed == {"SLURM_LOCALID": "0", "TORCHELASTIC_RUN_ID": "4242"}

    def device_choice(environment: dict[str, str]) -> tuple:
        config = fit_config(tmp_path / "run", small_clip, TASKS, steps=8, iterations=1)
        config["trainer"].update(accelerator="gpu", devices=8, num_nodes=1)
        with mock.patch.dict(os.environ, environment), mock.patch.object(lightning_cuda, "num_cuda_devices", return_value=1), \
                mock.patch("torch.cuda.is_available", return_value=True), mock.patch("torch.cuda.device_count", return_value=1):
            trainer = build_trainer(fit_settings(build_cli(config), "cli")).trainer  # SLURMEnvironment reads the variables when asked: ask here
            return (type(trainer.strategy.cluster_environment).__name__, trainer.strategy.root_device,
                    trainer.global_rank, trainer.world_size, trainer.num_devices)

    # Lightning's own refusal (as mima's one line "trainer: ..." where build_trainer makes the Trainer)
    with pytest.raises((MisconfigurationException, MimaError), match=r"You requested gpu: \[0, 1, 2, 3, 4, 5, 6, 7\]\s+But your machine only has: \[0\]"):
        device_choice(job)
    assert device_choice({**job, **changed}) == ("SLURMEnvironment", torch.device("cuda", 0), 5, 8, 8)


def _evaluation_command(tmp_path: Path, runs: Path, **variables: str) -> subprocess.CompletedProcess:
    """evaluate_sweep.sbatch run by bash with `mima` replaced by a stub that records its arguments."""
    stub = tmp_path / "bin" / "mima"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$MIMA_ARGUMENTS"\n')
    stub.chmod(0o755)
    environment = {"PATH": f"{stub.parent}:{os.environ['PATH']}", "MIMA_ARGUMENTS": str(tmp_path / "mima-arguments"),
                   "SLURM_JOB_ID": "4243", "MIMA_CONFIG": "configs/tiny.yaml", "MIMA_ENV_ACTIVATE": "true",
                   "MIMA_RUNS": str(runs), **variables}
    return subprocess.run(["bash", str(REPO / "slurm" / "evaluate_sweep.sbatch")], cwd=tmp_path, env=environment,
                          capture_output=True, text=True, timeout=60)


def test_sweep_evaluation_finds_the_runs_by_name(tmp_path):
    runs = tmp_path / "runs"
    for name in ("tiny-N1-seed3", "tiny-N1-seed5", "tiny-N2-seed3", "tiny-N16-seed3", "other-N1-seed3"):
        (runs / name).mkdir(parents=True)
    expected_tail = ["--out", str(runs / "tiny-sweep"), "--merges", "uniform", "ties", "--skip-unfinished"]

    seeded = _evaluation_command(tmp_path, runs, MIMA_ITERATIONS="1 2", MIMA_SEEDS="3", MIMA_MERGES="uniform ties")
    assert seeded.returncode == 0, seeded.stderr
    assert (tmp_path / "mima-arguments").read_text().splitlines() == [
        "evaluate", str(runs / "tiny-N1-seed3"), str(runs / "tiny-N2-seed3"), *expected_tail]
    # without MIMA_SEEDS: every seed found for each N (N = 16 and another config's runs are not N = 1's)
    found = _evaluation_command(tmp_path, runs, MIMA_ITERATIONS="1 2", MIMA_MERGES="uniform ties")
    assert found.returncode == 0, found.stderr
    assert (tmp_path / "mima-arguments").read_text().splitlines() == [
        "evaluate", str(runs / "tiny-N1-seed3"), str(runs / "tiny-N1-seed5"), str(runs / "tiny-N2-seed3"), *expected_tail]
    # an N whose element never started is left out and named; the others are evaluated (afterany)
    partial = _evaluation_command(tmp_path, runs, MIMA_ITERATIONS="1 4", MIMA_MERGES="uniform ties")
    assert partial.returncode == 0 and "no run folder" in partial.stderr and "N=4; left out" in partial.stderr
    assert (tmp_path / "mima-arguments").read_text().splitlines() == [
        "evaluate", str(runs / "tiny-N1-seed3"), str(runs / "tiny-N1-seed5"), *expected_tail]
    missing = _evaluation_command(tmp_path, runs, MIMA_ITERATIONS="4 8")
    assert missing.returncode == 2 and "no run folder found" in missing.stderr


# ------------------------------------------------------------------- bash 4.2 (RHEL 7) safety
UNGUARDED_ARRAY = re.compile(r'(?<!\+)"\$\{(\w+)\[[@*]\]\}"')


def unguarded_array_expansions(text: str) -> list[str]:
    """`"${name[@]}"` outside the `${name[@]+"${name[@]}"}` guard: under `set -u`, bash before 4.4
    (RHEL/CentOS 7 ship 4.2) stops with "unbound variable" when the array is empty."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("#"):
            continue
        found += [f"line {number}: {match.group(0)}" for match in UNGUARDED_ARRAY.finditer(line)]
    return found


def test_the_scripts_expand_no_possibly_empty_array_unguarded():
    scripts = sorted((REPO / "slurm").glob("*.sh")) + sorted((REPO / "slurm").glob("*.sbatch"))
    assert len(scripts) >= 8
    problems = {script.name: unguarded_array_expansions(script.read_text()) for script in scripts}
    assert {name: lines for name, lines in problems.items() if lines} == {}
    # the check itself: an unguarded expansion is found, the guarded form and comments are not
    assert unguarded_array_expansions('srun "${opts[@]}" x\n# "${a[@]}"\nsrun ${b[@]+"${b[@]}"}') == ['line 1: "${opts[@]}"']
