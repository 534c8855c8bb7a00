"""MIMA on the embedded digits tasks (configs/demo.yaml), end to end.
"""
# `mima demo`: MIMA on the embedded digits tasks end to end (mima.commands.demo.run runs it).

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mima.commands.common import OneLineParser, frozen_options
from mima.services.evaluate.options import COMPARED_MERGES

DEMO_ITERATIONS = (1, 2, 4, 8)  # the values of N the demo trains


@dataclass(frozen=True)
class DemoOptions:
    out: Path
    iterations: tuple[int, ...]  # the values of N
    steps: int | None  # S; None: configs/demo.yaml's
    lr_schedule: str | None
    no_select: bool
    merges: tuple[str, ...]
    no_joint: bool
    overwrite: bool
    no_progress: bool
    seeds: tuple[int, ...] | None  # None: one run per N at configs/demo.yaml's seed


def parse(argv: Sequence[str]) -> DemoOptions:
    parser = OneLineParser(prog="mima demo", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder (default: runs/demo)")
    parser.add_argument("--iterations", type=int, nargs="+", default=list(DEMO_ITERATIONS), help="values of N")
    parser.add_argument("--steps", type=int, help="S, steps per task (each N must divide it; default: configs/demo.yaml's 320); "
                        "the warm-up follows at 10%% of S")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), help="default: configs/demo.yaml's (constant)")
    parser.add_argument(
        "--no-select", action="store_true", help="use the papers' fixed merge hyperparameters instead of validation"
    )
    parser.add_argument("--merges", nargs="+", default=list(COMPARED_MERGES),
                        help=f"data-free merge strategies to compare (default: {' '.join(COMPARED_MERGES)})")
    parser.add_argument("--no-joint", action="store_true",
                        help="skip the joint multi-task baseline (one model trained on all tasks, same S)")
    parser.add_argument("--overwrite", action="store_true", help="replace results and runs already in --out (without it, runs already there resume, finished ones are kept)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, metavar="SEED",
                        help="one run per N and seed (seed_everything and data.seed; runs/N<n>-seed<s>), the table with "
                        "mean and std over the seeds (default: one run per N at configs/demo.yaml's seed)")
    return frozen_options(DemoOptions, parser.parse_args(argv))


def main(argv: Sequence[str]) -> None:
    options = parse(argv)
    from mima.core.plan import check_budget
    from mima.commands.demo.run import demo_config, run_demo
    from mima.commands.sweep import check_seeds

    check_seeds(options.seeds)

    steps = options.steps if options.steps is not None else int(demo_config()["model"]["steps"])
    for n in options.iterations:
        check_budget(steps, n, names=("--steps", "--iterations"))
    run_demo(
        options.out,
        iterations=list(options.iterations),
        steps=options.steps,
        lr_schedule=options.lr_schedule,
        select_on_val=not options.no_select,
        overwrite=options.overwrite,
        progress=not options.no_progress,
        merges=list(options.merges),
        joint=not options.no_joint,
        seeds=None if options.seeds is None else list(options.seeds),
    )
