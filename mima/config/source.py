"""Where a run config comes from, checked before anything heavy is imported."""

from __future__ import annotations

from pathlib import Path

from mima.core.errors import MimaError


def check_config_source(path: Path) -> None:
    """Refuse, in one line, a --config that is neither a config file nor a run folder."""
    if not path.is_file() and not path.is_dir():
        raise MimaError(f"--config {path}: no such file or run folder")
