"""Fetch what a `mima fit` config needs from the network: the open_clip weights of model.clip +
model.pretrained (into open_clip's cache under $HF_HOME) and the tasks torchvision can download
(into data.root). Run it where there is internet (the login node); the compute nodes then run
offline (HF_HUB_OFFLINE=1).
"""
# `mima prefetch`: fetch what a config needs from the network ahead of an offline run (mima.commands.prefetch.fetch).

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mima.commands.common import OneLineParser, add_config_arguments, config_with_root, frozen_options


@dataclass(frozen=True)
class PrefetchOptions:
    config: Path
    data_root: Path | None  # --data.root; None: the config's
    weights_dir: Path | None  # also copy the weights there


def parse(argv: Sequence[str]) -> PrefetchOptions:
    parser = OneLineParser(prog="mima prefetch", description=__doc__)
    add_config_arguments(parser)
    parser.add_argument("--weights-dir", type=Path, default=None,
                        help="also copy the weights to DIR/<architecture>-<tag>.<ext> with a record of their activation "
                        "beside them, for configs that name a weight file (model.pretrained) on nodes without the cache")
    return frozen_options(PrefetchOptions, parser.parse_args(argv))


def main(argv: Sequence[str]) -> None:
    options = parse(argv)
    config = config_with_root(options)
    from mima.commands.prefetch.fetch import prefetch

    prefetch(config, say=lambda line: print(f"mima prefetch: {line}", flush=True), weights_dir=options.weights_dir)
