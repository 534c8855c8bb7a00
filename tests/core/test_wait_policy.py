"""`import mima` makes waiting OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE) before torch is loaded,
unless the user chose a policy: on a busy machine spinning threads slowed a 2-thread step 6.5x."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_import_mima_sets_the_wait_policy_before_torch_and_keeps_the_users(given, expected):
    environment = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    if given is not None:
        environment["OMP_WAIT_POLICY"] = given
    probe = "import os, sys, mima; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=environment, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [expected, "False"]  # set while torch is not loaded yet
