"""The processes of one `mima evaluate`: who they are, how they learn of a stop, how they end.

`--devices N` starts N - 1 children of process 0 here (each told its rank in MIMA_EVALUATE_*), or
`srun` starts one process per task (mima.core.environment.slurm_step). Each process records its own
cells; a marker file per process says it is done or stopped, and process 0 waits for all of them.
SIGTERM or SIGUSR1 stops every process after its running batch; SIGUSR1 (SLURM's warning before the
time limit) also requeues the job (mima.core.environment.requeue_slurm_job), as `mima fit` does.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mima.core.environment import local_rank, requeue_slurm_job, slurm_step
from mima.core.errors import MimaError
from mima.evaluation.accuracy import EvaluationStopped
from mima.evaluation.cells import CellStore


def new_session() -> str:
    """A name no other evaluation shares: it names this evaluation's cell files and markers."""
    return f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"


@dataclass
class Team:
    """The processes of one evaluation: this one's rank, how many, the session that names their
    cell files, and (process 0 started by `mima evaluate --devices N`) the command for the others."""

    rank: int = 0
    world: int = 1
    session: str = ""
    local_rank: int = 0
    argv: list[str] | None = None  # process 0 starts ranks 1..world-1 with it
    children: list[subprocess.Popen] = field(default_factory=list)

    RANK_ENV, WORLD_ENV, SESSION_ENV = "MIMA_EVALUATE_RANK", "MIMA_EVALUATE_WORLD", "MIMA_EVALUATE_SESSION"

    def start_children(self) -> None:
        for rank in range(1, self.world if self.argv is not None else 1):
            environment = {**os.environ, self.RANK_ENV: str(rank), self.WORLD_ENV: str(self.world),
                           self.SESSION_ENV: self.session}
            self.children.append(subprocess.Popen([sys.executable, "-m", "mima", "evaluate", *self.argv], env=environment))

    def signal_children(self, signum: int) -> None:
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signum)


def team_for(devices: int | None, argv: Sequence[str] | None = None) -> Team:
    """This process's place: a child started by process 0, a task of an `srun` step, or process 0
    of `devices` processes (None: 1; at least 1, as EvaluateOptions checks). Too many devices is one
    line, before any work."""
    environment = os.environ
    if Team.RANK_ENV in environment:
        world = int(environment[Team.WORLD_ENV])
        rank = int(environment[Team.RANK_ENV])
        return Team(rank, world, environment[Team.SESSION_ENV], local_rank=rank)
    step = slurm_step(environment)
    if step is not None and step.tasks > 1:
        if devices not in (None, step.tasks):
            raise MimaError(f"--devices {devices}: this srun step has {step.tasks} tasks (one process each); omit --devices")
        session = f"slurm{step.job_id}.{step.step_id}.r{step.restarts}"
        return Team(step.task, step.tasks, session, local_rank=local_rank(environment))
    world = 1 if devices is None else devices
    available = torch.cuda.device_count() if torch.cuda.is_available() else (os.cpu_count() or 1)
    if world > available:
        kind = "GPUs" if torch.cuda.is_available() else "CPU cores"
        raise MimaError(f"--devices {world}: this machine has {available} {kind}")
    # the processes started here take GPUs 0..world-1; one process alone takes its launcher's choice
    return Team(0, world, new_session(), local_rank=local_rank(environment) if world == 1 else 0,
                argv=list(argv) if argv is not None and world > 1 else None)


class StopRequests:
    """SIGTERM/SIGUSR1 while evaluating: finish the running batch, keep every finished cell, stop."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, team: Team) -> None:
        self.team = team
        self.signal: int | None = None
        self.previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        for signum in self.SIGNALS:
            self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame) -> None:
        self.signal = signum
        self.team.signal_children(signum)

    def requested(self) -> bool:
        return self.signal is not None


def wait_for_session(store: CellStore, session: str, timeout_s: float = 600.0) -> None:
    """A process other than 0 starts once process 0 has prepared the folder for this session."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        manifest = store.read_manifest()
        if manifest and manifest.get("session") == session:
            return
        time.sleep(0.5)
    raise MimaError(f"{store.manifest_file}: process 0 did not prepare the evaluation folder within {timeout_s:.0f} s")


def marker(store: CellStore, team: Team, rank: int, state: str) -> Path:
    """The file saying that process `rank` of this session is done or stopped."""
    return store.cells_dir / f"{team.session}-p{rank}.{state}"


def finish_rank(store: CellStore, team: Team, stop: StopRequests) -> None:
    """Say this process is done; process 0 waits until every process is (or one stopped)."""
    marker(store, team, team.rank, "done").touch()
    if team.rank != 0:
        return
    while True:
        states = []
        for rank in range(1, team.world):
            states.append("done" if marker(store, team, rank, "done").exists()
                          else "stopped" if marker(store, team, rank, "stopped").exists() else None)
        if all(state == "done" for state in states):
            break
        if "stopped" in states or stop.requested():
            raise EvaluationStopped()
        failed = [child for child in team.children if child.poll() not in (None, 0)]
        if failed:
            raise MimaError(f"mima evaluate: process {team.children.index(failed[0]) + 1} failed (exit code "
                            f"{failed[0].returncode}); its finished cells are kept, run the same command again")
        time.sleep(0.2)
    for child in team.children:
        child.wait()


def stopped(store: CellStore, team: Team, signum: int | None, title: str) -> None:
    """End this process after a stop: its marker, its children stopped and waited for; process 0
    says how many cells are kept and, after SIGUSR1, requeues the SLURM job."""
    marker(store, team, team.rank, "stopped").touch()
    for child in team.children:
        if child.poll() is None:
            child.send_signal(signum or signal.SIGTERM)
        child.wait()
    if team.rank == 0:
        kept = store.load()
        print(f"{title}: stopped by signal {signum}; {kept} finished cells kept in {store.cells_dir}; "
              "run the same command to go on", flush=True)  # before a requeue ends the job step
        if signum == signal.SIGUSR1:
            requeue_slurm_job("mima evaluate")  # nothing outside SLURM
    raise SystemExit(128 + (signum or signal.SIGTERM))
