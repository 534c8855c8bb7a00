"""The commands of `mima`, one module each: `parse(argv)` checks a command line and returns its options
without running anything; `main(argv)` runs it (exit status, or None for 0).

COMMANDS is the one list of them: `mima --help`, the dispatch and `parse` in mima.cli all read it.
A command's module imports nothing heavy at module level (torch, Lightning, open_clip load inside
`main`, once the options have parsed), so that `--help` and argument errors answer at once. What a
command runs that the Python API (mima.api) runs too is a program of mima.services, below both
fronts; only mima.cli (and `python -m mima`) imports this package.
"""

from __future__ import annotations

from dataclasses import dataclass

from mima.core.errors import MimaError


@dataclass(frozen=True)
class Command:
    """One command (or `mima data` subcommand) of the table."""

    name: str  # as typed after `mima`
    summary: str  # one line for the usage text
    module: str  # the module holding its parse(argv) and main(argv)
    subcommands: bool = False  # argv[0] names a subcommand (`mima data check`), named in its error lines too
    handles_sigterm: bool = False  # the command saves and stops on SIGTERM itself (fit: at a step boundary)


COMMANDS: tuple[Command, ...] = (
    Command("demo", "run the embedded default end to end (pretrain, MIMA for several N, merge, evaluate)", "mima.commands.demo"),
    Command("fit", "run one MIMA configuration (LightningCLI: --config FILE, --trainer.*, --model.*, --data.*)",
            "mima.commands.fit", handles_sigterm=True),
    Command("plan", "what a run will cost before it starts: tasks per process, utilisation, device and host memory, disk",
            "mima.commands.plan"),
    Command("prefetch", "download what a config needs (open_clip weights, torchvision datasets) before running it offline",
            "mima.commands.prefetch"),
    Command("merge", "merge fine-tuned state dicts (or a run folder) with a registered strategy", "mima.commands.merge"),
    Command("evaluate", "merge and evaluate finished runs (one per N): the Table-1 results table and plots",
            "mima.commands.evaluate"),
    Command("convert", "pickled checkpoint -> safetensors without running its code; transformers CLIP <-> open_clip (hf-clip)",
            "mima.commands.convert"),
    Command("data", "data tools: `mima data check --root DIR` shows which benchmark tasks are ready and what is missing",
            "mima.commands.data", subcommands=True),
    Command("analyze", "analyses of a run's models: cosine, landscape, rank-sweep, ctl, gradients (mima analyze --help)",
            "mima.commands.analyze", subcommands=True),
    Command("report", "one Markdown and HTML page for a run or a sweep: results table, plots, analyses, checkpoints",
            "mima.commands.report"),
)

DATA_COMMANDS: tuple[Command, ...] = (
    Command("check", "list, per task, the files and folders expected under --root and which are missing (exit 1 if any)",
            "mima.commands.data.check"),
    Command("cache", "decode, resize and crop a config's tasks once into uint8 files (what `data.cache: true` reads)",
            "mima.commands.data.cache"),
    Command("splits", "write each task's train/val/test example indices (JSON, one file per task) to audit or share them",
            "mima.commands.data.splits"),
    Command("prepare", "lay out the publishers' downloaded archives (DTD, EuroSAT, RESISC45, SUN397, Cars, FER2013) under --root",
            "mima.commands.data.prepare"),
)


def names(table: tuple[Command, ...]) -> tuple[str, ...]:
    return tuple(command.name for command in table)


def find(table: tuple[Command, ...], name: str, what: str) -> Command:
    """The table's entry called NAME; otherwise a one-line error listing the known names
    ("unknown command 'x' (commands: demo, fit, ...)", WHAT being "command")."""
    for command in table:
        if command.name == name:
            return command
    raise MimaError(f"unknown {what} '{name}' ({what.split()[-1]}s: {', '.join(names(table))})")
