"""What several commands share: the one-line argument parser, the --config/--data.root arguments and
the config they load, the one-line forms of operating-system errors and the spelling of a device as
an argument type. Imports nothing heavy (the config machinery loads on use). (The clean-up of an
--out folder a failed command created, which the services use too: mima.core.folders.)
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import itertools
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

from mima.config.source import check_config_source
from mima.core.errors import MimaError
from mima.core.spelling import check_device_spelling, suggest_option  # suggest_option: the parser's (and fit's)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line naming the option (not the whole usage text), and an
    unknown long option is refused before anything else is checked, with the nearest known one
    ("unrecognized option --methd; did you mean --method?"): argparse would first name the required
    options the typo left out. The options are recorded as they are added (argparse keeps them only
    in private attributes), also those added through a group."""

    def __init__(self, *args, **kwargs) -> None:
        self.long_options: list[str] = []  # every --option added, in order
        self.help_options: set[str] = set()  # those that print the help (--help asks for help, not a check)
        self.has_subcommands = False  # a subcommand's own parser checks its options
        super().__init__(*args, **kwargs)  # adds -h/--help through add_argument

    def error(self, message: str):  # type: ignore[override]
        raise MimaError(f"{message} (see {self.prog} --help)")

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.record_options(action, kwargs)
        return action

    def add_argument_group(self, *args, **kwargs):
        return self.recording(super().add_argument_group(*args, **kwargs))

    def add_mutually_exclusive_group(self, **kwargs):
        return self.recording(super().add_mutually_exclusive_group(**kwargs))

    def add_subparsers(self, **kwargs):
        self.has_subcommands = True
        return super().add_subparsers(**kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if not self.has_subcommands:
            self.refuse_unknown_options(sys.argv[1:] if args is None else list(args))
        return super().parse_known_args(args, namespace)

    def record_options(self, action: argparse.Action, kwargs: dict) -> None:
        names = [name for name in action.option_strings if name.startswith("--")]
        self.long_options += names
        if kwargs.get("action") == "help":
            self.help_options.update(action.option_strings)

    def recording(self, group):
        """GROUP (an argument group or a mutually exclusive one), its add_argument recording the options
        it adds here too, as do the groups made from it."""
        add_argument, add_exclusive = group.add_argument, group.add_mutually_exclusive_group

        def recorded_add_argument(*args, **kwargs) -> argparse.Action:
            action = add_argument(*args, **kwargs)
            self.record_options(action, kwargs)
            return action

        group.add_argument = recorded_add_argument
        group.add_mutually_exclusive_group = lambda **kwargs: self.recording(add_exclusive(**kwargs))
        return group

    def refuse_unknown_options(self, tokens: Sequence[str]) -> None:
        """One line for the first --option of TOKENS (up to a bare --) that is neither known nor the
        abbreviation argparse accepts (the start of some known option; the start of several stays
        argparse's "ambiguous option"); none when help is asked for, as argparse prints it then."""
        options = [token.split("=", 1)[0] for token in itertools.takewhile(lambda token: token != "--", tokens)
                   if token.startswith("-")]  # a negative number too: it names no option
        if any(self.resolved(name) & self.help_options for name in options):
            return
        for name in (name for name in options if name.startswith("--")):
            if not any(option.startswith(name) for option in self.long_options):  # a known one starts with itself
                suggestion = suggest_option(name, self.long_options)
                self.error(f"unrecognized option {name}" + (f"; did you mean {suggestion}?" if suggestion else ""))

    def resolved(self, name: str) -> set[str]:
        """The option NAME stands for: itself when known, else the one option it abbreviates (none when
        it starts none, or several)."""
        if name in self.long_options or name in self.help_options:
            return {name}
        if not name.startswith("--"):
            return set()
        starting = {option for option in self.long_options if option.startswith(name)}
        return starting if len(starting) == 1 else set()


Options = TypeVar("Options")


def frozen_options(kind: type[Options], parsed: argparse.Namespace) -> Options:
    """The parsed options as KIND, a frozen dataclass whose fields are the parser's destinations
    (a list argparse collected becomes a tuple, so that the options cannot change once checked)."""
    values = vars(parsed)
    fields = {field.name for field in dataclasses.fields(kind)}
    if fields != set(values):  # a programming error: the dataclass and the parser disagree
        raise TypeError(f"{kind.__name__}: fields {sorted(fields)} != parsed options {sorted(values)}")
    return kind(**{name: tuple(value) if isinstance(value, list) else value for name, value in values.items()})


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--config and --data.root, for commands that act on what a `mima fit` config needs."""
    parser.add_argument("--config", type=Path, required=True, help="the `mima fit` config file (or a run folder)")
    parser.add_argument("--data.root", dest="data_root", type=Path,
                        help="the data root, when the config leaves it to the command line (as configs/clip/*.yaml do)")


class ConfigOptions(Protocol):
    """The options add_config_arguments declares."""

    @property
    def config(self) -> Path: ...

    @property
    def data_root(self) -> Path | None: ...


def config_with_root(options: ConfigOptions):
    """The run config that --config names, with --data.root applied (a RunConfig)."""
    check_config_source(options.config)  # before the config machinery (and torch) is imported
    from mima.config.run_config import load_run_config

    config = load_run_config(options.config)
    if options.data_root is not None:
        config.data.root = str(options.data_root)
    return config


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
    if "Original Traceback" in text:
        text = text.splitlines()[-1].split(f"{MimaError.__name__}: ", 1)[-1]
    return capped(text)


MAX_ERROR_CHARS = 1000  # an error line quotes user input (a path, an --out template): bounded, and one line


def capped(text: str) -> str:
    """`text` on one line and at most MAX_ERROR_CHARS long: a value pasted into a message can be huge."""
    line = " ".join(text.split("\n"))
    if len(line) <= MAX_ERROR_CHARS:
        return line
    keep = MAX_ERROR_CHARS - 60
    return f"{line[:keep]} ... ({len(line) - keep} more characters left out)"


def device_spelling(text: str) -> str:
    """A device as the merge commands spell it, for argparse's `type=` (mima.core.spelling checks it)."""
    try:
        return check_device_spelling(text)
    except ValueError as mistake:
        raise argparse.ArgumentTypeError(str(mistake)) from None
