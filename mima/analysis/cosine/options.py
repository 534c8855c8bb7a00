"""`mima analyze cosine`: its options. Imports nothing heavy, so that the help and argument errors
answer before torch is loaded."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from mima.analysis.options import OutputOptions

NAME = "cosine"


@dataclass(frozen=True)
class CosineOptions(OutputOptions):
    runs: tuple[Path, ...]  # run folders, or one sweep folder


OPTIONS = CosineOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", type=Path, nargs="+", help="`mima fit` run folders, or a sweep folder (its runs/*)")
    parser.add_argument("--out", type=Path, help="output folder (default: RUN/analysis/cosine for one folder given)")
    parser.add_argument("--overwrite", action="store_true", help="replace outputs already in --out")
