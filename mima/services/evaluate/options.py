"""What one `mima evaluate` is asked to do (EvaluateOptions), and the checks its command line makes,
for a caller that has no command line (mima.api.evaluate): the same refusals, in the same words.
Imports nothing heavy: the command's parser builds these options before torch loads."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from mima.core.spelling import check_device_spelling
from mima.services.arguments import names_of, path_of, paths_of, switch_of
from mima.core.errors import MimaError
from mima.evaluation.cache_use import CACHE_MODES

# the data-free merges the demo and `mima evaluate` compare unless --merges names others (the foundation merges)
COMPARED_MERGES = ("uniform", "task_arithmetic", "ties", "cart")
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")  # --precision
COMMAND = "mima evaluate"  # the command whose --help a refusal points to


@dataclass(frozen=True)
class EvaluateOptions:
    runs: tuple[Path, ...]  # `mima fit` run folders
    out: Path
    merges: tuple[str, ...]
    no_select: bool
    overwrite: bool
    devices: int | None  # processes; None: 1, or one per srun task
    precision: str | None  # None: bf16-mixed on a GPU, 32-true on the CPU
    val_examples: int | None  # K validation examples per task; None: all
    skip_unfinished: bool
    merge_device: str | None  # None: auto
    num_workers: int | None  # None: the run's data.num_workers
    log_to_tracker: bool  # also send each run's rows to the tracker runs its fit logged to
    cache: str  # auto, on or off (mima.evaluation.cache_use)

    def __post_init__(self) -> None:
        """The checks argparse cannot make, each made here once (what needs torch, e.g. whether this
        machine has --devices GPUs, mima.services.evaluate.team checks)."""
        if self.devices is not None and self.devices < 1:
            raise MimaError(f"--devices {self.devices}: expected at least 1")
        if self.val_examples is not None and self.val_examples <= 0:
            raise MimaError(f"--val-examples {self.val_examples}: expected a positive number of examples per task")
        if self.num_workers is not None and self.num_workers < 0:
            raise MimaError(f"--num-workers {self.num_workers}: expected 0 or more loader worker processes")


def evaluate_options(runs: str | os.PathLike | Sequence[str | os.PathLike], out: str | os.PathLike, *,
                     merges: Sequence[str] | None = None, no_select: bool = False, overwrite: bool = False,
                     precision: str | None = None, val_examples: int | None = None, skip_unfinished: bool = False,
                     merge_device: str | None = None, num_workers: int | None = None,
                     cache: str | None = None) -> EvaluateOptions:
    """The options of one process's `mima evaluate` from Python values, each refused as the command's
    parser refuses its word (the value as its text, in the order of the command line), then as
    EvaluateOptions checks them."""
    runs = paths_of("runs", runs)  # of the types the command's words can be, else one line (mima.services.arguments)
    merges = names_of("merges", merges)
    if merges is not None and len(merges) == 0:
        parser_error("argument --merges: expected at least one argument")
    values = dict(
        merges=tuple(COMPARED_MERGES if merges is None else merges), no_select=switch_of("no_select", no_select),
        overwrite=switch_of("overwrite", overwrite), devices=None, precision=chosen("--precision", precision, PRECISIONS),
        val_examples=whole_number("--val-examples", val_examples),
        skip_unfinished=switch_of("skip_unfinished", skip_unfinished),
        merge_device=spelled_device("--merge-device", merge_device), num_workers=whole_number("--num-workers", num_workers),
        log_to_tracker=False, cache=chosen("--cache", CACHE_MODES[0] if cache is None else cache, CACHE_MODES))
    paths, out = tuple(required_runs(runs)), path_of("out", out)
    try:
        return EvaluateOptions(runs=paths, out=out, **values)
    except MimaError as mistake:  # worded as the command's parser words it
        parser_error(str(mistake))


def parser_error(message: str) -> NoReturn:
    """A refusal as the command's parser words it (mima.commands.common.OneLineParser)."""
    raise MimaError(f"{message} (see {COMMAND} --help)")


def required_runs(runs: list) -> list:
    if not runs:
        parser_error("the following arguments are required: runs")
    return runs


def chosen(flag: str, value: object, choices: Sequence[str]) -> str | None:
    """`value` if it is one of `choices` (None: the option not given)."""
    if value is None or str(value) in choices:
        return None if value is None else str(value)
    parser_error(f"argument {flag}: invalid choice: {str(value)!r} (choose from {', '.join(map(repr, choices))})")


def read_word(flag: str, value: object, read: Callable[[str], Any], mistake: Callable[[ValueError], str]) -> Any:
    """`value` read from its text as the parser reads the word (None: the option not given); a word
    `read` refuses is the parser's line, `mistake` saying what is wrong with it."""
    if value is None:
        return None
    try:
        return read(str(value))
    except ValueError as problem:
        parser_error(f"argument {flag}: {mistake(problem)}")


def whole_number(flag: str, value: object) -> int | None:
    """`value` read as the parser reads the word (int of its text); None: the option not given."""
    return read_word(flag, value, int, lambda _: f"invalid int value: {str(value)!r}")


def spelled_device(flag: str, value: object) -> str | None:
    """A device spelled as the command spells it (whether this machine has it: when the merges run)."""
    return read_word(flag, value, check_device_spelling, str)
