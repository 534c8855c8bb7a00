"""Evaluate finished `mima fit` runs of the same tasks (typically one per N, or one per N and seed):
theta_0, each task model, and each merge with hyperparameters chosen on the validation splits;
writes results.json/.csv/.md, selection.json and plots. Runs at one N that differ only in the seed
also get rows with the mean and standard deviation over the seeds. Every result is recorded in
--out/cells/ as soon as it is known: after a stop (SIGTERM, SIGUSR1, a crash) the same command goes
on where it stopped.
"""
# `mima evaluate`: merge and evaluate finished runs, the Table-1 results (mima.services.evaluate.runs runs it).

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mima.commands.common import COMPARED_MERGES, device_spelling
from mima.commands.common import OneLineParser, frozen_options, no_empty_folder_left
from mima.core.errors import MimaError
from mima.evaluation.cache_use import CACHE_MODES


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


def parse(argv: Sequence[str]) -> EvaluateOptions:
    parser = OneLineParser(prog="mima evaluate", description=__doc__)
    parser.add_argument("runs", type=Path, nargs="+",
                        help="`mima fit` run folders (one per N and seed; at most one joint run, model.mode: joint, adds a "
                        "`joint` row)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the results table, plots and cells")
    parser.add_argument("--merges", nargs="+", default=list(COMPARED_MERGES), help="data-free merge strategies to compare")
    parser.add_argument("--no-select", action="store_true", help="the papers' fixed hyperparameters, no validation search")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an evaluation of other runs or another configuration already in --out")
    parser.add_argument("--devices", type=int, default=None,
                        help="processes, one device (GPU, or CPU core) each, that share the work (default 1; under "
                        "srun: one per task)")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed", "16-mixed"), default=None,
                        help="default: bf16-mixed on a GPU, 32-true on the CPU")
    parser.add_argument("--val-examples", type=int, default=None, metavar="K",
                        help="choose hyperparameters on a fixed random subset of K validation examples per task "
                        "(the test split is always whole)")
    parser.add_argument("--skip-unfinished", action="store_true",
                        help="leave out (and name) runs that are missing or have not finished, e.g. cancelled elements "
                        "of a SLURM sweep, instead of refusing them")
    parser.add_argument("--merge-device", type=device_spelling, default=None, metavar="DEVICE",
                        help="where the merges' arithmetic runs: auto (default: each process's evaluation device, its "
                        "GPU where it has one), cpu, cuda or cuda:N")
    parser.add_argument("--num-workers", type=int, default=None, metavar="N",
                        help="loader worker processes per evaluation process, one set for every task and split "
                        "(default: the run's data.num_workers; 0 loads in the process itself)")
    parser.add_argument("--log-to-tracker", action="store_true",
                        help="also log each run's rows (evaluate/<model>/<task> accuracies) to the experiment-tracker "
                        "runs its `mima fit` logged to (trainer.logger: W&B, MLflow; recorded in RUN/tracker.json)")
    parser.add_argument("--cache", choices=CACHE_MODES, default=CACHE_MODES[0],
                        help="auto (default): on with a GPU, off on the CPU. on: the validation and test splits read "
                        "from the decoded-image cache (the files of data.cache, built where missing) in whole batches "
                        "normalised on the device, several merged models evaluated on each batch read, the encoder "
                        "compiled on a GPU (auto leaves tasks the cache cannot hold, e.g. the digits suite, on their own "
                        "path; on refuses them). off: item by item through the run's own data settings, as before")
    parsed = parser.parse_args(argv)
    try:
        return frozen_options(EvaluateOptions, parsed)
    except MimaError as mistake:
        parser.error(str(mistake))


def main(argv: Sequence[str]) -> None:
    options = parse(argv)
    from mima.services.evaluate.runs import evaluate_runs
    from mima.services.evaluate.team import team_for

    team = team_for(options.devices, argv)
    with no_empty_folder_left(options.out):
        evaluate_runs(list(options.runs), options.out, list(options.merges), not options.no_select, options.overwrite,
                      precision=options.precision, val_examples=options.val_examples, team=team,
                      skip_unfinished=options.skip_unfinished, num_workers=options.num_workers,
                      merge_device=options.merge_device, log_to_tracker=options.log_to_tracker,
                      cache=options.cache)
