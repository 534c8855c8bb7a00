"""A process that imports torch, Lightning, open_clip and mima's trainer once, then forks one child per
`mima` command the tests start as a process of its own (tests/helpers.py::run_command).

Why: a job's first process spends about 5 of its 7 CPU-seconds importing; a multi-process test job
paid that for every rank. A fork of this process starts with those modules loaded and runs the same
`mima.cli.main(argv)` that `python -m mima` runs, as a process of its own: its own session and
process group (a test may SIGKILL the whole job), its own environment, working folder and signal
dispositions, stdout and stderr on pipes the test reads to EOF like `subprocess.run` does. Lightning
starts the other ranks as `python -m mima.__main__ ...`, as it does for a user's job.

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

import importlib.util
import json
import os
import resource
import select
import socket
import sys

import mima.cli  # noqa: F401  (what `python -m mima` imports first)
import mima.commands.fit.run  # noqa: F401  (torch, Lightning, open_clip, torchmetrics: the 5 s)
import tests.helpers  # noqa: F401  (the fault-injection callbacks the test configs name)

MAX_FDS = 3


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


if __name__ == "__main__":
    job = serve(socket.socket(fileno=int(sys.argv[1])))
    if job is None:
        sys.exit(0)
    sys.exit(mima.cli.main(job["argv"]))  # in the child: exits as `python -m mima` would
