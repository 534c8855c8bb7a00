"""tests/job_server.py against what it stands in for: a `mima` command run by the server gives what
`python -m mima` gives in a new interpreter, and a job in another environment is not served."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import JOB_SERVER, REPO, job_environment, run_command


def python_m_mima(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mima", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=job_environment())


@pytest.mark.parametrize("argv", [["--help"], ["frobnicate"], ["merge", "--config", "missing.yaml"],
                                  ["evaluate", "--merges", "nope"]])
def test_a_command_from_the_server_exits_and_prints_as_a_new_interpreter_does(argv):
    assert JOB_SERVER.serves(job_environment())  # the session's environment: this goes to the server
    served, new = run_command(argv), python_m_mima(argv)
    assert (served.returncode, served.stdout, served.stderr) == (new.returncode, new.stdout, new.stderr)
    assert served.stdout or served.stderr  # something was compared


def test_a_job_in_another_environment_is_not_served(monkeypatch):
    assert JOB_SERVER.serves(job_environment())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read by huggingface_hub on import, which the server has done
    assert not JOB_SERVER.serves(job_environment())
