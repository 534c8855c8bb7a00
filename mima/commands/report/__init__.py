"""Write one page (report.md and a self-contained report.html) for a `mima fit` run folder or a sweep
folder (`mima demo`, `mima evaluate --out`): the Table-1 results, alignment and accuracy plots, the
analyses found under analysis/, and links to the checkpoints.
"""
# `mima report`: one Markdown and HTML page for a run or a sweep (mima.commands.report.page writes it).

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mima.commands.common import OneLineParser, frozen_options
from mima.core.folders import no_empty_folder_left


@dataclass(frozen=True)
class ReportOptions:
    folder: Path  # a sweep folder or a `mima fit` run folder
    out: Path | None  # None: the folder itself
    overwrite: bool


def parse(argv: Sequence[str]) -> ReportOptions:
    parser = OneLineParser(prog="mima report", description=__doc__)
    add_report_arguments(parser)
    return frozen_options(ReportOptions, parser.parse_args(argv))


def main(argv: Sequence[str]) -> None:
    options = parse(argv)
    from mima.commands.report.page import write_report

    started = time.time()
    with no_empty_folder_left(options.out):
        written = write_report(options.folder, options.out, options.overwrite)
        print(f"mima report: wrote {', '.join(map(str, written))} in {time.time() - started:.1f} s")


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", type=Path, help="a sweep folder (results.json, runs/) or a `mima fit` run folder")
    parser.add_argument("--out", type=Path, help="where report.md and report.html go (default: the folder itself)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier report in --out")
