"""Lay out the clip suite's tasks under --root from the archives their publishers distribute, with
task_vectors' splits (README, 'Real tasks'). One line per task: prepared (with its split sizes),
already there, or what is missing and where to get it. Exit status 0 when every task is ready, 1
otherwise.
"""
# `mima data prepare`: the publishers' archives laid out under --root (mima.data.prepare).

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mima.commands.common import OneLineParser, frozen_options
from mima.commands.data import add_root_and_tasks


@dataclass(frozen=True)
class PrepareOptions:
    root: Path
    tasks: tuple[str, ...] | None  # None: the benchmark's, or every task of the clip suite
    benchmark: str | None
    archives: Path | None  # None: --root
    download: bool
    overwrite: bool


def parse(argv: Sequence[str]) -> PrepareOptions:
    parser = OneLineParser(prog="mima data prepare", description=__doc__)
    add_root_and_tasks(parser, "prepare")
    parser.add_argument("--archives", type=Path, default=None, help="the folder holding the downloaded archives (default: --root)")
    parser.add_argument("--download", action="store_true", help="first fetch what torchvision's downloader can (needs internet)")
    parser.add_argument("--overwrite", action="store_true", help="prepare again tasks whose folder is already there")
    return frozen_options(PrepareOptions, parser.parse_args(argv))


def main(argv: Sequence[str]) -> int:
    options = parse(argv)
    from mima.data.check import select_tasks
    from mima.data.prepare import run_prepare, validate_arguments

    root = options.root.expanduser()
    archives = (options.archives or options.root).expanduser()
    names = select_tasks(options.tasks, options.benchmark)
    validate_arguments(root, archives, options.download, "--archives" if options.archives else "--root")
    from mima.core.run_outputs import refuse_output_on_runs

    refuse_output_on_runs("--root", root, [archives])
    return run_prepare(root, archives, names, download=options.download, overwrite=options.overwrite,
                       progress=lambda line: print(line, file=sys.stderr, flush=True))
