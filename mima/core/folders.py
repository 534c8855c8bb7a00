"""An output folder that a failed command or API call created is not left behind empty."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def no_empty_folder_left(folder: Path | None) -> Iterator[None]:
    """A command that fails (a mistake found late, a signal) leaves no empty --out folder behind,
    nor the empty parents it created for it; a folder that existed before, or holds files, stays."""
    if folder is None:
        yield
        return
    folder = Path(folder)
    created = [path for path in (folder, *folder.parents) if not path.exists() and not path.is_symlink()]
    try:
        yield
    except BaseException:
        for path in created:  # the deepest first
            try:
                path.rmdir()  # only an empty folder goes
            except OSError:
                break
        raise
