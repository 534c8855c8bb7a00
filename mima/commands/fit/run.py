"""`mima fit` run from its command line (or from a config dict, as the tests and the sweep give it):
parsed by mima.commands.fit.parser, run by mima.services.fit.run."""

from __future__ import annotations

import time

from mima.commands.fit.parser import build_cli, config_file_name
from mima.services.fit.program import fit_settings
from mima.services.fit.run import FitResult, fit_run


def run_fit(args: list[str] | dict) -> FitResult:
    """Run `mima fit`; returns the run folder and whether a signal stopped it early."""
    started = time.monotonic()
    cli = build_cli(args)
    return fit_run(fit_settings(cli, config_file_name(cli.config)), started)
