"""Merge fine-tuned image-encoder state dicts."""
# `mima merge`: merge fine-tuned state dicts with a registered strategy. The command parses its options
# (mima.commands.merge.options); the merge service (mima.services.merge) runs them, as it runs mima.merge.

from __future__ import annotations

from collections.abc import Sequence

from mima.commands.common import OneLineParser
from mima.commands.merge.options import add_merge_arguments, merge_request
from mima.config.source import check_config_source
from mima.merging.catalogue import check_method_name
from mima.services.merge_request import MergeRequest


def parse(argv: Sequence[str]) -> MergeRequest:
    """The command line as a MergeRequest, its method name checked (the one check: the name goes on to
    the registry as a known one)."""
    parser = OneLineParser(prog="mima merge", description=__doc__)
    add_merge_arguments(parser)
    request = merge_request(parser.parse_args(argv))
    check_method_name(request.method)
    return request


def main(argv: Sequence[str]) -> None:
    request = parse(argv)
    if request.config is not None:
        check_config_source(request.config)  # a missing --config answers before the service loads torch
    from mima.services.merge import run_merge

    run_merge(request)
