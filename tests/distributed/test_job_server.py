"""tests/job_server.py against what it stands in for: a `mima` command run by the server gives what
`python -m mima` gives in a new interpreter, a two-process job whose second rank the job's zygote
forked (tests/rank_starter.py) writes what one of new interpreters writes, a rank killed by a signal
fails the job as Lightning's observer of a real child would see it, and a job in another environment
is not served."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.helpers import JOB_SERVER, REPO, assert_identical, finals, group_ended, job_environment, write_config

TWO = ["rot90", "mirror"]


def python_m_mima(argv: list[str], environment: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mima", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=environment)


@pytest.mark.parametrize("argv", [["--help"], ["frobnicate"], ["merge", "--config", "missing.yaml"],
                                  ["evaluate", "--merges", "nope"]])
def test_a_command_from_the_server_exits_and_prints_as_a_new_interpreter_does(argv):
    session = JOB_SERVER.environment  # the environment the server serves (tests/conftest.py pins it)
    assert JOB_SERVER.serves(session)
    served, new = JOB_SERVER.run(argv, session, timeout=120), python_m_mima(argv, session)
    assert (served.returncode, served.stdout, served.stderr) == (new.returncode, new.stdout, new.stderr)
    assert served.stdout or served.stderr  # something was compared


def test_a_job_in_another_environment_is_not_served():
    session = JOB_SERVER.environment
    assert JOB_SERVER.serves(dict(session, PYTEST_CURRENT_TEST="another test"))  # pytest's own variable
    # read by huggingface_hub on import, which the server has done
    assert not JOB_SERVER.serves(dict(session, HF_HUB_OFFLINE="1"))


@pytest.mark.slow
def test_a_two_process_job_from_the_server_writes_what_new_interpreters_write(tmp_path, small_clip):
    config = write_config(tmp_path / "two.yaml", small_clip, TWO, 2, [("RecordProcessCommand", {})])
    argv = ["fit", "--config", str(config), "--out", str(tmp_path / "served")]
    assert JOB_SERVER.serves(JOB_SERVER.environment)
    served = JOB_SERVER.run(argv, JOB_SERVER.environment, timeout=300)
    assert served.returncode == 0, served.stderr[-3000:]
    argv[-1] = str(tmp_path / "new")
    new = subprocess.run([sys.executable, "-m", "mima", *argv], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=job_environment(), start_new_session=True)
    assert new.returncode == 0, new.stderr[-3000:]
    assert_identical(finals(tmp_path / "served", TWO), finals(tmp_path / "new", TWO))
    # which program each rank's process was: in the served job both are forks of the server (rank 1 the
    # zygote's), in the other job new interpreters started as `python -m mima` and `-m mima.__main__`
    commands = {run: [(tmp_path / run / f".command-{rank}").read_text() for rank in (0, 1)] for run in ("served", "new")}
    assert all(command.endswith("-m tests.job_server " + command.split()[-1]) for command in commands["served"]), commands
    assert commands["new"][0].split()[1:3] == ["-m", "mima"], commands
    assert commands["new"][1].split()[1:3] == ["-m", "mima.__main__"], commands


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_fails_the_served_job_and_leaves_no_process(tmp_path, small_clip):
    """Rank 1 SIGKILLs itself: its starter dies by the same signal, so Lightning's observer in rank 0
    ends the job at once, and nothing of the job (zygote, starter, ranks) is left."""
    config = write_config(tmp_path / "die.yaml", small_clip, TWO, 2,
                          [("KillAtStep", {"step": 3, "rank": 1, "group": False})], collective_timeout=60)
    assert JOB_SERVER.serves(JOB_SERVER.environment)
    done = JOB_SERVER.run(["fit", "--config", str(config), "--out", str(tmp_path / "run")], JOB_SERVER.environment,
                          timeout=240)
    # Lightning's observer in rank 0 saw its child (the starter) end with a non-zero status and killed
    # rank 0 with SIGKILL: without the starter's status, rank 0 would wait out its 60 s collective timeout
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stderr[-3000:])
    assert group_ended(done.pid, within_s=30), "a process of the job (rank, starter or zygote) is still running"
