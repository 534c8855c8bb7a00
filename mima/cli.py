"""The `mima` command line.

    mima demo  [--out DIR] [--iterations 1 2 4 8] [--steps 320] ...   the embedded default end to end
    mima fit   --config FILE [--out DIR] [--trainer.* ...] [--model.* ...]  one MIMA run (LightningCLI)
    mima merge --method NAME [--base BASE] --models A B ... | RUN_DIR --output OUT [--select-on val] [--lam X] ...
    mima convert CHECKPOINT.pt OUT.safetensors [--prefix model.visual.]

A user's mistake (a missing file, an unknown option value, incompatible checkpoints) is reported
as one line on stderr with exit status 2, and leaves no partial output behind.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from mima.errors import MimaError

COMMANDS = {
    "demo": "run the embedded default end to end (pretrain, MIMA for several N, merge, evaluate)",
    "fit": "run one MIMA configuration (LightningCLI: --config FILE, --trainer.*, --model.*, --data.*)",
    "merge": "merge fine-tuned state dicts (or a run folder) with a registered strategy",
    "convert": "turn a pickled module checkpoint into a safetensors state dict, without running its code",
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
        elif command == "convert":
            convert_command(rest)
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
    from mima.demo import DEMO_ITERATIONS, DEMO_MERGES, run_demo
    from mima.training.plan import check_budget

    parser = _OneLineParser(prog="mima demo", description="MIMA on the embedded digits tasks, end to end.")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder (default: runs/demo)")
    parser.add_argument("--iterations", type=int, nargs="+", default=list(DEMO_ITERATIONS), help="values of N")
    parser.add_argument("--steps", type=int, default=320, help="S, steps per task (each N must divide it)")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant")
    parser.add_argument(
        "--no-select", action="store_true", help="use the papers' fixed merge hyperparameters instead of validation"
    )
    parser.add_argument("--merges", nargs="+", default=list(DEMO_MERGES), help="merge methods to compare")
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
        merges=options.merges,
    )


# ------------------------------------------------------------------------------ merge
def merge_command(argv: Sequence[str]) -> None:
    from mima.merging.command import add_arguments, run_merge

    parser = _OneLineParser(prog="mima merge", description="Merge fine-tuned image-encoder state dicts.")
    add_arguments(parser)
    run_merge(parser.parse_args(argv))


# ---------------------------------------------------------------------------- convert
def convert_command(argv: Sequence[str]) -> None:
    from mima.convert import convert_checkpoint
    from mima.safetensors_io import save_state_dict

    parser = _OneLineParser(
        prog="mima convert",
        description="Turn a pickled module checkpoint (task_vectors style) into a safetensors state dict, "
        "without running code from the file.",
    )
    parser.add_argument("source", type=Path, help="the pickled checkpoint (.pt)")
    parser.add_argument("output", type=Path, help="the safetensors file to write")
    parser.add_argument("--prefix", default="model.visual.",
                        help="keep the keys under this prefix, without it (default: model.visual., an ImageEncoder's "
                        "image tower); '' keeps every key")
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    options = parser.parse_args(argv)
    if options.output.exists() and not options.overwrite:
        raise MimaError(f"{options.output}: already exists (pass --overwrite to replace it)")
    state = convert_checkpoint(options.source, options.prefix)
    save_state_dict(options.output, state, metadata={"converted_from": str(options.source), "prefix": options.prefix},
                    overwrite=options.overwrite)
    print(f"mima convert: {len(state)} tensors from {options.source} -> {options.output}")


if __name__ == "__main__":
    sys.exit(main())
