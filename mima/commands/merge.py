"""`mima merge`: merge fine-tuned state dicts with a registered strategy (mima.merge_command runs it)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from mima.command_options import add_merge_arguments
from mima.commands.common import OneLineParser
from mima.config.source import check_config_source
from mima.merging.catalogue import check_method_name


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="mima merge", description="Merge fine-tuned image-encoder state dicts.")
    add_merge_arguments(parser)
    options = parser.parse_args(argv)
    check_method_name(options.method)
    return options


def main(argv: Sequence[str]) -> None:
    options = parse(argv)
    if options.config is not None:
        check_config_source(options.config)  # a missing --config answers before the inputs load torch
    from mima.merge_command import run_merge

    run_merge(options)
