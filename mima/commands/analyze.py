"""`mima analyze NAME`: the analyses of mima.analysis, one package each (mima.analysis.ANALYSES lists them)."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from mima.analysis import ANALYSES
from mima.analysis.options import ModelOptions, OutputOptions
from mima.commands.common import OneLineParser, frozen_options
from mima.core.folders import no_empty_folder_left
from mima.config.source import check_config_source
from mima.core.errors import MimaError


def parse(argv: Sequence[str]) -> OutputOptions:
    """The options of `mima analyze ARGV...`, the analysis being argv[0]: its options module's OPTIONS
    dataclass (every analysis writes outputs; most read models)."""
    name = argv[0] if argv else ""
    if name not in ANALYSES:
        raise MimaError(f"unknown analysis '{name}' (analyses: {', '.join(ANALYSES)})")
    package, description = ANALYSES[name]
    parser = OneLineParser(prog=f"mima analyze {name}", description=description)
    options = importlib.import_module(f"{package}.options")
    options.add_arguments(parser)
    return frozen_options(options.OPTIONS, parser.parse_args(argv[1:]))


def main(argv: Sequence[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mima analyze ANALYSIS [options]   (mima analyze ANALYSIS --help)\n\nanalyses:")
        print("\n".join(f"  {name:<10} {text}" for name, (_, text) in ANALYSES.items()))
        return
    options = parse(argv)
    if isinstance(options, ModelOptions) and options.config is not None:
        check_config_source(options.config)  # before the analysis loads torch
    package, _ = ANALYSES[argv[0]]
    command = importlib.import_module(f"{package}.command")
    from mima.analysis.common import staged_outputs

    with no_empty_folder_left(options.out), staged_outputs():
        command.main(options)
