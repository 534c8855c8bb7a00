"""The `mima` command line.

    mima demo  [--out DIR] [--iterations 1 2 4 8] [--steps 320] ...   the embedded default end to end
    mima fit   --config FILE [--out DIR] [--trainer.* ...] [--model.* ...]  one MIMA run (LightningCLI)
    mima plan  --config FILE [--trainer.devices W] [--trainer.num_nodes M] [--json]   what a run will cost
    mima prefetch --config FILE [--data.root DIR]   fetch a config's weights and datasets (login node)
    mima merge --method NAME [--base BASE] --models A B ... | RUN_DIR --output OUT [--select-on val] [--lam X] ...
    mima evaluate RUN_DIR [RUN_DIR ...] --out DIR [--merges uniform ties ...]   the Table-1 results of finished runs
    mima convert CHECKPOINT.pt OUT.safetensors [--prefix model.visual.]
    mima convert --from hf-clip HF_DIR_OR_FILE --output OUT.safetensors | --to hf-clip ENC.safetensors --output DIR
    mima data check --root DIR [--tasks A B ... | --benchmark 8|14|20] [--download]
    mima data cache --config FILE [--data.root DIR] [--workers N]   decode a config's tasks once (data.cache)
    mima data splits --config FILE --out DIR [--data.root DIR]   each task's train/val/test indices (JSON)
    mima data prepare --root DIR [--archives DIR] [--tasks A B ... | --benchmark 8|14|20] [--download] [--overwrite]
    mima analyze cosine|landscape|rank-sweep|ctl|gradients ...   why a merge works (plots + numbers)
    mima report DIR [--out DIR]                     one Markdown + HTML page for a run or a sweep

A user's mistake (a missing file, an unknown option value, incompatible checkpoints) is reported
as one line on stderr with exit status 2, and leaves no partial output behind.

Every parser is built from modules that import nothing heavy (mima.command_options, the
analyses' and convert's options modules, mima.merging.catalogue, mima.data.benchmarks), so that
`--help` and argument errors answer before torch, Lightning or open_clip are imported; a command
imports its module only once its options have parsed. `parse(command, argv)` parses a command line
without running it (tests/test_docs_commands.py checks every example of the documentation with it).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from mima.analysis import ANALYSES
from mima.command_options import DEMO_ITERATIONS, DEMO_MERGES, add_merge_arguments, add_report_arguments, device_spelling
from mima.config.defaults import AUTO
from mima.config.source import check_config_source
from mima.convert.options import add_arguments as add_convert_arguments
from mima.core.errors import MimaError
from mima.merging.catalogue import check_method_name

COMMANDS = {
    "demo": "run the embedded default end to end (pretrain, MIMA for several N, merge, evaluate)",
    "fit": "run one MIMA configuration (LightningCLI: --config FILE, --trainer.*, --model.*, --data.*)",
    "plan": "what a run will cost before it starts: tasks per process, utilisation, device and host memory, disk",
    "prefetch": "download what a config needs (open_clip weights, torchvision datasets) before running it offline",
    "merge": "merge fine-tuned state dicts (or a run folder) with a registered strategy",
    "evaluate": "merge and evaluate finished runs (one per N): the Table-1 results table and plots",
    "convert": "pickled checkpoint -> safetensors without running its code; transformers CLIP <-> open_clip (hf-clip)",
    "data": "data tools: `mima data check --root DIR` shows which benchmark tasks are ready and what is missing",
    "analyze": "analyses of a run's models: cosine, landscape, rank-sweep, ctl, gradients (mima analyze --help)",
    "report": "one Markdown and HTML page for a run or a sweep: results table, plots, analyses, checkpoints",
}
DATA_COMMANDS = {
    "check": "list, per task, the files and folders expected under --root and which are missing (exit 1 if any)",
    "cache": "decode, resize and crop a config's tasks once into uint8 files (what `data.cache: true` reads)",
    "splits": "write each task's train/val/test example indices (JSON, one file per task) to audit or share them",
    "prepare": "lay out the publishers' downloaded archives (DTD, EuroSAT, RESISC45, SUN397, Cars, FER2013) under --root",
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
    if command != "fit":  # fit saves and stops at a step boundary on SIGTERM (preemption) instead
        signal.signal(signal.SIGTERM, _raise_terminated)
    # a file size limit (ulimit -f, RLIMIT_FSIZE) then fails the write with EFBIG, reported below,
    # instead of killing the process mid-write
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        if command == "demo":
            demo_command(rest)
        elif command == "fit":
            return fit_command(rest)
        elif command == "plan":
            plan_command(rest)
        elif command == "prefetch":
            prefetch_command(rest)
        elif command == "merge":
            merge_command(rest)
        elif command == "convert":
            convert_command(rest)
        elif command == "evaluate":
            evaluate_command(rest)
        elif command == "data":
            return data_command(rest)
        elif command == "analyze":
            analyze_command(rest)
        elif command == "report":
            report_command(rest)
        else:
            raise MimaError(f"unknown command '{command}' (commands: {', '.join(COMMANDS)})")
    except (KeyboardInterrupt, _Terminated) as stop:
        # Ctrl-C or SIGTERM: unwinding runs the clean-up of mima.core.files.atomic_path, so the
        # temporary file of an output being written is removed and nothing is half written
        terminated = isinstance(stop, _Terminated)
        print(f"mima {command}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
    except MimaError as exc:
        # name the subcommand too (`mima analyze landscape: error: ...`), unless it is the mistake itself
        label = f"{command} {rest[0]}" if command in ("analyze", "data") and rest and not rest[0].startswith("-") else command
        print(f"mima {label}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"mima {command}: error: {os_error_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:
        if not _terminations:
            line = storage_error_line(exc)
            if line is None:
                raise
            print(f"mima {command}: error: {line}", file=sys.stderr)
            return 2
        # SIGTERM arrived inside a library call (e.g. safetensors reading a tensor), which reported
        # the interruption as an error of its own: still a termination, and it unwound the same way
        print(f"mima {command}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    return 0


OS_ERROR_HINTS = {
    errno.ENOSPC: "free space there or write elsewhere",
    errno.EDQUOT: "free space in your quota or write elsewhere",
    errno.EFBIG: "the file size limit (ulimit -f) is too small for it",
    errno.EROFS: "the filesystem is read-only; write elsewhere (e.g. --out)",
    errno.EACCES: "check its permissions, or write elsewhere",
    errno.EPERM: "check its permissions, or write elsewhere",
    errno.ENOENT: "check the path",
}


def os_error_line(exc: OSError) -> str:
    """An operating-system error as one line: the path, what went wrong, what to do."""
    where = f"{exc.filename}: " if exc.filename else ""
    hint = OS_ERROR_HINTS.get(exc.errno)
    return f"{where}{exc.strerror or exc}" + (f" ({hint})" if hint else "")


def storage_error_line(exc: Exception) -> str | None:
    """A library's wrapping of a full or unwritable disk (safetensors reports it as its own error
    type with the OS message inside) as one line; None for anything else."""
    text = str(exc)
    for code, hint in OS_ERROR_HINTS.items():
        message = os.strerror(code)
        if message in text:
            return f"{message} ({hint}) [{type(exc).__name__}]"
    return None


def one_line(error: MimaError) -> str:
    """The error's message. Raised in a DataLoader worker, it comes back wrapped in the worker's
    traceback ("Caught MimaError in DataLoader worker process 0. Original Traceback ..."); its
    last line holds the message."""
    text = str(error).strip()
    if "Original Traceback" not in text:
        return text
    last = text.splitlines()[-1]
    return last.split(f"{MimaError.__name__}: ", 1)[-1]


class _Terminated(BaseException):
    """SIGTERM, raised where the program is, so that `finally` blocks run (Python's default just exits)."""


_terminations: list[int] = []  # SIGTERMs this process has received


def _raise_terminated(signum, frame) -> None:
    _terminations.append(signum)
    raise _Terminated()


def _usage() -> str:
    lines = ["usage: mima COMMAND [options]   (mima COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<8} {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def parse(command: str, argv: Sequence[str]):
    """The options of `mima COMMAND ARGV...`, parsed and checked as the command parses them, without
    running it; for `data` and `analyze` the subcommand is argv[0]. No file is opened (a --config may
    be a placeholder), except by `fit`, whose LightningCLI parser reads its --config files (and which
    imports Lightning). A mistake raises MimaError (one line); --help prints and exits (SystemExit)."""
    if command == "fit":
        from mima.training.trainer import parse_fit

        return parse_fit(list(argv))
    if command == "data":
        return _data_options(argv)
    if command == "analyze":
        return _analysis_options(argv[0] if argv else "", argv[1:])
    if command not in _OPTIONS:
        raise MimaError(f"unknown command '{command}' (commands: {', '.join(COMMANDS)})")
    return _OPTIONS[command](argv)


# -------------------------------------------------------------------------------- fit
def fit_command(argv: Sequence[str]) -> int:
    """Exit status: 0 when the run finished; 128 + the signal number when a signal stopped it after
    saving a checkpoint (on the process that was started; the others exit 0 so that launchers do not
    tear the job down before it has saved)."""
    _check_fit_config_files(argv)  # before Lightning is imported: a typo answers at once
    from mima.training.trainer import launch_rank, run_fit

    result = run_fit(argv)
    if result.preempted_by and launch_rank() == 0:
        return 128 + result.preempted_by
    return 0


def _check_fit_config_files(argv: Sequence[str]) -> None:
    """Refuse a `--config FILE` (or -c FILE, --config=FILE) that does not exist. A value that holds
    YAML itself (jsonargparse takes that too) is left to the parser."""
    for index, word in enumerate(argv):
        if word in ("--config", "-c") and index + 1 < len(argv):
            value = argv[index + 1]
        elif word.startswith("--config="):
            value = word.split("=", 1)[1]
        else:
            continue
        holds_yaml = any(mark in value for mark in ("{", "\n", ": "))
        if not holds_yaml and not Path(value).exists():
            raise MimaError(f"--config {value}: no such file")


# ------------------------------------------------------------------------------- plan
def _plan_options(argv: Sequence[str]) -> argparse.Namespace:
    parser = _OneLineParser(
        prog="mima plan",
        description="Print what `mima fit` with this config would cost, before anything runs: each process's tasks and "
        "the share of time spent waiting at syncs (with the W values that waste less), device memory per process "
        "(weights, gradients, AdamW moments, the phase average, activations traced from the model on the meta "
        "device), host memory per process and per node, the size of each checkpoint file, the bytes written over the "
        "run, the peak on disk and the sync volume; and the defaults it chooses for the run (model.grad_checkpointing, "
        "--checkpoint_every, a loader warning, the SLURM --signal lead), from a step time estimated on a GPU. No "
        "weights or data are read. `mima fit` prints the same at start.",
    )
    parser.add_argument("--config", type=Path, required=True, help="the `mima fit` config file (or a run folder)")
    parser.add_argument("--trainer.devices", dest="devices", type=int, default=None,
                        help="processes per node (default: the config's trainer.devices)")
    parser.add_argument("--trainer.num_nodes", dest="num_nodes", type=int, default=None,
                        help="nodes (default: the config's trainer.num_nodes or 1)")
    parser.add_argument("--data.benchmark", dest="benchmark", choices=("8", "14", "20"), default=None,
                        help="plan for a clip-suite benchmark's task list instead of the config's")
    parser.add_argument("--data.batch_size", dest="batch_size", type=int, default=None, help="instead of the config's")
    parser.add_argument("--model.iterations", dest="iterations", type=int, default=None, help="N, instead of the config's")
    parser.add_argument("--checkpoint_every", default=None,
                        help="as `mima fit --checkpoint_every` (default: the config's, else auto: by time on a GPU, "
                        "every segment on the CPU)")
    parser.add_argument("--device-memory", dest="device_memory", type=float, default=None, metavar="GIB",
                        help="the memory of one device in GiB (default: the GPU present, or this machine's for the CPU); "
                        "the plan says whether the run fits it")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object (bytes as integers)")
    options = parser.parse_args(argv)
    for name in ("devices", "num_nodes", "batch_size", "iterations"):
        value = getattr(options, name)
        if value is not None and value < 1:
            flag = {"devices": "--trainer.devices", "num_nodes": "--trainer.num_nodes", "batch_size": "--data.batch_size",
                    "iterations": "--model.iterations"}[name]
            parser.error(f"{flag} {value}: expected a positive number")
    if options.device_memory is not None and not options.device_memory > 0:
        parser.error(f"--device-memory {options.device_memory}: expected a positive number of GiB")
    return options


def plan_command(argv: Sequence[str]) -> None:
    options = _plan_options(argv)
    check_config_source(options.config)
    import json

    import mima.training.trainer  # noqa: F401  (the fit stack: its import is part of a process's host memory)
    from mima.config.run_config import load_run_config
    from mima.training.resource_plan import format_plan, plan_for_config
    from mima.training.checkpoint_callback import SaveSchedule

    config = load_run_config(options.config)
    checkpoint_every = options.checkpoint_every if options.checkpoint_every is not None else config.other.get("checkpoint_every")
    if checkpoint_every is not None and str(checkpoint_every).strip().lower() != AUTO:
        SaveSchedule.parse(checkpoint_every)
    if options.benchmark is not None:
        config.data.benchmark, config.data.tasks = options.benchmark, None
    if options.batch_size is not None:
        config.data.batch_size = options.batch_size
    if options.iterations is not None:
        config.model.iterations = options.iterations
    trainer = dict(config.other.get("trainer") or {})
    devices = options.devices if options.devices is not None else trainer.get("devices", 1)
    nodes = options.num_nodes if options.num_nodes is not None else trainer.get("num_nodes", 1)
    if not str(devices).isdigit() or not str(nodes).isdigit():
        raise MimaError(f"trainer.devices={devices!r}, trainer.num_nodes={nodes!r}: give numbers "
                        "(--trainer.devices W --trainer.num_nodes M) to plan for")
    memory = int(options.device_memory * 2**30) if options.device_memory is not None else None
    plan, footprint, inputs = plan_for_config(config, int(devices) * int(nodes), int(nodes), checkpoint_every, memory)
    if options.json:
        print(json.dumps(plan.as_json(), indent=1))
    else:
        print(format_plan(plan, footprint, inputs))


# --------------------------------------------------------------------------- prefetch
def _prefetch_options(argv: Sequence[str]) -> argparse.Namespace:
    parser = _OneLineParser(
        prog="mima prefetch",
        description="Fetch what a `mima fit` config needs from the network: the open_clip weights of "
        "model.clip + model.pretrained (into open_clip's cache under $HF_HOME) and the tasks torchvision can "
        "download (into data.root). Run it where there is internet (the login node); the compute nodes then "
        "run offline (HF_HUB_OFFLINE=1).",
    )
    _add_config_arguments(parser)
    parser.add_argument("--weights-dir", type=Path, default=None,
                        help="also copy the weights to DIR/<architecture>-<tag>.<ext> with a record of their activation "
                        "beside them, for configs that name a weight file (model.pretrained) on nodes without the cache")
    return parser.parse_args(argv)


def prefetch_command(argv: Sequence[str]) -> None:
    options = _prefetch_options(argv)
    config = _config_with_root(options)
    from mima.prefetch import prefetch

    prefetch(config, say=lambda line: print(f"mima prefetch: {line}", flush=True), weights_dir=options.weights_dir)


def _add_config_arguments(parser) -> None:
    """--config and --data.root, for commands that act on what a `mima fit` config needs."""
    parser.add_argument("--config", type=Path, required=True, help="the `mima fit` config file (or a run folder)")
    parser.add_argument("--data.root", dest="data_root", type=Path,
                        help="the data root, when the config leaves it to the command line (as configs/clip/*.yaml do)")


def _config_with_root(options):
    check_config_source(options.config)  # before the config machinery (and torch) is imported
    from mima.config.run_config import load_run_config

    config = load_run_config(options.config)
    if options.data_root is not None:
        config.data.root = str(options.data_root)
    return config


# ------------------------------------------------------------------------------- demo
def _demo_options(argv: Sequence[str]) -> argparse.Namespace:
    parser = _OneLineParser(prog="mima demo", description="MIMA on the embedded digits tasks (configs/demo.yaml), end to end.")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder (default: runs/demo)")
    parser.add_argument("--iterations", type=int, nargs="+", default=list(DEMO_ITERATIONS), help="values of N")
    parser.add_argument("--steps", type=int, help="S, steps per task (each N must divide it; default: configs/demo.yaml's 320); "
                        "the warm-up follows at 10%% of S")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), help="default: configs/demo.yaml's (constant)")
    parser.add_argument(
        "--no-select", action="store_true", help="use the papers' fixed merge hyperparameters instead of validation"
    )
    parser.add_argument("--merges", nargs="+", default=list(DEMO_MERGES),
                        help=f"data-free merge strategies to compare (default: {' '.join(DEMO_MERGES)})")
    parser.add_argument("--no-joint", action="store_true",
                        help="skip the joint multi-task baseline (one model trained on all tasks, same S)")
    parser.add_argument("--overwrite", action="store_true", help="replace results and runs already in --out (without it, runs already there resume, finished ones are kept)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return parser.parse_args(argv)


def demo_command(argv: Sequence[str]) -> None:
    options = _demo_options(argv)
    from mima.core.plan import check_budget
    from mima.demo import demo_config, run_demo

    steps = options.steps if options.steps is not None else int(demo_config()["model"]["steps"])
    for n in options.iterations:
        check_budget(steps, n, names=("--steps", "--iterations"))
    run_demo(
        options.out,
        iterations=options.iterations,
        steps=options.steps,
        lr_schedule=options.lr_schedule,
        select_on_val=not options.no_select,
        overwrite=options.overwrite,
        progress=not options.no_progress,
        merges=options.merges,
        joint=not options.no_joint,
    )


# ------------------------------------------------------------------------------ merge
def _merge_options(argv: Sequence[str]) -> argparse.Namespace:
    parser = _OneLineParser(prog="mima merge", description="Merge fine-tuned image-encoder state dicts.")
    add_merge_arguments(parser)
    options = parser.parse_args(argv)
    check_method_name(options.method)
    return options


def merge_command(argv: Sequence[str]) -> None:
    options = _merge_options(argv)
    if options.config is not None:
        check_config_source(options.config)  # a missing --config answers before the inputs load torch
    from mima.merge_command import run_merge

    run_merge(options)


# --------------------------------------------------------------------------- evaluate
def _evaluate_options(argv: Sequence[str]) -> argparse.Namespace:
    parser = _OneLineParser(
        prog="mima evaluate",
        description="Evaluate finished `mima fit` runs of the same tasks (typically one per N, or one per N and seed): "
        "theta_0, each task model, and each merge with hyperparameters chosen on the validation splits; writes "
        "results.json/.csv/.md, selection.json and plots. Runs at one N that differ only in the seed also get rows "
        "with the mean and standard deviation over the seeds. Every result is recorded in --out/cells/ as soon as it "
        "is known: after a stop (SIGTERM, SIGUSR1, a crash) the same command goes on where it stopped.",
    )
    parser.add_argument("runs", type=Path, nargs="+",
                        help="`mima fit` run folders (one per N and seed; at most one joint run, model.mode: joint, adds a "
                        "`joint` row)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the results table, plots and cells")
    parser.add_argument("--merges", nargs="+", default=list(DEMO_MERGES), help="data-free merge strategies to compare")
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
    options = parser.parse_args(argv)
    if options.val_examples is not None and options.val_examples <= 0:
        parser.error(f"--val-examples {options.val_examples}: expected a positive number of examples per task")
    if options.num_workers is not None and options.num_workers < 0:
        parser.error(f"--num-workers {options.num_workers}: expected 0 or more loader worker processes")
    return options


def evaluate_command(argv: Sequence[str]) -> None:
    options = _evaluate_options(argv)
    from mima.evaluate_runs import evaluate_runs, team_for

    team = team_for(options.devices, argv)
    with no_empty_folder_left(options.out):
        evaluate_runs(options.runs, options.out, options.merges, not options.no_select, options.overwrite,
                      precision=options.precision, val_examples=options.val_examples, team=team,
                      skip_unfinished=options.skip_unfinished, num_workers=options.num_workers,
                      merge_device=options.merge_device)


# ---------------------------------------------------------------------------- convert
def _convert_options(argv: Sequence[str]) -> argparse.Namespace:
    parser = _OneLineParser(
        prog="mima convert",
        description="Turn a pickled module checkpoint (task_vectors style) into a safetensors state dict, without\n"
        "running code from the file; or convert between open_clip image encoders and Hugging Face transformers\n"
        "CLIP vision towers (--from hf-clip, --to hf-clip) by renaming tensors (no transformers needed).",
        epilog="examples:\n  mima convert finetuned.pt finetuned.safetensors\n"
        "  mima convert --from hf-clip clip-vit-base-patch32/ --output base.safetensors\n"
        "  mima convert --from hf-clip clip-vit-base-patch32_svhn/ --projection-from clip-vit-base-patch32/ --output svhn.safetensors\n"
        "  mima convert --to hf-clip merged.safetensors --activation quick_gelu --output merged-hf/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_convert_arguments(parser)
    return parser.parse_args(argv)


def convert_command(argv: Sequence[str]) -> None:
    options = _convert_options(argv)
    from mima.convert.command import main

    main(options)


# ------------------------------------------------------------------------------- data
def data_command(argv: Sequence[str]) -> int:
    """Exit status of `mima data check`: 0 when every checked task is found, 1 otherwise."""
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mima data SUBCOMMAND [options]\n\nsubcommands:")
        print("\n".join(f"  {name:<7} {text}" for name, text in DATA_COMMANDS.items()))
        return 0
    if argv[0] == "cache":
        cache_command(argv[1:])
        return 0
    if argv[0] == "splits":
        splits_command(argv[1:])
        return 0
    if argv[0] == "prepare":
        return prepare_command(argv[1:])
    if argv[0] != "check":
        raise MimaError(f"unknown data subcommand '{argv[0]}' (subcommands: {', '.join(DATA_COMMANDS)})")
    options = _data_check_options(argv[1:])
    from mima.data.check import run_check, select_tasks

    return run_check(options.root, select_tasks(options.tasks, options.benchmark), download=options.download)


def _data_options(argv: Sequence[str]) -> argparse.Namespace:
    """The options of `mima data SUBCOMMAND ...` (for `parse`)."""
    subcommands = {"check": _data_check_options, "cache": _data_cache_options, "splits": _data_splits_options,
                   "prepare": _data_prepare_options}
    if not argv or argv[0] not in subcommands:
        name = argv[0] if argv else ""
        raise MimaError(f"unknown data subcommand '{name}' (subcommands: {', '.join(DATA_COMMANDS)})")
    return subcommands[argv[0]](argv[1:])


def _data_check_options(argv: Sequence[str]) -> argparse.Namespace:
    parser = _OneLineParser(
        prog="mima data check",
        description="Check the files of the clip suite's benchmark tasks under a data root (names on disk only, "
        "nothing is opened). Exit status 0 when every checked task is found, 1 otherwise.",
    )
    _add_root_and_tasks(parser, "check")
    parser.add_argument("--download", action="store_true",
                        help="first let torchvision download the checked tasks it can (needs internet)")
    return parser.parse_args(argv)


def _data_cache_options(argv: Sequence[str]) -> argparse.Namespace:
    parser = _OneLineParser(
        prog="mima data cache",
        description="Build the decoded-image cache of a `mima fit` config's tasks (mima.data.cache_store): each split "
        "decoded once through the model's evaluation transform (resize, centre crop) and stored as uint8, where "
        "data.cache_dir says (default $MIMA_CACHE_DIR/data). Stale or missing splits are rebuilt, others kept. "
        "`mima fit` with data.cache: true builds what is missing itself.",
    )
    _add_config_arguments(parser)
    parser.add_argument("--workers", type=int, default=None, help="decoding processes (default: data.num_workers or up to 4)")
    return parser.parse_args(argv)


def cache_command(argv: Sequence[str]) -> None:
    options = _data_cache_options(argv)
    config = _config_with_root(options)
    from mima.models.clip import default_cache_dir, load_clip

    if options.workers is not None:
        if options.workers < 0:
            raise MimaError(f"--workers must be >= 0, got {options.workers}")
        config.data.num_workers = options.workers
    model = config.model
    loaded = load_clip(model.clip, model.pretrained, cache_dir=Path(model.cache_dir) if model.cache_dir else default_cache_dir(),
                       quick_gelu=model.quick_gelu)
    data = config.datamodule()
    for task in data.build_cache(loaded.image_size, loaded.preprocess):
        sizes = ", ".join(f"{split} {len(cached)}" for split, cached in task.splits.items())
        print(f"mima data cache: {task.name}: {sizes} images ({'augmented' if task.augment else 'not augmented'} in training)")
    print(f"mima data cache: in {data.cache_folder}")


def _data_splits_options(argv: Sequence[str]) -> argparse.Namespace:
    parser = _OneLineParser(
        prog="mima data splits",
        description="Write, for each task of a `mima fit` config, the example indices of its train, val and test "
        "splits to OUT/<task>.json: indices into the dataset each split is read from (`from`: the task's training "
        "split, a validation split it ships, or its test split), in the order torchvision or the folder listing "
        "gives them. Validation is carved as task_vectors carves it (random_split, manual_seed(data.split_seed), "
        "the permutation's tail, 10%% of the training split, at most 5000). Nothing is decoded.",
    )
    _add_config_arguments(parser)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON files (one per task)")
    parser.add_argument("--overwrite", action="store_true", help="replace split files already in --out")
    return parser.parse_args(argv)


def splits_command(argv: Sequence[str]) -> None:
    options = _data_splits_options(argv)
    config = _config_with_root(options)
    from mima.core.files import refuse_overwrite
    from mima.data.splits import task_split_record, write_split_file

    data = config.datamodule()
    seed = int(config.data.split_seed)
    if not options.overwrite:  # before any work: an earlier audit file is the user's
        refuse_overwrite([options.out / f"{spec.name}.json" for spec in data.task_specs], what=f"--out {options.out}")
    with no_empty_folder_left(options.out):
        records = [task_split_record(spec, config.data.root, seed) for spec in data.task_specs]
        options.out.mkdir(parents=True, exist_ok=True)
        for record in records:
            path = write_split_file(record, options.out)
            sizes = ", ".join(f"{split} {record[split]['size']} (of {record[split]['from']})" for split in ("train", "val", "test"))
            print(f"mima data splits: {record['task']}: {sizes} -> {path}")


def _add_root_and_tasks(parser: argparse.ArgumentParser, verb: str) -> None:
    """--root and the task selection of `mima data check` and `mima data prepare`."""
    from mima.data.benchmarks import BENCHMARKS  # here: a merge or a fit has no use for the data package

    parser.add_argument("--root", type=Path, required=True, help="the data root (data.root of a fit config)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--tasks", nargs="+", metavar="TASK", help=f"tasks to {verb} (default: all tasks of the clip suite)")
    which.add_argument("--benchmark", choices=tuple(BENCHMARKS), help=f"{verb} the 8-, 14- or 20-task benchmark")


def _data_prepare_options(argv: Sequence[str]) -> argparse.Namespace:
    parser = _OneLineParser(
        prog="mima data prepare",
        description="Lay out the clip suite's tasks under --root from the archives their publishers distribute, "
        "with task_vectors' splits (README, 'Real tasks'). One line per task: prepared (with its split sizes), already "
        "there, or what is missing and where to get it. Exit status 0 when every task is ready, 1 otherwise.",
    )
    _add_root_and_tasks(parser, "prepare")
    parser.add_argument("--archives", type=Path, default=None, help="the folder holding the downloaded archives (default: --root)")
    parser.add_argument("--download", action="store_true", help="first fetch what torchvision's downloader can (needs internet)")
    parser.add_argument("--overwrite", action="store_true", help="prepare again tasks whose folder is already there")
    return parser.parse_args(argv)


def prepare_command(argv: Sequence[str]) -> int:
    options = _data_prepare_options(argv)
    from mima.data.check import select_tasks
    from mima.data.prepare import run_prepare, validate_arguments

    root = options.root.expanduser()
    archives = (options.archives or options.root).expanduser()
    names = select_tasks(options.tasks, options.benchmark)
    validate_arguments(root, archives, options.download, "--archives" if options.archives else "--root")
    return run_prepare(root, archives, names, download=options.download, overwrite=options.overwrite,
                       progress=lambda line: print(line, file=sys.stderr, flush=True))


# ---------------------------------------------------------------------------- analyze
def analyze_command(argv: Sequence[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mima analyze ANALYSIS [options]   (mima analyze ANALYSIS --help)\n\nanalyses:")
        print("\n".join(f"  {name:<10} {text}" for name, (_, text) in ANALYSES.items()))
        return
    options = _analysis_options(argv[0], argv[1:])
    if getattr(options, "config", None) is not None:
        check_config_source(options.config)  # before the analysis loads torch
    package, _ = ANALYSES[argv[0]]
    command = importlib.import_module(f"{package}.command")
    from mima.analysis.common import staged_outputs

    with no_empty_folder_left(getattr(options, "out", None)), staged_outputs():
        command.main(options)


def _analysis_options(name: str, argv: Sequence[str]) -> argparse.Namespace:
    if name not in ANALYSES:
        raise MimaError(f"unknown analysis '{name}' (analyses: {', '.join(ANALYSES)})")
    package, description = ANALYSES[name]
    parser = _OneLineParser(prog=f"mima analyze {name}", description=description)
    importlib.import_module(f"{package}.options").add_arguments(parser)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- report
def _report_options(argv: Sequence[str]) -> argparse.Namespace:
    parser = _OneLineParser(
        prog="mima report",
        description="Write one page (report.md and a self-contained report.html) for a `mima fit` run folder or a "
        "sweep folder (`mima demo`, `mima evaluate --out`): the Table-1 results, alignment and accuracy plots, "
        "the analyses found under analysis/, and links to the checkpoints.",
    )
    add_report_arguments(parser)
    return parser.parse_args(argv)


def report_command(argv: Sequence[str]) -> None:
    options = _report_options(argv)
    from mima.report import main

    with no_empty_folder_left(options.out):
        main(options)


# the parse step of each command without subcommands (`parse`); fit's is LightningCLI's
_OPTIONS = {"demo": _demo_options, "plan": _plan_options, "prefetch": _prefetch_options, "merge": _merge_options, "evaluate": _evaluate_options,
            "convert": _convert_options, "report": _report_options}


@contextlib.contextmanager
def no_empty_folder_left(folder: Path | None):
    """A command that fails (a mistake found late, a signal) leaves no empty --out folder behind,
    nor the empty parents it created for it; a folder that existed before, or holds files, stays."""
    if folder is None:
        yield
        return
    folder = Path(folder)
    created = [path for path in (folder, *folder.parents) if not path.exists() and not path.is_symlink()]
    try:
        yield
    except BaseException:
        for path in created:  # the deepest first
            try:
                path.rmdir()  # only an empty folder goes
            except OSError:
                break
        raise


if __name__ == "__main__":
    sys.exit(main())
