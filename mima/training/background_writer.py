"""A background thread that writes checkpoint files while training goes on.

Jobs run one at a time in the order they were queued, so a process's state file, queued after the
weight files it refers to, is never on disk before them. Each job writes through
mima.core.files.atomic_path (temporary file, fsync, rename): a kill during a write leaves the
previous file, or no file, never a partial one. Callers hand over tensors they no longer modify
(CPU copies). A failed write is raised in the training process at the next `submit` or `flush`.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from mima.core.files import atomic_path

Job = tuple[Path, Callable[[Path], None] | None]  # a write, or (None: remove the path)


class BackgroundWriter:
    def __init__(self) -> None:
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mima-checkpoint-writer", daemon=True)
        self._thread.start()
        self.bytes_written = 0  # what reached the disk, for benchmarks/checkpoint_io.py

    def submit(self, path: Path, write: Callable[[Path], None]) -> None:
        """Queue `write(temporary_path)`; the result is renamed to `path` once complete."""
        self._raise_if_failed()
        self._jobs.put((Path(path), write))

    def submit_removal(self, paths: list[Path]) -> None:
        """Remove files or folders once everything queued before them is on disk."""
        self._raise_if_failed()
        for path in paths:
            self._jobs.put((Path(path), None))

    def flush(self) -> None:
        """Wait until every queued file is on disk."""
        self._jobs.join()
        self._raise_if_failed()

    def close(self) -> None:
        self.flush()
        self._jobs.put(None)
        self._thread.join()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                path, write = job
                if write is None:
                    if self._error is None:  # a failed write may have left only older states valid
                        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
                elif self._error is None:  # after a failure, later files would refer to a missing one
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with atomic_path(path) as temporary:
                        write(temporary)
                        self.bytes_written += os.path.getsize(temporary)
            except BaseException as exc:  # handed to the training thread
                self._error = exc
            finally:
                self._jobs.task_done()
