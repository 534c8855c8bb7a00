"""Merge fine-tuned image-encoder state dicts."""
# `mima merge`: merge fine-tuned state dicts with a registered strategy (mima.commands.merge.run runs it).

from __future__ import annotations

from collections.abc import Sequence

from mima.commands.merge.options import MergeOptions, add_merge_arguments
from mima.commands.common import OneLineParser
from mima.config.source import check_config_source
from mima.merging.catalogue import check_method_name


def parse(argv: Sequence[str]) -> MergeOptions:
    """The command line as MergeOptions, its method name checked (the one check: the name goes on to the
    registry as a known one)."""
    parser = OneLineParser(prog="mima merge", description=__doc__)
    add_merge_arguments(parser)
    options = MergeOptions.from_namespace(parser.parse_args(argv))
    check_method_name(options.method)
    return options


def main(argv: Sequence[str]) -> None:
    options = parse(argv)
    if options.config is not None:
        check_config_source(options.config)  # a missing --config answers before the inputs load torch
    from mima.commands.merge.run import run_merge

    run_merge(options)
