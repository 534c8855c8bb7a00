"""`mima analyze rank-sweep`: its options and the defaults they show. Imports nothing heavy, so that
the help and argument errors answer before torch is loaded; the computation reads its defaults here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from mima.analysis.options import ModelOptions, OutputOptions, add_model_arguments, add_output_arguments
from mima.merging.catalogue import DEFAULT_MATRIX_KEYS

NAME = "rank-sweep"
DEFAULT_RATIOS = (0.0, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.75, 1.0)
DEFAULT_LAM_CART = 1.0
DEFAULT_LAM_TA = 0.3


@dataclass(frozen=True)
class RankSweepOptions(ModelOptions, OutputOptions):
    ratios: tuple[float, ...]
    ranks: tuple[int, ...] | None  # None: every rank
    lam_cart: float
    lam_ta: float
    split: str  # "test" or "val"
    matrix_keys: str
    no_accuracy: bool


OPTIONS = RankSweepOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--ratios", type=float, nargs="+", default=list(DEFAULT_RATIOS),
                        help="kept-rank ratios in [0, 1] for the accuracy curve (default: %(default)s)")
    parser.add_argument("--ranks", type=int, nargs="+",
                        help="ranks k for I(k) and R(k) (default: every rank from 0 to full)")
    parser.add_argument("--lam-cart", type=float, default=DEFAULT_LAM_CART, help="lam of the centered merges (default: 1.0)")
    parser.add_argument("--lam-ta", type=float, default=DEFAULT_LAM_TA,
                        help="lam of the original-task-vector merges (default: 0.3, the top of paper 000's grid)")
    parser.add_argument("--split", choices=("test", "val"), default="test", help="data split for accuracy (default: test)")
    parser.add_argument("--matrix-keys", default=DEFAULT_MATRIX_KEYS,
                        help="regular expression of the 2-D weights that get low rank (default: attention and MLP weights)")
    parser.add_argument("--no-accuracy", action="store_true", help="only I(k) and R(k): no data, no config needed")
    add_output_arguments(parser, NAME)
