"""Skip here, fail under CI: the one rule for tests that need something outside the repository
(the offline suite's data and weights, a real SLURM).

On a developer's machine a missing asset or tool is a skip whose reason says what is missing and
how to install it. Under CI it is a failure: CI installs everything (`.ci/run` runs
`tests/setup_assets.sh` and exports MIMA_CI=1), so a skip there would hide a broken install.
CI is detected by MIMA_CI=1 (or true/yes) or by CI=true, which the CI machine sets.
"""

from __future__ import annotations

import os

import pytest

def under_ci() -> bool:
    """True when MIMA_CI is 1/true/yes or CI is true/1 (case-insensitive)."""
    return (
        os.environ.get("MIMA_CI", "").strip().lower() in ("1", "true", "yes")
        or os.environ.get("CI", "").strip().lower() in ("1", "true")
    )


def require(missing: str | None) -> None:
    """Nothing when `missing` is None; otherwise skip with `missing` as the reason, or, under CI,
    fail with it (a skip under CI would pass a run whose install is broken)."""
    __tracebackhide__ = True  # report the skip or failure at the test, not here
    if missing is None:
        return
    if under_ci():
        pytest.fail(f"required under CI (MIMA_CI=1 or CI=true), so this is a failure, not a skip: {missing}",
                    pytrace=False)
    pytest.skip(missing)
