"""`mima analyze landscape`: its options and the defaults they show. Imports nothing heavy, so that
the help and argument errors answer before torch is loaded."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from mima.analysis.options import ModelOptions, OutputOptions, add_model_arguments, add_output_arguments

NAME = "landscape"
DEFAULT_MERGES = ("uniform", "task_arithmetic")


@dataclass(frozen=True)
class LandscapeOptions(ModelOptions, OutputOptions):
    tasks: tuple[str, str]
    resolution: int
    margin: float
    examples: int
    merges: tuple[str, ...]
    lam: float | None  # None: each merge's own default


OPTIONS = LandscapeOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--tasks", nargs=2, required=True, metavar=("A", "B"),
                        help="the two tasks whose task vectors span the plane")
    parser.add_argument("--resolution", type=int, default=11, help="grid points per axis (default 11)")
    parser.add_argument("--margin", type=float, default=0.2,
                        help="widen the marked points' bounding box by this fraction of its size on each side (default 0.2)")
    parser.add_argument("--examples", type=int, default=200,
                        help="test examples per task, a fixed subset (default 200)")
    parser.add_argument("--merges", nargs="*", default=list(DEFAULT_MERGES),
                        help="data-free merges of all task models to mark (default: uniform task_arithmetic)")
    parser.add_argument("--lam", type=float, default=None,
                        help="lambda for the marked merges that take one (default: each merge's own default)")
    add_output_arguments(parser, NAME)
