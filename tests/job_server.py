"""A process that imports torch, Lightning, open_clip and mima's trainer once, then forks one child per
`mima` command the tests start as a process of its own (tests/helpers.py::run_command).

Why: a job's first process spends about 5 of its 7 CPU-seconds importing; a multi-process test job
paid that for every rank. A fork of this process starts with those modules loaded and runs the same
`mima.cli.main(argv)` that `python -m mima` runs, as a process of its own: its own session and
process group (a test may SIGKILL the whole job), its own environment, working folder and signal
dispositions, stdout and stderr on pipes the test reads to EOF like `subprocess.run` does.

Lightning starts the other ranks as `sys.executable -m mima.__main__ ...`, as it does for a user's job.
Before running anything, the job forks a zygote (in its process group, with no stdout or stderr of
its own, blocking the signals a scheduler sends the whole group, ended with the job by
PR_SET_PDEATHSIG) and names tests/rank_starter.py as `sys.executable`: each starter asks the zygote
for a fork that becomes the rank (its stdin, stdout, stderr, environment, working folder and
arguments), and stands for it towards Lightning. A two-process job paid about 5 CPU-s of imports for
its second rank; now a fork.

This process never trains or computes, so no OpenMP pool exists when it forks. Its only other threads
are the idle OpenBLAS pools that numpy and scipy start on import; OpenBLAS shuts them down before a
fork (pthread_atfork), as for a DataLoader worker. A child starts as clean as a new interpreter, less
the imports. A job whose environment differs from the one
this process imported with does not come here (a library may read a variable at import time).

Protocol, over a Unix socket: the test sends one JSON request {"argv", "env", "cwd", "file_size_limit"}
(RLIMIT_FSIZE in bytes, or null) with three file
descriptors (the write ends of the job's stdout, stderr and status pipes); the status pipe receives
"pid N" when the job starts and "code C" (subprocess's returncode: -9 for SIGKILL) when it ends.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import resource
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path

from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only

import mima.cli  # noqa: F401  (what `python -m mima` imports first)
import mima.commands.fit.run  # noqa: F401  (torch, Lightning, open_clip, torchmetrics: the 5 s)
import tests.helpers  # noqa: F401  (the fault-injection callbacks the test configs name)

# tests.helpers serves jobs whose MLFLOW_* switches differ from the session's: right only while mlflow,
# which would read them, is not imported here
if "mlflow" in sys.modules:
    raise RuntimeError("tests/job_server.py imported mlflow: tests.helpers.TRACKER_SWITCHES must no longer hold its variables")

MAX_FDS = 3
# Signals a test or a scheduler may send to a job's whole process group. The zygote blocks them (they
# are the ranks' business); a rank it forks inherits the mask and the job's dispositions, and unblocks
# them once it is set up, so one sent meanwhile is delivered then, not lost.
GROUP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT}
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent ends
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")  # where Lightning looks, in order
ZYGOTE_VARIABLE, PYTHON_VARIABLE = "MIMA_TEST_ZYGOTE", "MIMA_TEST_PYTHON"  # as tests/rank_starter.py reads them


def write_starter(folder: Path) -> str:
    """tests/rank_starter.py as an executable whose interpreter is this one, without site-packages
    (python -I -S starts in a few ms)."""
    path = folder / "python"
    path.write_text(f"#!{sys.executable} -IS\n" + (Path(__file__).parent / "rank_starter.py").read_text())
    path.chmod(0o755)
    return str(path)


def serve(connection: socket.socket) -> dict | None:
    """Until the test process closes the socket: fork a child per request and report its end. Returns
    the request in the child (which then runs the job at the top level); None in this process at the end."""
    status_of: dict[int, int] = {}  # job pid -> write end of its status pipe
    while True:
        readable, _, _ = select.select([connection], [], [], 0.05)
        if readable:
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, MAX_FDS)
            if not message:
                return None
            request = json.loads(message)
            stdout, stderr, status = fds
            pid = os.fork()
            if pid == 0:
                _become_the_job(connection, request, stdout, stderr, [status, *status_of.values()])
                return request
            os.close(stdout)
            os.close(stderr)
            os.write(status, f"pid {pid}\n".encode())
            status_of[pid] = status
        while status_of:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            os.write(status_of[pid], f"code {os.waitstatus_to_exitcode(wait_status)}\n".encode())
            os.close(status_of.pop(pid))


def _become_the_job(connection: socket.socket, request: dict, stdout: int, stderr: int,
                    status_pipes: list[int]) -> None:
    connection.close()
    for status in status_pipes:  # only this server writes a job's status
        os.close(status)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    for fd in (devnull, stdout, stderr):
        os.close(fd)
    if request.get("file_size_limit") is not None:  # a write beyond it fails as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (request["file_size_limit"],) * 2)
        # Python writes the bytecode of a module imported first here in one write() call, which the limit
        # cuts short without an error: the truncated .pyc would break every later import of that module
        sys.dont_write_bytecode = True
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request.get("file_size_limit") is not None:
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # and in the processes it starts
    sys.argv = [str(importlib.util.find_spec("mima.__main__").origin), *request["argv"]]
    # Lightning's launcher starts the other ranks as `python -m <__main__.__spec__.name> <sys.argv[1:]>`
    sys.modules["__main__"].__spec__ = importlib.util.find_spec("mima.__main__")


def start_zygote(starter: str) -> dict | None:
    """In the job's first process, before it runs anything: fork the zygote that starts the job's other
    ranks (tests/rank_starter.py), and name the starter as this process's interpreter. Returns None
    here; in a rank the zygote forked, that rank's request."""
    address = f"mima-test-zygote-{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind("\0" + address)
    listener.listen(16)
    job_pid = os.getpid()
    if os.fork() == 0:
        return _serve_ranks(listener, job_pid)
    listener.close()
    os.environ[ZYGOTE_VARIABLE] = address
    os.environ[PYTHON_VARIABLE] = sys.executable
    sys.executable = starter
    return None


