"""tests/job_server.py against what it stands in for: a `mima` command run by the server gives what
`python -m mima` gives in a new interpreter, and a job in another environment is not served."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import JOB_SERVER, REPO


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
