"""`mima analyze ctl`: its options and the defaults they show. Imports nothing heavy, so that
the help and argument errors answer before torch is loaded; the computation reads its defaults here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from mima.analysis.options import ModelOptions, OutputOptions, add_model_arguments, add_output_arguments

NAME = "ctl"
OUTPUT = "output"  # layer name standing for the whole model's output (the tower's embedding)
DEFAULT_ALPHAS = (0.25, 0.5, 0.75)
PAPER_LAMBDA = 0.4


@dataclass(frozen=True)
class CtlOptions(ModelOptions, OutputOptions):
    tasks: tuple[str, str] | None  # None: the run's first two, or the files' names
    alphas: tuple[float, ...]
    examples: int
    layers: str | None  # a regular expression of module names; None: every block and the output
    lam: float
    no_arithmetic: bool
    batch_size: int
    device: str | None  # None: cuda when available, else cpu


OPTIONS = CtlOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--tasks", nargs=2, metavar=("A", "B"),
                        help="the two tasks: of the run folder (default: its first two), or of MODEL_A MODEL_B "
                             "(default: the file names) whose test images are used")
    parser.add_argument("--alphas", type=float, nargs="+", default=list(DEFAULT_ALPHAS),
                        help="interpolation weights alpha of theta_A, in [0, 1] (default: 0.25 0.5 0.75)")
    parser.add_argument("--examples", type=int, default=200, help="test images, half from each task (default: 200)")
    parser.add_argument("--layers", metavar="REGEX",
                        help="module names of the image encoder to measure, full match (default: every block and "
                             f"'{OUTPUT}', the tower output)")
    parser.add_argument("--lam", type=float, default=PAPER_LAMBDA,
                        help="task-arithmetic scale lambda for the Eq. 2 check (default: 0.4, the paper's)")
    parser.add_argument("--no-arithmetic", action="store_true", help="skip the task-arithmetic (Eq. 2) check")
    parser.add_argument("--batch-size", type=int, default=100, help="images per forward pass (default: 100)")
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    add_output_arguments(parser, NAME)
