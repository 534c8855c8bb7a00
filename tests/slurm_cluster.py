"""A real single-node SLURM for the tests: munged, slurmctld and slurmd from Debian's slurm-wlm,
configured in a temporary folder and stopped by PID afterwards (tests/setup_assets.sh
installs the packages)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "munged", "munge")


def missing_requirement() -> str | None:
    """Why a SLURM cluster cannot be started here, or None (the tests skip with it, or fail under CI)."""
    absent = [name for name in BINARIES if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists()]
    if absent:
        return (f"SLURM is not installed ({', '.join(absent)} missing); "
                "`bash tests/setup_assets.sh` installs slurm-wlm and munge, as root")
    if os.geteuid() != 0:
        return f"starting slurmctld, slurmd and munged for the test cluster needs root (running as uid {os.geteuid()})"
    return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@dataclass
class SlurmCluster:
    folder: Path
    env: dict[str, str] = field(default_factory=dict)
    pid_files: list[Path] = field(default_factory=list)
    started_munged: bool = False
    spool: Path | None = None  # the slurmd spool folders, removed by stop()

    def run(self, *command: str, check: bool = True, extra_env: dict[str, str] | None = None,
            **kwargs) -> subprocess.CompletedProcess:
        """A command against this cluster (SLURM_CONF set), with `extra_env` added to its environment."""
        env = {**self.env, **(extra_env or {})}
        return subprocess.run(list(command), env=env, capture_output=True, text=True, check=check, **kwargs)

    def job_gone(self, job_id: str) -> bool:
        """Neither pending, running nor completing (its processes have ended)."""
        return not self.run("squeue", "-h", "-j", job_id, check=False).stdout.strip()

    def job_field(self, job_id: str, name: str) -> str | None:
        result = self.run("scontrol", "show", "job", job_id, check=False)
        for token in result.stdout.split():
            if token.startswith(f"{name}="):
                return token.split("=", 1)[1]
        return None

    def stop(self) -> None:
        pids = [int(pid_file.read_text().strip()) for pid_file in self.pid_files if pid_file.exists()]
        _terminate(pids)
        if self.spool is not None:
            shutil.rmtree(self.spool, ignore_errors=True)


def _terminate(pids: list[int], grace: float = 10.0) -> None:
    """SIGTERM to every daemon at once (each takes seconds to shut down), SIGKILL to any left after `grace`."""
    running = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            running.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while running and time.monotonic() < deadline:
        time.sleep(0.1)
        running = [pid for pid in running if _alive(pid)]
    for pid in running:
        os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _munge_works(env) -> bool:
    encoded = subprocess.run(["munge", "-n"], capture_output=True, env=env)
    if encoded.returncode:
        return False
    return subprocess.run(["unmunge"], input=encoded.stdout, capture_output=True, env=env).returncode == 0


def start_cluster(folder: Path, cpus: int | None = None, nodes: int = 1) -> SlurmCluster:
    """One node with `cpus` CPUs, or `nodes` nodes (one slurmd each, all on this machine) sharing them."""
    folder.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().split(".")[0]
    cpus = cpus or os.cpu_count() or 1
    if nodes == 1:
        node_lines = [f"NodeName={host} CPUs={cpus} State=UNKNOWN"]
        node_names = [host]
    else:
        node_names = [f"n{i + 1}" for i in range(nodes)]
        node_lines = [
            f"NodeName={name} NodeHostname={host} Port={free_port()} CPUs={max(1, cpus // nodes)} State=UNKNOWN"
            for name in node_names
        ]
    conf = folder / "slurm.conf"
    # slurmstepd makes Unix sockets in the spool folder (NODE_JOB.STEP, 108 bytes at most for the whole
    # path): under pytest's numbered, per-worker tmp_path a long test name went over by one byte, so the
    # spool goes to a short folder of its own
    spool = Path(tempfile.mkdtemp(prefix="mima-slurm-", dir="/tmp"))
    conf.write_text(
        "\n".join(
            [
                "ClusterName=mimatest",
                f"SlurmctldHost={host}",
                "SlurmUser=root",
                "AuthType=auth/munge",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "MpiDefault=none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "ReturnToService=2",
                "MinJobAge=600",
                # Lightning's default MASTER_PORT is 15000 + the job id's last four digits: a cluster that
                # numbered from 1 would give its first job port 15001 in every test session on the machine
                f"FirstJobId={random.randint(10_000, 999_999)}",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                f"StateSaveLocation={folder}/state",
                f"SlurmdSpoolDir={spool}/spool-%n",
                f"SlurmctldPidFile={folder}/slurmctld.pid",
                f"SlurmdPidFile={folder}/slurmd-%n.pid",
                f"SlurmctldLogFile={folder}/slurmctld.log",
                f"SlurmdLogFile={folder}/slurmd-%n.log",
                *node_lines,
                f"PartitionName=debug Nodes={','.join(node_names)} Default=YES State=UP MaxTime=INFINITE",
                "",
            ]
        )
    )
    (folder / "state").mkdir(exist_ok=True)
    for name in node_names:
        (spool / f"spool-{name}").mkdir(exist_ok=True)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    leaked = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
    for variable in [v for v in env if (v.startswith("SLURM_") and v != "SLURM_CONF") or v in leaked]:
        env.pop(variable)  # jobs must not inherit an outer job's or an earlier fit's launch settings
    cluster = SlurmCluster(folder, env, spool=spool)

    if not _munge_works(env):
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        subprocess.run(["chown", "munge:munge", "/run/munge"], check=False)
        if not Path("/etc/munge/munge.key").exists():
            subprocess.run(["mungekey", "--create"], check=True)
        subprocess.run([_sbin("runuser"), "-u", "munge", "--", _sbin("munged")], check=True)
        cluster.started_munged = True
        cluster.pid_files.append(Path("/run/munge/munged.pid"))
    subprocess.run([_sbin("slurmctld"), "-f", str(conf)], env=env, check=True)
    cluster.pid_files.insert(0, folder / "slurmctld.pid")
    for name in node_names:
        node_flag = [] if nodes == 1 else ["-N", name]
        subprocess.run([_sbin("slurmd"), "-f", str(conf), *node_flag], env=env, check=True)
        cluster.pid_files.insert(0, folder / f"slurmd-{name}.pid")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = cluster.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
        if len(states) == nodes and set(states) == {"idle"}:
            return cluster
        time.sleep(0.3)
    cluster.stop()
    raise RuntimeError(f"the SLURM nodes did not become idle; see the logs in {folder}")
