"""`mima fit`: one MIMA run through LightningCLI (the command line: mima.commands.fit.parser; the
program it runs: mima.services.fit); its parser is LightningCLI's, so only the --config files (and
the code the command line names) are checked before Lightning is imported."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mima.config.source import bounded_yaml, config_mapping
from mima.config.trust import check_argument_code
from mima.services.fit.config import check_config, check_config_file


def parse(argv: Sequence[str]):
    """The parsed `mima fit` options (LightningCLI's namespace; imports Lightning, reads --config files)."""
    from mima.commands.fit.parser import parse_fit

    return parse_fit(list(argv))


def main(argv: Sequence[str]) -> int:
    """Exit status: 0 when the run finished; 128 + the signal number when a signal stopped it after
    saving a checkpoint (on the process that was started; the others exit 0 so that launchers do not
    tear the job down before it has saved)."""
    check_config_files(argv)  # before Lightning is imported: a typo answers at once
    check_argument_code(list(argv))  # nothing the command line names is imported unless trusted
    from mima.core.environment import global_rank
    from mima.commands.fit.run import run_fit

    result = run_fit(list(argv))
    if result.preempted_by and global_rank() == 0:
        return 128 + result.preempted_by
    return 0


def check_config_files(argv: Sequence[str]) -> None:
    """Refuse a `--config FILE` (or -c FILE, --config=FILE) that does not exist, or that cannot be a run
    config: too large, not UTF-8, YAML whose aliases expand beyond a config's size, a section that is not
    a mapping, a number outside its range (mima.config.source). A value that holds YAML itself
    (jsonargparse takes that too) is checked the same way."""
    for index, word in enumerate(argv):
        if word in ("--config", "-c") and index + 1 < len(argv):
            value = argv[index + 1]
        elif word.startswith("--config="):
            value = word.split("=", 1)[1]
        else:
            continue
        holds_yaml = any(mark in value for mark in ("{", "\n", ": "))
        if holds_yaml:  # before jsonargparse imports what it names
            check_config(config_mapping(bounded_yaml(value, "--config"), "--config"), f"--config {value}")
        else:
            check_config_file(Path(value), f"--config {value}")