def _serve_ranks(listener: socket.socket, job_pid: int) -> dict:
    """The zygote: until the job's first process ends (it dies with it), fork one rank per starter that
    connects, and send the starter the rank's pid, then its exit status."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
    if os.getppid() != job_pid:  # the job ended before the line above
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # the test reads the job's stdout and stderr to EOF: only the ranks hold them
        os.dup2(devnull, fd)
    os.close(devnull)
    starters: dict[int, socket.socket] = {}  # rank pid -> its starter's connection
    while True:
        readable, _, _ = select.select([listener], [], [], 0.05)
        if readable:
            connection, _ = listener.accept()
            request, fds = _read_request(connection)
            if request is None:  # a starter killed before it sent its request
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in starters.values():
                    other.close()
                _become_the_rank(connection, request, fds)
                return request
            for fd in fds:
                os.close(fd)
            _tell(connection, f"pid {pid}")
            starters[pid] = connection
        while starters:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = starters.pop(pid)
            _tell(connection, f"code {os.waitstatus_to_exitcode(wait_status)}")
            connection.close()


def _read_request(connection: socket.socket) -> tuple[dict | None, list[int]]:
    fds: list[int] = []
    try:
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, MAX_FDS)
        request = json.loads(message)
        if len(fds) == MAX_FDS:
            return request, fds
    except (OSError, ValueError):
        pass
    for fd in fds:
        os.close(fd)
    connection.close()
    return None, []


def _tell(connection: socket.socket, message: str) -> None:
    try:
        connection.send(message.encode())
    except OSError:  # the starter is gone (killed): the rank has killed itself or is about to
        pass


def _become_the_rank(connection: socket.socket, request: dict, fds: list[int]) -> None:
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [str(importlib.util.find_spec("mima.__main__").origin), *request["argv"]]
    sys.modules["__main__"].__spec__ = importlib.util.find_spec("mima.__main__")
    # A new interpreter's Lightning reads its rank from the launcher's variables on import; this one
    # imported them in the server, where they were unset.
    rank = next((int(os.environ[key]) for key in RANK_VARIABLES if key in os.environ), 0)
    fabric_rank_zero_only.rank = utilities_rank_zero_only.rank = rank
    threading.Thread(target=_die_with_the_starter, args=(connection,), daemon=True).start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)


def _die_with_the_starter(connection: socket.socket) -> None:
    """The starter is this rank to Lightning: when it dies (its SIGKILL), so does the rank."""
    try:
        while connection.recv(64):
            pass
    except OSError:  # reset: the starter died before it read the zygote's message
        pass
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    starter_folder = Path(tempfile.mkdtemp(prefix="mima-rank-starter-"))
    starter = write_starter(starter_folder)
    job = serve(socket.socket(fileno=int(sys.argv[1])))
    if job is None:  # the server's end (not atexit: every job forked from it would run it too)
        shutil.rmtree(starter_folder, ignore_errors=True)
        sys.exit(0)
    rank = start_zygote(starter)
    # in the child: exits as `python -m mima` would
    sys.exit(mima.cli.main((rank or job)["argv"]))
