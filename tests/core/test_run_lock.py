"""Issue 26, item 3: one job per run folder (mima.core.run_lock).

The lock's own rules with real processes (a live holder is refused with its name, a dead one's lock is
taken over, only the holder releases), and two `mima fit` on one run folder: the second is refused in one
line, the first finishes with the weights of the same run alone (on the old code both ran, and
metrics.jsonl got every phase twice).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mima.core.errors import MimaError
from mima.core.run_lock import RunLock
from tests.helpers import REPO, TWO, assert_identical, cli, finals, job_environment, lock_holder, run_job, write_config


def test_a_live_holder_is_refused_in_one_line_naming_it(tmp_path):
    job = lock_holder(tmp_path / "run")
    try:
        with pytest.raises(MimaError) as refused:
            RunLock(tmp_path / "run", "mima report").acquire()
        message = str(refused.value)
        assert "\n" not in message and "in use by another job" in message
        assert f"pid {job.pid} on {socket.gethostname()}" in message and "test holder" in message
        assert str(tmp_path / "run" / "LOCK") in message
    finally:
        job.communicate("\n", timeout=30)
    assert job.returncode == 0 and not (tmp_path / "run" / "LOCK").exists()
    with RunLock(tmp_path / "run", "mima report"):  # free again once released
        assert (tmp_path / "run" / "LOCK").is_file()
    assert not (tmp_path / "run" / "LOCK").exists()


def test_the_lock_of_a_killed_job_is_taken_over(tmp_path, capfd):
    job = lock_holder(tmp_path / "run")
    job.kill()
    job.wait(timeout=30)
    assert (tmp_path / "run" / "LOCK").is_file()  # SIGKILL gives no chance to clean up
    with RunLock(tmp_path / "run", "mima fit"):
        holder = json.loads((tmp_path / "run" / "LOCK").read_text())
        assert holder["pid"] == os.getpid() and holder["command"] == "mima fit"
    assert f"took over the lock {tmp_path / 'run' / 'LOCK'}" in capfd.readouterr().err


def _foreign_lock(folder: Path, age_s: float, slurm_job_id: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "LOCK"
    lock.write_text(json.dumps({"host": "some-other-node", "pid": 4242, "slurm_job_id": slurm_job_id,
                                "command": "mima fit", "started": "2026-01-01T00:00:00", "token": "x"}))
    stamp = time.time() - age_s
    os.utime(lock, (stamp, stamp))
    return lock


def test_another_hosts_lock_is_live_while_its_heartbeat_is_fresh_and_stale_after(tmp_path, monkeypatch):
    for variable in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID"):
        monkeypatch.delenv(variable, raising=False)
    _foreign_lock(tmp_path / "run", age_s=5)
    with pytest.raises(MimaError, match=r"in use by another job \(mima fit, pid 4242 on some-other-node"):
        RunLock(tmp_path / "run", "mima fit", stale_after_s=60).acquire()
    _foreign_lock(tmp_path / "run", age_s=120)
    with RunLock(tmp_path / "run", "mima fit", stale_after_s=60):
        assert json.loads((tmp_path / "run" / "LOCK").read_text())["pid"] == os.getpid()


def test_an_earlier_run_of_the_same_slurm_job_is_taken_over_at_once(tmp_path, monkeypatch):
    """A requeued job restarts under its job id, possibly on another node, while its old lock looks fresh."""
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    _foreign_lock(tmp_path / "run", age_s=1, slurm_job_id="777")
    with RunLock(tmp_path / "run", "mima fit"):
        assert json.loads((tmp_path / "run" / "LOCK").read_text())["slurm_job_id"] == "777"
    _foreign_lock(tmp_path / "run", age_s=1, slurm_job_id="778")
    with pytest.raises(MimaError, match="SLURM job 778"):
        RunLock(tmp_path / "run", "mima fit").acquire()


def test_release_leaves_a_lock_that_is_no_longer_its_own(tmp_path):
    lock = RunLock(tmp_path / "run", "mima fit").acquire()
    (tmp_path / "run" / "LOCK").write_text(json.dumps({"host": "x", "pid": 1, "token": "someone else"}))
    lock.release()
    assert json.loads((tmp_path / "run" / "LOCK").read_text())["token"] == "someone else"


def test_a_refused_lock_leaves_no_folder_it_created(tmp_path):
    lock = RunLock(tmp_path / "new", "mima fit").acquire()
    lock.release()
    assert not (tmp_path / "new").exists()  # nothing was written: the folder goes with the lock


@pytest.mark.slow
def test_two_fits_on_one_run_folder_the_second_is_refused_the_first_is_unchanged(tmp_path, small_clip, capfd):
    reference = tmp_path / "alone"
    config = write_config(tmp_path / "plain.yaml", small_clip, TWO, 1)
    alone = run_job(config, reference)
    assert alone.returncode == 0, alone.stderr[-3000:]
    out, go = tmp_path / "run", tmp_path / "go"
    held = write_config(tmp_path / "held.yaml", small_clip, TWO, 1, [("WaitForFileAtStep", {"step": 5, "path": str(go)})])
    first = subprocess.Popen([sys.executable, "-m", "mima", "fit", "--config", str(held), "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=job_environment())
    deadline = time.monotonic() + 120
    while not (out / "config.yaml").exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first.poll() is None, "the first fit ended before the second could start"
    command = ["fit", "--config", config]
    attempts = [command + ["--out", out], command + ["--out", out, "--ckpt_path", "last"],
                command + ["--out", out, "--overwrite", "true"]]
    for argv in attempts:  # the second fits in this process: the lock is the first fit's, held by its process
        second = cli(argv, capfd)
        lines = second.err.strip().splitlines()
        assert second.code == 2 and len(lines) == 1, second.err[-3000:]
        assert "in use by another job" in lines[0] and f"pid {first.pid}" in lines[0], lines[0]
    go.touch()  # the first fit goes on
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert_identical(finals(out, TWO), finals(reference, TWO))
    phases = [json.loads(line)["phase"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert phases == [1, 2, 3]
    assert not (out / "LOCK").exists()


# ------------------------------------------------------------ locks that are no lock (issue 41, item 8)
@pytest.mark.parametrize("kind", ["dangling symlink", "symlink to a file", "folder", "fifo"])
def test_a_lock_that_is_not_a_plain_file_is_named_for_what_it_is(tmp_path, kind):
    """No job makes these, so neither waiting nor "try again" helps: one line says what the LOCK is."""
    folder = tmp_path / "run"
    folder.mkdir()
    lock = folder / "LOCK"
    if kind == "dangling symlink":
        lock.symlink_to(tmp_path / "nowhere")
    elif kind == "symlink to a file":
        (tmp_path / "elsewhere").write_text("{}")
        lock.symlink_to(tmp_path / "elsewhere")
    elif kind == "folder":
        lock.mkdir()
    else:
        os.mkfifo(lock)
        # bytes in the FIFO, which a reader of the LOCK would take. No one writes to a stray FIFO, so a
        # reader there waits for ever: the test holds its writing end (a reader's open goes through)
        # and closes it after 30 s, which ends a reader's wait, so that reading fails the check below
        # instead of hanging the test; the reading end the test holds keeps the bytes in the FIFO.
        unread = os.open(lock, os.O_RDONLY | os.O_NONBLOCK)
        writer = os.open(lock, os.O_WRONLY | os.O_NONBLOCK)
        os.write(writer, b"unread")
        closed = threading.Event()

        def close_writer() -> None:
            if not closed.is_set():
                closed.set()
                os.close(writer)

        release = threading.Timer(30, close_writer)
        release.start()
    expected = {"dangling symlink": f"is a symbolic link to {tmp_path / 'nowhere'}",
                "symlink to a file": f"is a symbolic link to {tmp_path / 'elsewhere'}",
                "folder": "is a folder", "fifo": "is not a regular file"}[kind]
    with pytest.raises(MimaError, match="not a lock file of mima's") as refused:
        RunLock(folder, "mima fit").acquire()
    assert f"{lock}: {expected}" in str(refused.value) and "\n" not in str(refused.value)
    if kind == "fifo":  # named for what it is without being read
        release.cancel()
        release.join()  # the timer's thread, if it closed the writing end, is done with it
        close_writer()
        assert os.read(unread, 64) == b"unread"
        os.close(unread)
    assert os.path.lexists(lock)  # left for the user to look at


@pytest.mark.parametrize("age_s, taken", [(10, False), (3600, True)])
def test_a_binary_lock_is_an_unreadable_holder_taken_over_once_stale(tmp_path, capfd, age_s, taken):
    folder = tmp_path / "run"
    folder.mkdir()
    lock = folder / "LOCK"
    lock.write_bytes(bytes(range(256)) * 4)
    stamp = time.time() - age_s
    os.utime(lock, (stamp, stamp))
    if not taken:
        with pytest.raises(MimaError, match="in use by another job \\(an unreadable lock file"):
            RunLock(folder, "mima fit").acquire()
        return
    with RunLock(folder, "mima fit"):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert "(an unreadable lock file, untouched for 3600 s)" in capfd.readouterr().err
