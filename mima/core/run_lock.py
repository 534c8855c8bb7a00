"""One job per folder: a lock file that works on shared (network) filesystems.

    with RunLock(run_dir, "mima fit"):        # or lock = RunLock(...).acquire(); ...; lock.release()
        ...                                    # this job alone writes the folder's files

The lock is the file FOLDER/LOCK, created with O_CREAT | O_EXCL (atomic on local filesystems and on
NFS v3 and later), holding JSON: host, pid, the process's start time, the SLURM job id (if any), the
command and when it started. While held, a background thread touches it every `heartbeat_s` seconds.

A second job finds the file and looks at its holder:

- alive (same host: the process exists and started when the lock says; another host: a heartbeat less
  than `stale_after_s` ago): refused with one line naming the holder (`MimaError`);
- dead (same host: no such process, a pid that is no process id (not a whole number in 1..pid_max:
  an edited or damaged file), or another process under a reused pid; the same SLURM job id as
  this job's, i.e. an earlier run of a requeued job; another host: no heartbeat for `stale_after_s`):
  the stale lock is taken over, with a note on stderr. Two jobs taking over at once serialise on a
  second exclusive file (LOCK.takeover), so only one of them wins.

Release removes the file only if it is still this job's. A job killed with SIGKILL leaves its lock
behind; the next job takes it over as above. `mima fit` takes the lock of its run folder (process 0
only: the other processes of a job are its own), `mima report` and `mima analyze` the lock of the
folder they write into.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import threading
import time
import uuid
from pathlib import Path

from mima.core.errors import MimaError

LOCK_NAME = "LOCK"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0  # ten missed heartbeats: a job on another host that stops touching its lock is dead


def _process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as stream:
            return stream.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_max() -> int:
    """The largest process id of this host (Linux: /proc/sys/kernel/pid_max; 2^22 is the kernel's limit)."""
    try:
        with open("/proc/sys/kernel/pid_max") as limit:
            return int(limit.read())
    except (OSError, ValueError):
        return 2**22


def _is_pid(value: object) -> bool:
    """A value that can name a running process: a whole number in 1..pid_max (0 and -1 would
    signal a process group or every process; 2^70 overflows os.kill)."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= _pid_max()


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def slurm_job_id() -> str | None:
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array:
        return f"{array}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    return os.environ.get("SLURM_JOB_ID")


LOCK_READ_BYTES = 64 * 1024  # more is not a lock record (read as an unknown holder)

class RunLock:
    """The lock of `folder` for `command` (see the module text). Reusable: acquire, release, acquire."""

    def __init__(self, folder: str | os.PathLike, command: str, heartbeat_s: float = HEARTBEAT_S,
                 stale_after_s: float = STALE_AFTER_S) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.command, self.heartbeat_s, self.stale_after_s = command, heartbeat_s, stale_after_s
        self.held = False
        self.created_folder = False
        self._token = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------ public
    def acquire(self) -> RunLock:
        """Take the lock (creating the folder if needed) or raise a one-line MimaError naming the holder."""
        if self.held:
            return self
        self.created_folder = not self.folder.exists()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise MimaError(f"{self.folder}: cannot be written ({exc.strerror or exc})") from None
        try:
            for _ in range(5):  # a lock released or taken over between our looks: look again
                if self._create():
                    break
                self._refuse_special_file()
                holder = self.holder()
                if holder is None:
                    continue
                why = self._stale(holder)
                if why is None:
                    raise MimaError(self._refusal(holder))
                if self._take_over(holder):
                    sys.stderr.write(f"mima: took over the lock {self.path} of {describe(holder)} ({why})\n")
                    break
            else:
                raise MimaError(f"{self.path}: could not be taken (other jobs keep taking it); try again")
        except BaseException:
            self._remove_created_folder()
            raise
        self.held = True
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="mima-run-lock", daemon=True)
        self._thread.start()
        return self

    def release(self) -> None:
        """Give the lock back (only if the file is still this job's); remove the folder if acquiring
        created it and nothing else was written into it."""
        if not self.held:
            return
        self.held = False
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        holder = self.holder()
        if holder is not None and holder.get("token") == self._token:
            self.path.unlink(missing_ok=True)
        self._remove_created_folder()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def holder(self) -> dict | None:
        """What the lock file says (None: no lock file; a file being written or damaged reads as an
        unknown holder with the file's age)."""
        try:
            with self.path.open("rb") as stream:  # a lock record is a few hundred bytes: read no more than that
                text = stream.read(LOCK_READ_BYTES).decode("utf-8", "replace")
            written = self.path.stat()
        except FileNotFoundError:
            return None
        except OSError:
            return {"unreadable": True, "age_s": 0.0}
        try:
            holder = json.loads(text)
            if not isinstance(holder, dict):
                raise ValueError
        except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the parser goes
            holder = {"unreadable": True}
        holder["age_s"] = max(0.0, time.time() - written.st_mtime)
        return holder

    # ------------------------------------------------------------------------------ inside
    def _record(self) -> dict:
        pid = os.getpid()
        return {"host": socket.gethostname(), "pid": pid, "process_start": _process_start(pid),
                "slurm_job_id": slurm_job_id(), "command": self.command,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "token": self._token}

    def _create(self) -> bool:
        self._token = uuid.uuid4().hex
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as exc:
            raise MimaError(f"{self.path}: cannot be created ({exc.strerror or exc})") from None
        with os.fdopen(fd, "w") as stream:
            stream.write(json.dumps(self._record()) + "\n")
            stream.flush()
            os.fsync(stream.fileno())
        return True

    def _refuse_special_file(self) -> None:
        """A LOCK that is no file mima writes (a symlink, dangling or not, a folder, a FIFO) is no job's
        lock: no waiting or taking over helps, so say what it is."""
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISREG(mode):
            return
        kind = ("a symbolic link to " + os.readlink(self.path)) if stat.S_ISLNK(mode) else \
            "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise MimaError(f"{self.path}: is {kind}, not a lock file of mima's (no mima job makes one); remove it "
                        "and run the command again")

    def _stale(self, holder: dict) -> str | None:
        """Why the holder is gone (None: it may be alive)."""
        if holder.get("unreadable"):
            # being written this very moment, or damaged: give it the heartbeat's grace
            return f"an unreadable lock file, untouched for {holder['age_s']:.0f} s" if holder["age_s"] > self.stale_after_s else None
        mine = slurm_job_id()
        if mine is not None and holder.get("slurm_job_id") == mine and holder.get("host") != socket.gethostname():
            return f"an earlier run of this SLURM job {mine}"
        if holder.get("host") == socket.gethostname():
            pid = holder.get("pid")
            if not _is_pid(pid):  # edited or damaged: no process of this host can hold it
                return f"its pid {_short(pid)} is not a process id"
            if not _alive(pid):
                return "its process is no longer running"
            if holder.get("process_start") is not None and _process_start(pid) not in (None, holder["process_start"]):
                return "its process is no longer running (the pid is another process's now)"
            return None
        if holder["age_s"] > self.stale_after_s:
            return f"no heartbeat for {holder['age_s']:.0f} s"
        return None

    def _take_over(self, holder: dict) -> bool:
        """Replace the stale lock `holder` by ours; False if someone else changed it meanwhile."""
        guard = self.path.with_name(LOCK_NAME + ".takeover")
        try:
            fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:  # a takeover that died half-way leaves the guard: it is stale after a while
                if time.time() - guard.stat().st_mtime > 60:
                    guard.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
            time.sleep(0.05)
            return False
        os.close(fd)
        try:
            now = self.holder()
            if now is None or now.get("token") != holder.get("token") or now.get("pid") != holder.get("pid"):
                return False  # released or taken over by another job meanwhile: look again
            self.path.unlink(missing_ok=True)
            return self._create()
        finally:
            guard.unlink(missing_ok=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            holder = self.holder()
            if holder is None or holder.get("token") != self._token:
                sys.stderr.write(f"mima: the lock {self.path} is no longer this job's ({describe(holder) if holder else 'removed'})\n")
                return
            try:
                os.utime(self.path)
            except OSError:
                pass

    def _refusal(self, holder: dict) -> str:
        return (f"{self.folder}: in use by another job ({describe(holder)}, last heartbeat {holder['age_s']:.0f} s ago); "
                f"wait for it to end, or remove {self.path} if that job is gone")

    def _remove_created_folder(self) -> None:
        if self.created_folder:
            try:
                self.folder.rmdir()  # only if empty
            except OSError:
                pass
            self.created_folder = False


def describe(holder: dict) -> str:
    if holder.get("unreadable"):
        return "an unreadable lock file"
    parts = [str(holder.get("command") or "a mima command"), f"pid {holder.get('pid')} on {holder.get('host')}"]
    if holder.get("slurm_job_id"):
        parts.append(f"SLURM job {holder['slurm_job_id']}")
    if holder.get("started"):
        parts.append(f"since {holder['started']}")
    return ", ".join(parts)
