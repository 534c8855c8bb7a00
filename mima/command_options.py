"""The options of the commands whose modules import torch (merge, report) and the defaults the demo and
evaluate parsers show: declared here, importing nothing heavy, so that `mima COMMAND --help` and
argument errors answer before torch is loaded. The commands (mima.merge_command, mima.report,
mima.demo) run the parsed options.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from mima.merging.catalogue import HYPERPARAMETERS, STRATEGIES, Hyperparameter

DEMO_ITERATIONS = (1, 2, 4, 8)
DEMO_MERGES = ("uniform", "task_arithmetic", "ties", "cart")  # the foundation merges; --merges picks others


# ------------------------------------------------------------------------------ merge
def _flag_help(spec: Hyperparameter) -> str:
    takers = sorted(name for name, strategy in STRATEGIES.items() if spec.name in strategy.hyperparameters)
    what = spec.doc if spec.choices is not None else f"{spec.doc}; {spec.meaning}"  # argparse lists the choices
    return f"{what} (methods: {', '.join(takers) or 'none'})".replace("%", "%%")


def device_spelling(text: str) -> str:
    """A device as the merge commands spell it (checked without torch; whether this machine has it is
    checked when the command runs, mima.merging.engine.merge_device)."""
    if re.fullmatch(r"auto|cpu|cuda(:\d+)?", text.strip().lower()) is None:
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def add_merge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", required=True, help=f"one of: {', '.join(sorted(STRATEGIES))}")
    parser.add_argument("--base", type=Path, help="theta_0, the pretrained state dict (not needed by uniform, cart, ...)")
    parser.add_argument("--models", type=Path, nargs="+", required=True,
                        help="fine-tuned state dicts (.safetensors), or one `mima fit` run folder")
    parser.add_argument("--output", type=Path, required=True, help="where to write the merged .safetensors")
    parser.add_argument("--config", type=Path, help="a mima fit config or run folder: the tasks' model and data")
    parser.add_argument("--select-on", choices=("val",), help="choose hyperparameters on the validation splits")
    parser.add_argument("--overwrite", action="store_true", help="replace --output (and its results) if they exist")
    parser.add_argument("--allow-non-finite", action="store_true",
                        help="merge weights holding NaN or Inf as they are (by default an input tensor holding them is an "
                        "error naming the file and tensor, and so is a merged tensor that overflows, e.g. with a huge --lam)")
    parser.add_argument("--device", type=device_spelling, default="auto", metavar="auto|cpu|cuda|cuda:N",
                        help="where the merge's arithmetic runs, one tensor group at a time (default auto: the first GPU "
                        "when torch sees one, else the CPU); --device cpu gives the CPU's file bit for bit")
    hyper = parser.add_argument_group("hyperparameters (one flag per declaration in mima.merging.catalogue; "
                                      "each method takes some, see its docstring)")
    for spec in HYPERPARAMETERS.values():
        hyper.add_argument(spec.flag, dest=spec.name, default=None, help=_flag_help(spec), **spec.argparse_options())


# ----------------------------------------------------------------------------- report
def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", type=Path, help="a sweep folder (results.json, runs/) or a `mima fit` run folder")
    parser.add_argument("--out", type=Path, help="where report.md and report.html go (default: the folder itself)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier report in --out")
