"""The interpreter a test job's first process names as `sys.executable` (tests/job_server.py).

Lightning starts a job's other ranks as `sys.executable -m mima.__main__ ARGS` (and `mima evaluate`'s
team its helpers as `sys.executable -m mima evaluate ARGS`); a new interpreter spends about 5 CPU-s
importing torch, Lightning and open_clip before the rank does anything. Started in that place, this
script asks the job's zygote (a fork of the job's first process made before it ran anything, with
those modules imported) to fork the rank instead, hands it its stdin, stdout and stderr, and then
stands for it: Lightning sees this process's exit status, which is the rank's (a rank killed by a
signal kills this process with the same signal), and a signal that the job's first process sends
to this process alone (Lightning forwards SIGTERM and SIGUSR1 to its children) reaches the rank.
Signals sent to the whole process group reach the rank directly, as it is in the job's group.
When this process dies (SIGKILL from Lightning's process observer, or the test killing it), the rank
kills itself (tests/job_server.py's watcher thread), as the process Lightning started would have died.

Anything else (`-c`, another module, no zygote named in the environment) runs the real interpreter
with the same arguments. Runs with `python -I -S`: standard library only, a start of a few ms.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys

ZYGOTE_VARIABLE = "MIMA_TEST_ZYGOTE"  # the zygote's abstract socket name (set by tests/job_server.py)
PYTHON_VARIABLE = "MIMA_TEST_PYTHON"  # the real interpreter
MODULES = ("mima", "mima.__main__")
# what a parent may send to its child alone; forwarded to the rank when the parent sent it
FORWARDED = {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT}


def main(args: list[str]) -> None:
    address = os.environ.get(ZYGOTE_VARIABLE)
    if not (address and len(args) >= 2 and args[0] == "-m" and args[1] in MODULES):
        python = os.environ.get(PYTHON_VARIABLE) or sys.executable  # the shebang's interpreter, the same
        os.execv(python, [python, *args])
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect("\0" + address)
    # `-m mima` and `-m mima.__main__` both run mima/__main__.py: the arguments after the module suffice
    request = {"argv": args[2:], "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2])
    parent, rank_pid, pending = os.getppid(), None, []
    while True:
        readable, _, _ = select.select([connection], [], [], 0.05)
        while (info := signal.sigtimedwait(FORWARDED, 0)) is not None:
            if info.si_pid == parent:  # sent to this process alone: the rank would have received it
                pending.append(info.si_signo)
        if readable:
            message = connection.recv(256).decode()
            if not message:  # the zygote went with the job's first process: nobody waits for this status
                sys.exit(1)
            word, value = message.split()
            if word == "pid":
                rank_pid = int(value)
            else:
                stand_for(int(value))
        if rank_pid is not None:
            for signum in pending:
                os.kill(rank_pid, signum)
            pending.clear()


def stand_for(code: int) -> None:
    """Exit as the rank did: with its code, or killed by its signal."""
    if code >= 0:
        os._exit(code)
    if -code not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose disposition cannot change
        signal.signal(-code, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {-code})
    os.kill(os.getpid(), -code)
    os._exit(128 - code)  # not reached for a signal that kills


if __name__ == "__main__":
    main(sys.argv[1:])
