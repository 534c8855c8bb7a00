"""`mima data SUBCOMMAND`: the data tools, one module per subcommand (mima.commands.DATA_COMMANDS lists them)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from pathlib import Path

from mima.commands import DATA_COMMANDS, find


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The options of `mima data ARGV...`, the subcommand being argv[0]."""
    subcommand = find(DATA_COMMANDS, argv[0] if argv else "", "data subcommand")
    return importlib.import_module(subcommand.module).parse(argv[1:])


def main(argv: Sequence[str]) -> int | None:
    """Exit status of `mima data check` and `mima data prepare`: 0 when every task is ready, 1 otherwise."""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mima data SUBCOMMAND [options]\n\nsubcommands:")
        print("\n".join(f"  {command.name:<7} {command.summary}" for command in DATA_COMMANDS))
        return 0
    subcommand = find(DATA_COMMANDS, argv[0], "data subcommand")
    return importlib.import_module(subcommand.module).main(argv[1:])


def add_root_and_tasks(parser: argparse.ArgumentParser, verb: str) -> None:
    """--root and the task selection of `mima data check` and `mima data prepare`."""
    from mima.data.benchmarks import BENCHMARKS  # here: a merge or a fit has no use for the data package

    parser.add_argument("--root", type=Path, required=True, help="the data root (data.root of a fit config)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--tasks", nargs="+", metavar="TASK", help=f"tasks to {verb} (default: all tasks of the clip suite)")
    which.add_argument("--benchmark", choices=tuple(BENCHMARKS), help=f"{verb} the 8-, 14- or 20-task benchmark")
