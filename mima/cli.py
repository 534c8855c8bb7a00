"""The `mima` command line: it only parses and dispatches; each command lives in mima/commands/.

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

mima.commands.COMMANDS lists the commands and the module of each; a command's module imports nothing
heavy at module level, so that `--help` and argument errors answer before torch, Lightning or
open_clip are imported, and it is imported only when its command runs. `parse(command, argv)` parses
a command line without running it (tests/docs/test_docs_commands.py checks every example of the
documentation with it).
"""

from __future__ import annotations

import importlib
import signal
import sys
from collections.abc import Sequence
from types import ModuleType

from mima.commands import COMMANDS, DATA_COMMANDS, Command, find
from mima.commands.common import capped, one_line, os_error_line, storage_error_line
from mima.core.errors import MimaError

__all__ = ["COMMANDS", "DATA_COMMANDS", "main", "parse"]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    known = next((command for command in COMMANDS if command.name == name), None)
    if known is None or not known.handles_sigterm:  # fit saves and stops at a step boundary on SIGTERM instead
        signal.signal(signal.SIGTERM, _raise_terminated)
    # a file size limit (ulimit -f, RLIMIT_FSIZE) then fails the write with EFBIG, reported below,
    # instead of killing the process mid-write
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        status = _module(find(COMMANDS, name, "command")).main(rest)
    except (KeyboardInterrupt, _Terminated) as stop:
        # Ctrl-C or SIGTERM: unwinding runs the clean-up of mima.core.files.atomic_path, so the
        # temporary file of an output being written is removed and nothing is half written
        terminated = isinstance(stop, _Terminated)
        print(f"mima {name}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
    except MimaError as exc:
        # name the subcommand too (`mima analyze landscape: error: ...`), unless it is the mistake itself
        label = f"{name} {rest[0]}" if known is not None and known.subcommands and rest and not rest[0].startswith("-") else name
        print(f"mima {label}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"mima {name}: error: {capped(os_error_line(exc))}", file=sys.stderr)
        return 2
    except Exception as exc:
        if not _terminations:
            line = storage_error_line(exc)
            if line is None:
                raise
            print(f"mima {name}: error: {capped(line)}", file=sys.stderr)
            return 2
        # SIGTERM arrived inside a library call (e.g. safetensors reading a tensor), which reported
        # the interruption as an error of its own: still a termination, and it unwound the same way
        print(f"mima {name}: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    return status or 0


def parse(command: str, argv: Sequence[str]):
    """The options of `mima COMMAND ARGV...`, parsed and checked as the command parses them, without
    running it; for `data` and `analyze` the subcommand is argv[0]. No file is opened (a --config may
    be a placeholder), except by `fit`, whose LightningCLI parser reads its --config files (and which
    imports Lightning). A mistake raises MimaError (one line); --help prints and exits (SystemExit)."""
    return _module(find(COMMANDS, command, "command")).parse(argv)


def _module(command: Command) -> ModuleType:
    return importlib.import_module(command.module)


class _Terminated(BaseException):
    """SIGTERM, raised where the program is, so that `finally` blocks run (Python's default just exits)."""


_terminations: list[int] = []  # SIGTERMs this process has received


def _raise_terminated(signum, frame) -> None:
    _terminations.append(signum)
    raise _Terminated()


def _usage() -> str:
    lines = ["usage: mima COMMAND [options]   (mima COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {command.name:<8} {command.summary}" for command in COMMANDS]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
