"""mima.core.environment on the environments launchers really give a process: an `srun` step of a
batch job, the batch script itself, an interactive allocation (SLURM_JOB_NAME=bash), a task of an
array job, torchrun, Lightning's own launcher, and a process started by hand; a garbled value is one
line naming the variable, and `scontrol requeue` is called with the job's id only inside a SLURM job."""

from __future__ import annotations

import subprocess

import pytest

from mima.core import environment as env
from mima.core.environment import (SlurmStep, global_rank, in_slurm_job, local_rank, requeue_slurm_job, slurm_job_id,
                                   slurm_step)
from mima.core.errors import MimaError

# `sbatch --ntasks=8 --ntasks-per-node=4` running `srun mima evaluate ...`: task 5, the second of node 1
SRUN_TASK = {
    "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "evaluate_sweep.sbatch", "SLURM_NTASKS": "8", "SLURM_NNODES": "2",
    "SLURM_NODEID": "1", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2",
}
# the batch script of that job (before srun): one process, no step size
BATCH_SCRIPT = {
    "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "evaluate_sweep.sbatch", "SLURM_NTASKS": "8", "SLURM_NNODES": "2",
    "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
}
# `salloc --ntasks=4` gives a shell: a process the user starts there is not a task SLURM started
INTERACTIVE = {
    "SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "bash", "SLURM_NTASKS": "4", "SLURM_NNODES": "1",
    "SLURM_NODEID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
}
# element 7 of `sbatch --array=0-9`: SLURM_JOB_ID is the element's own id, scontrol knows it as 100_7
ARRAY_TASK = {
    "SLURM_JOB_ID": "108", "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "7", "SLURM_JOB_NAME": "fit.sbatch",
    "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
}
# torchrun --nnodes 2 --nproc-per-node 4, process 6 (node 1, local 2)
TORCHRUN = {"RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}


def test_an_srun_task_knows_its_ranks_its_job_and_its_step():
    assert in_slurm_job(SRUN_TASK)
    assert (global_rank(SRUN_TASK), local_rank(SRUN_TASK), slurm_job_id(SRUN_TASK)) == (5, 1, "4242")
    assert slurm_step(SRUN_TASK) == SlurmStep(job_id="4242", step_id="0", task=5, tasks=8, restarts=0)
    # the same task after its job was requeued twice
    assert slurm_step({**SRUN_TASK, "SLURM_RESTART_COUNT": "2"}).restarts == 2


def test_the_batch_script_is_in_the_job_but_in_no_step():
    assert in_slurm_job(BATCH_SCRIPT)
    assert (global_rank(BATCH_SCRIPT), local_rank(BATCH_SCRIPT), slurm_job_id(BATCH_SCRIPT)) == (0, 0, "4242")
    assert slurm_step(BATCH_SCRIPT) is None


@pytest.mark.parametrize("name", ["bash", "interactive"])
def test_an_interactive_allocation_is_no_slurm_job(name):
    shell = {**INTERACTIVE, "SLURM_JOB_NAME": name, "SLURM_PROCID": "3"}
    assert not in_slurm_job(shell)
    assert slurm_job_id(shell) is None  # nothing to requeue
    assert global_rank(shell) == 0  # SLURM_PROCID is not this process's rank there
    assert global_rank({**shell, "LOCAL_RANK": "2"}) == 2  # a launcher the user started inside it
    # but `srun` run in that shell starts real tasks of a step
    srun_inside = {**shell, "SLURM_STEP_ID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}
    assert slurm_step(srun_inside) == SlurmStep(job_id="77", step_id="1", task=1, tasks=2, restarts=0)


def test_an_array_task_is_requeued_as_job_underscore_task():
    assert slurm_job_id(ARRAY_TASK) == "100_7"
    assert slurm_job_id({key: value for key, value in ARRAY_TASK.items() if not key.startswith("SLURM_ARRAY")}) == "108"


def test_torchrun_and_lightning_ranks():
    assert (global_rank(TORCHRUN), local_rank(TORCHRUN)) == (6, 2)
    # torchrun inside a SLURM job: its own RANK and LOCAL_RANK win over the job's task ids
    inside = {**BATCH_SCRIPT, **TORCHRUN}
    assert (global_rank(inside), local_rank(inside)) == (6, 2)
    # Lightning's launcher gives its processes NODE_RANK and LOCAL_RANK only (here one process per node)
    assert global_rank({"NODE_RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}) == 0
    assert global_rank({"NODE_RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}) == 1


def test_a_process_started_by_hand_is_rank_0_of_no_job():
    assert (global_rank({}), local_rank({}), in_slurm_job({}), slurm_job_id({}), slurm_step({})) == (0, 0, False, None, None)
    assert local_rank({"LOCAL_RANK": " "}) == 0  # set but blank: unset


@pytest.mark.parametrize("environment, line", [
    ({**TORCHRUN, "RANK": "six"}, "RANK='six': expected the process's rank, a whole number"),
    ({**SRUN_TASK, "SLURM_PROCID": "5a"}, "SLURM_PROCID='5a': expected the process's rank, a whole number"),
    ({"LOCAL_RANK": "one"}, "LOCAL_RANK='one': expected the process's local rank, a whole number"),
    ({"SLURM_LOCALID": "1.0"}, "SLURM_LOCALID='1.0': expected the process's local rank, a whole number"),
    ({"NODE_RANK": "n1"}, "NODE_RANK='n1': expected the node's rank, a whole number"),
])
def test_a_garbled_rank_is_one_line_naming_the_variable(environment, line):
    with pytest.raises(MimaError) as raised:
        global_rank(environment)
    assert str(raised.value) == line


@pytest.mark.parametrize("variable, value, line", [
    ("SLURM_PROCID", "x", "SLURM_PROCID='x': expected the task's rank, a whole number"),
    ("SLURM_STEP_NUM_TASKS", "8(x2)", "SLURM_STEP_NUM_TASKS='8(x2)': expected the step's number of tasks, a whole number"),
    ("SLURM_RESTART_COUNT", "once", "SLURM_RESTART_COUNT='once': expected the job's restart count, a whole number"),
])
def test_a_garbled_step_is_one_line_naming_the_variable(variable, value, line):
    with pytest.raises(MimaError) as raised:
        slurm_step({**SRUN_TASK, variable: value})
    assert str(raised.value) == line


@pytest.fixture
def scontrol(monkeypatch) -> list[list[str]]:
    """The commands requeue_slurm_job runs, recorded instead of run."""
    calls: list[list[str]] = []

    def run(command, **kwargs):
        calls.append(list(command))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(env.subprocess, "run", run)
    for variable in {*SRUN_TASK, *ARRAY_TASK, *INTERACTIVE}:
        monkeypatch.delenv(variable, raising=False)
    return calls


def test_requeue_names_the_array_task_and_says_so_first(scontrol, monkeypatch, capsys):
    for variable, value in ARRAY_TASK.items():
        monkeypatch.setenv(variable, value)
    requeue_slurm_job("mima evaluate")
    assert scontrol == [["scontrol", "requeue", "100_7"]]
    assert capsys.readouterr().out == "mima evaluate: requeueing SLURM job 100_7 (scontrol requeue)\n"


@pytest.mark.parametrize("environment", [{}, INTERACTIVE], ids=["by hand", "interactive allocation"])
def test_requeue_outside_a_slurm_job_does_nothing(scontrol, monkeypatch, capsys, environment):
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value)
    requeue_slurm_job("mima fit")
    assert scontrol == [] and capsys.readouterr().out == ""
