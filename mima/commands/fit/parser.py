"""`mima fit`'s command line: the run's program (mima.services.fit.program) reading argv as well as a
config mapping, an unknown option answered with the nearest known one; `mima fit --help` is its
parser's (LightningCLI's)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentError, Namespace
from lightning.pytorch.cli import LightningArgumentParser
from typing_extensions import override

from mima.commands.common import suggest_option
from mima.config.parse_errors import config_error_text
from mima.core.errors import MimaError
from mima.services.fit.program import FitProgram, build_program
from mima.services.fit.config import NO_CONFIG_FILE


class FitCommandLine(FitProgram):
    """FitProgram given a `mima fit` command line (or, as the tests give it, a config mapping)."""

    @override
    def parse_config(self, parser: LightningArgumentParser, args: Any) -> Namespace:
        if not isinstance(args, list):
            return super().parse_config(parser, args)
        # mima always passes the arguments explicitly (sys.argv also holds `mima fit`).
        try:
            return parser.parse_args(args)
        except ArgumentError as exc:
            raise MimaError(f"config: {config_error_text(exc)}{typo_hint(str(exc), parser)}") from None


class ParsedOnly(FitCommandLine):
    """A `mima fit` command line parsed and its types checked against the module's, the data's and the
    Trainer's signatures, with nothing built (no run folder, no model, no Trainer)."""

    @override
    def instantiate_classes(self) -> None:
        pass


def build_cli(args: list[str] | dict, cli_class: type[FitCommandLine] = FitCommandLine) -> FitCommandLine:
    """A `mima fit` command line (or a config dict) parsed, its options checked and its classes made
    (`cli_class` ParsedOnly: parse and check the options only)."""
    return build_program(args, cli_class)


def parse_fit(args: list[str]):
    """The parsed options of a `mima fit` command line, without running it (mima.cli.parse)."""
    return build_cli(args, ParsedOnly).config


def config_file_name(config: Namespace) -> str:
    """What --out's {config} is: the name of the last --config file, without its extension."""
    files = config.get("config") or []
    return Path(str(files[-1])).stem if files else NO_CONFIG_FILE


def typo_hint(message: str, parser: LightningArgumentParser) -> str:
    """"; did you mean --model.iterations?" for the first unrecognized option of a parser error that
    has a close match among the options (every key of the config: the parser's defaults), else ""."""
    unknown = re.search(r"unrecognized arguments: (--[^\s=]+)", message)
    if unknown is None:
        return ""
    known = [f"--{key}" for key in parser.get_defaults().keys()]
    match = suggest_option(unknown.group(1), known)
    return f"; did you mean {match}?" if match else ""
