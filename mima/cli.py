"""The `mima` command line.

    mima demo  [--out DIR] [--iterations 1 2 4 8] [--steps 320] ...   the embedded default end to end
    mima fit   --config FILE [--out DIR] [--trainer.* ...] [--model.* ...]  one MIMA run (LightningCLI)
    mima merge --method NAME [--base BASE] --models A B ... --output OUT [--lam X] [--k P] [--rank-ratio R]

A user's mistake (a missing file, an unknown option value, incompatible checkpoints) is reported
as one line on stderr with exit status 2, and leaves no partial output behind.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from mima.errors import MimaError

COMMANDS = {
    "demo": "run the embedded default end to end (pretrain, MIMA for several N, merge, evaluate)",
    "fit": "run one MIMA configuration (LightningCLI: --config FILE, --trainer.*, --model.*, --data.*)",
    "merge": "merge fine-tuned state dicts with a registered strategy",
}


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the option (not the whole usage text)."""

    def error(self, message: str):  # type: ignore[override]
        raise MimaError(f"{message} (see {self.prog} --help)")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = args[0], args[1:]
    try:
        if command == "demo":
            demo_command(rest)
        elif command == "fit":
            return fit_command(rest)
        elif command == "merge":
            merge_command(rest)
        else:
            raise MimaError(f"unknown command '{command}' (commands: {', '.join(COMMANDS)})")
    except MimaError as exc:
        print(f"mima {command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _usage() -> str:
    lines = ["usage: mima COMMAND [options]   (mima COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<6} {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


# -------------------------------------------------------------------------------- fit
def fit_command(argv: Sequence[str]) -> int:
    """Exit status: 0 when the run finished; 128 + the signal number when a signal stopped it after
    saving a checkpoint (on the process that was started; the others exit 0 so that launchers do not
    tear the job down before it has saved)."""
    from mima.training.trainer import launch_rank, run_fit

    result = run_fit(argv)
    if result.preempted_by and launch_rank() == 0:
        return 128 + result.preempted_by
    return 0


# ------------------------------------------------------------------------------- demo
def demo_command(argv: Sequence[str]) -> None:
    from mima.demo import DEMO_ITERATIONS, run_demo
    from mima.training.plan import check_budget

    parser = _OneLineParser(prog="mima demo", description="MIMA on the embedded digits tasks, end to end.")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder (default: runs/demo)")
    parser.add_argument("--iterations", type=int, nargs="+", default=list(DEMO_ITERATIONS), help="values of N")
    parser.add_argument("--steps", type=int, default=320, help="S, steps per task (each N must divide it)")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant")
    parser.add_argument(
        "--no-select", action="store_true", help="use the papers' fixed merge hyperparameters instead of validation"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    options = parser.parse_args(argv)
    for n in options.iterations:
        check_budget(options.steps, n, names=("--steps", "--iterations"))
    run_demo(
        options.out,
        iterations=options.iterations,
        steps=options.steps,
        lr_schedule=options.lr_schedule,
        select_on_val=not options.no_select,
        overwrite=options.overwrite,
        progress=not options.no_progress,
    )


# ------------------------------------------------------------------------------ merge
MERGE_FLAGS = {"lam": "--lam", "k": "--k", "rank_ratio": "--rank-ratio"}


def merge_command(argv: Sequence[str]) -> None:
    from mima.merging import MERGE_METHODS, get_method
    from mima.safetensors_io import load_state_dict, save_state_dict
    from mima.state_dicts import check_compatible

    parser = _OneLineParser(prog="mima merge", description="Merge fine-tuned image-encoder state dicts.")
    parser.add_argument("--method", required=True, help=f"one of: {', '.join(sorted(MERGE_METHODS))}")
    parser.add_argument("--base", type=Path, help="theta_0, the pretrained state dict (not needed by uniform, cart)")
    parser.add_argument("--models", type=Path, nargs="+", required=True, help="fine-tuned state dicts (.safetensors)")
    parser.add_argument("--output", type=Path, required=True, help="where to write the merged .safetensors")
    parser.add_argument("--lam", type=float, help="scaling coefficient lambda (task_arithmetic, ties, cart)")
    parser.add_argument("--k", type=float, help="TIES: percent of entries kept by the trim (default 20)")
    parser.add_argument("--rank-ratio", type=float, help="CART: kept fraction of each matrix's rank (default 0.08)")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    options = parser.parse_args(argv)

    method = get_method(options.method)
    hparams = {name: getattr(options, name) for name in MERGE_FLAGS if getattr(options, name) is not None}
    for name, value in hparams.items():
        if name not in method.defaults:
            raise MimaError(f"{MERGE_FLAGS[name]} does not apply to merge method '{method.name}'")
        if not math.isfinite(value):
            raise MimaError(f"{MERGE_FLAGS[name]} must be a finite number, got {value}")
    if "k" in hparams and not 0 < hparams["k"] <= 100:
        raise MimaError(f"--k is a percentage of entries kept, in (0, 100]; got {hparams['k']}")
    if "rank_ratio" in hparams and not 0 <= hparams["rank_ratio"] <= 1:
        raise MimaError(f"--rank-ratio is a fraction of the rank, in [0, 1]; got {hparams['rank_ratio']}")
    if method.needs_base and options.base is None:
        raise MimaError(f"merge method '{method.name}' needs the pretrained model: pass --base")
    if options.output.exists() and not options.overwrite:
        raise MimaError(f"--output {options.output}: already exists (pass --overwrite to replace it)")

    inputs = ([options.base] if options.base is not None else []) + list(options.models)
    loaded = {str(path): load_state_dict(path) for path in inputs}
    if len(loaded) != len(inputs):
        raise MimaError("the same file is given twice among --base and --models")
    check_compatible(loaded)
    base = loaded[str(options.base)] if options.base is not None else None
    models = [loaded[str(path)] for path in options.models]
    merged = method(models, base, **hparams)
    used = {**method.defaults, **hparams}
    save_state_dict(
        options.output,
        merged,
        metadata={
            "method": method.name,
            "hparams": {k: v for k, v in used.items()},
            "base": str(options.base) if options.base else None,
            "models": [str(path) for path in options.models],
        },
        overwrite=options.overwrite,
    )
    print(f"merged {len(models)} models with {method.name} ({', '.join(f'{k}={v}' for k, v in hparams.items()) or 'defaults'}) -> {options.output}")


if __name__ == "__main__":
    sys.exit(main())
