"""`mima data cache`: decode a config's tasks once into the image cache (mima.data.cache_store)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mima.commands.common import OneLineParser, add_config_arguments, config_with_root, frozen_options
from mima.core.cache_dir import CACHE_DIR_VARIABLE, DATA_CACHE_FOLDER
from mima.core.errors import MimaError


@dataclass(frozen=True)
class CacheOptions:
    config: Path
    data_root: Path | None  # --data.root; None: the config's
    workers: int | None  # decoding processes; None: data.num_workers or up to 4


def parse(argv: Sequence[str]) -> CacheOptions:
    parser = OneLineParser(
        prog="mima data cache",
        description="Build the decoded-image cache of a `mima fit` config's tasks (mima.data.cache_store): each split "
        "decoded once through the model's evaluation transform (resize, centre crop) and stored as uint8, where "
        f"data.cache_dir says (default ${CACHE_DIR_VARIABLE}/{DATA_CACHE_FOLDER}). "
        "Stale or missing splits are rebuilt, others kept. `mima fit` with data.cache: true builds what is missing itself.",
    )
    add_config_arguments(parser)
    parser.add_argument("--workers", type=int, default=None, help="decoding processes (default: data.num_workers or up to 4)")
    return frozen_options(CacheOptions, parser.parse_args(argv))


def main(argv: Sequence[str]) -> None:
    options = parse(argv)
    config = config_with_root(options)
    from mima.core.cache_dir import cache_dir_or_default
    from mima.models.clip import load_clip

    if options.workers is not None:
        if options.workers < 0:
            raise MimaError(f"--workers must be >= 0, got {options.workers}")
        config.data.num_workers = options.workers
    model = config.model
    loaded = load_clip(model.clip, model.pretrained, cache_dir=cache_dir_or_default(model.cache_dir),
                       quick_gelu=model.quick_gelu)
    data = config.datamodule()
    for task in data.build_cache(loaded.image_size, loaded.preprocess):
        sizes = ", ".join(f"{split} {len(cached)}" for split, cached in task.splits.items())
        print(f"mima data cache: {task.name}: {sizes} images ({'augmented' if task.augment else 'not augmented'} in training)")
    print(f"mima data cache: in {data.cache_folder}")
