"""What a process learns from its launcher's environment: its ranks and the SLURM job it runs in.

The one place that reads those variables, for `mima fit` and `mima evaluate` alike. Launchers name
things differently: torchrun and Lightning set RANK, LOCAL_RANK and WORLD_SIZE; `srun` sets
SLURM_PROCID, SLURM_LOCALID and SLURM_NTASKS (SLURM_STEP_NUM_TASKS inside a job step). A process a
user started by hand has none of them and is rank 0 of 1.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from mima.core.errors import MimaError

# the first one set wins
GLOBAL_RANK_VARIABLES = ("RANK", "SLURM_PROCID")
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID")


def _whole_number(environment: Mapping[str, str], variable: str, meaning: str) -> int | None:
    value = environment.get(variable, "")
    if not value.strip():
        return None
    try:
        return int(value)
    except ValueError:
        raise MimaError(f"{variable}={value!r}: expected {meaning}, a whole number") from None


def in_slurm_job(environment: Mapping[str, str] | None = None) -> bool:
    """A process SLURM started as a task of a job (not an interactive shell that merely sits in an
    allocation: there SLURM_JOB_NAME is "bash" or "interactive", as Lightning's SLURMEnvironment reads it)."""
    environment = os.environ if environment is None else environment
    return "SLURM_NTASKS" in environment and environment.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def global_rank(environment: Mapping[str, str] | None = None) -> int:
    """This process's rank among all processes of the run, as its launcher set it (0 by hand).
    SLURM_PROCID counts only inside a SLURM job (see `in_slurm_job`). Without either (Lightning's own
    launcher gives its processes NODE_RANK and LOCAL_RANK only) it is NODE_RANK + LOCAL_RANK: 0 for
    the first process and no other, which is what callers ask; beyond the first node it is the rank
    only with one process per node."""
    environment = os.environ if environment is None else environment
    for variable in GLOBAL_RANK_VARIABLES:
        if variable == "SLURM_PROCID" and not in_slurm_job(environment):
            continue
        rank = _whole_number(environment, variable, "the process's rank")
        if rank is not None:
            return rank
    return (_whole_number(environment, "NODE_RANK", "the node's rank") or 0) + local_rank(environment)


def local_rank(environment: Mapping[str, str] | None = None) -> int:
    """This process's index among the processes of its node, as its launcher set it; 0 for a process
    a user started."""
    environment = os.environ if environment is None else environment
    for variable in LOCAL_RANK_VARIABLES:
        rank = _whole_number(environment, variable, "the process's local rank")
        if rank is not None:
            return rank
    return 0


def slurm_job_id(environment: Mapping[str, str] | None = None) -> str | None:
    """The job `scontrol` knows this process by (an array task as JOB_TASK); None outside SLURM."""
    environment = os.environ if environment is None else environment
    if not in_slurm_job(environment):
        return None
    array_job = environment.get("SLURM_ARRAY_JOB_ID")
    return f"{array_job}_{environment['SLURM_ARRAY_TASK_ID']}" if array_job else environment.get("SLURM_JOB_ID")


@dataclass(frozen=True)
class SlurmStep:
    """The `srun` job step this process is a task of."""

    job_id: str  # SLURM_JOB_ID ("" where unset)
    step_id: str  # SLURM_STEP_ID
    task: int  # SLURM_PROCID: this process's task, 0 .. tasks - 1
    tasks: int  # SLURM_STEP_NUM_TASKS: the step's tasks (SLURM_NTASKS counts the job's)
    restarts: int  # SLURM_RESTART_COUNT: how often the job was requeued (0 on its first start)


def slurm_step(environment: Mapping[str, str] | None = None) -> SlurmStep | None:
    """The `srun` step this process runs in, or None: not under SLURM, or the batch script itself
    (it has SLURM_NTASKS but no step size). An interactive allocation (SLURM_JOB_NAME=bash) counts
    too: srun started this task there, whatever shell holds the allocation."""
    environment = os.environ if environment is None else environment
    if not all(environment.get(variable, "").strip() for variable in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_ID", "SLURM_PROCID")):
        return None
    return SlurmStep(
        job_id=environment.get("SLURM_JOB_ID", ""),
        step_id=environment["SLURM_STEP_ID"],
        task=_whole_number(environment, "SLURM_PROCID", "the task's rank"),
        tasks=_whole_number(environment, "SLURM_STEP_NUM_TASKS", "the step's number of tasks"),
        restarts=_whole_number(environment, "SLURM_RESTART_COUNT", "the job's restart count") or 0,
    )


def requeue_slurm_job(command: str) -> None:
    """Put this SLURM job back in the queue (`scontrol requeue`): it restarts under the same job id and
    resumes. Nothing outside SLURM. `command` names the caller in the lines printed ("mima fit")."""
    job = slurm_job_id()
    if job is None:
        return
    # said before, not after: a successful requeue ends this job step at once (SLURM signals and then
    # kills its processes), so a line printed once scontrol returns may never be written
    print(f"{command}: requeueing SLURM job {job} (scontrol requeue)", flush=True)
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if result.returncode:
        print(f"{command}: scontrol requeue {job} failed: {result.stderr.strip()}", flush=True)
