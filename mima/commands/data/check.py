"""Check the files of the clip suite's benchmark tasks under a data root (names on disk only, nothing
is opened). Exit status 0 when every checked task is found, 1 otherwise.
"""
# `mima data check`: which benchmark tasks are ready under a data root (mima.data.check).

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mima.commands.common import OneLineParser, frozen_options
from mima.commands.data import add_root_and_tasks


@dataclass(frozen=True)
class CheckOptions:
    root: Path
    tasks: tuple[str, ...] | None  # None: the benchmark's, or every task of the clip suite
    benchmark: str | None
    download: bool


def parse(argv: Sequence[str]) -> CheckOptions:
    parser = OneLineParser(prog="mima data check", description=__doc__)
    add_root_and_tasks(parser, "check")
    parser.add_argument("--download", action="store_true",
                        help="first let torchvision download the checked tasks it can (needs internet)")
    return frozen_options(CheckOptions, parser.parse_args(argv))


def main(argv: Sequence[str]) -> int:
    """Exit status: 0 when every checked task is found, 1 otherwise."""
    options = parse(argv)
    from mima.data.check import run_check, select_tasks

    return run_check(options.root, select_tasks(options.tasks, options.benchmark), download=options.download)
