"""Evaluate finished `mima fit` runs of the same tasks (typically one per N, or one per N and seed):
theta_0, each task model, and each merge with hyperparameters chosen on the validation splits;
writes results.json/.csv/.md, selection.json and plots. Runs at one N that differ only in the seed
also get rows with the mean and standard deviation over the seeds. Every result is recorded in
--out/cells/ as soon as it is known: after a stop (SIGTERM, SIGUSR1, a crash) the same command goes
on where it stopped.
"""
# `mima evaluate`: the command line of mima.services.evaluate (its options: .options, its program: .runs).

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mima.commands.common import OneLineParser, device_spelling, frozen_options
from mima.core.errors import MimaError
from mima.evaluation.cache_use import CACHE_MODES
from mima.services.evaluate.options import COMPARED_MERGES, PRECISIONS, EvaluateOptions


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
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
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
    from mima.services.evaluate.runs import run_evaluation

    run_evaluation(options, argv)  # with --devices N, the others are started with this command line
