"""Where mima caches what it builds once and reuses across runs: embedded models and zero-shot heads
(mima.models.clip) and, in its `data` folder, decoded images (mima.data.cache_store). Imports nothing
heavy: command-line parsers state the default in their help before torch loads."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_VARIABLE = "MIMA_CACHE_DIR"
CACHE_DIR_FALLBACK = "~/.cache/mima"  # where the cache is without $MIMA_CACHE_DIR
DATA_CACHE_FOLDER = "data"  # the decoded-image cache, inside the cache folder


def default_cache_dir() -> Path:
    """$MIMA_CACHE_DIR, or ~/.cache/mima."""
    return Path(os.environ.get(CACHE_DIR_VARIABLE, Path(CACHE_DIR_FALLBACK).expanduser()))


def cache_dir_or_default(configured: str | os.PathLike | None) -> Path:
    """The cache folder a config names (model.cache_dir), or the default when it names none."""
    return Path(configured) if configured else default_cache_dir()


def default_data_cache_dir() -> Path:
    """$MIMA_CACHE_DIR/data, or ~/.cache/mima/data."""
    return default_cache_dir() / DATA_CACHE_FOLDER
