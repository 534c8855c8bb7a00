"""`mima analyze gradients`: its options and the defaults they show. Imports nothing heavy, so that
the help and argument errors answer before torch is loaded; the computation reads its defaults here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from mima.analysis.options import OutputOptions

NAME = "gradients"
DEFAULT_LR: dict[str, float] = {"sgd": 0.01, "adamw": 1e-3}


@dataclass(frozen=True)
class GradientsOptions(OutputOptions):
    run: Path  # a run folder or a fit config file
    tasks: tuple[str, ...] | None  # None: every task of the run
    epochs: int
    optimizer: str  # "sgd" or "adamw"
    lr: float | None  # None: DEFAULT_LR of the optimizer
    weight_decay: float | None
    batch_size: int
    train_examples: int | None
    seed: int
    device: str | None


OPTIONS = GradientsOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run", type=Path, metavar="RUN",
        help="a `mima fit` run folder (theta_0 = its pretrained.safetensors) or a fit config file (theta_0 = its model); "
        "only theta_0, the tasks and their data are used",
    )
    parser.add_argument("--tasks", nargs="+", help="tasks to fine-tune (default: all the run's tasks)")
    parser.add_argument("--epochs", type=int, default=5, help="E, epochs of fine-tuning per task (default: 5)")
    parser.add_argument("--optimizer", choices=tuple(DEFAULT_LR), default="sgd",
                        help="sgd (plain: the epoch's update is exactly -lr * g_k; default) or adamw")
    parser.add_argument("--lr", type=float, help=f"learning rate (default: {DEFAULT_LR['sgd']} for sgd, {DEFAULT_LR['adamw']} for adamw)")
    parser.add_argument("--weight-decay", type=float, default=None, help="AdamW weight decay (default: 0.1; not allowed with sgd)")
    parser.add_argument("--batch-size", type=int, default=64, help="minibatch size (default: 64)")
    parser.add_argument("--train-examples", type=int, help="use at most this many training images per task (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the training subset and the shuffling (default: 0)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--out", type=Path, help=f"output folder (default: RUN/analysis/{NAME} for a run folder, else analysis/{NAME})")
    parser.add_argument("--overwrite", action="store_true", help="replace outputs already in --out")
