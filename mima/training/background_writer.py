"""A background thread that writes checkpoint files while training goes on.

Jobs run one at a time in the order they were queued, so a process's state file, queued after the
weight files it refers to, is never on disk before them. Each job writes through
mima.core.files.atomic_path (temporary file, fsync, rename): a kill during a write leaves the
previous file, or no file, never a partial one. Callers hand over tensors nobody modifies until
the job is done (PhaseState's host buffers are refilled only after `wait_for_job` says so, see
mima.training.phase_state.HostBuffers; or copies): the thread writes them as they are, without a
copy of its own. A job may carry a `done` callback, run on this thread once its file is in place (MimaCheckpoint
marks a state durable with it). A failed write is raised in the training process at the next
`submit`, `wait_for` or `flush`.

Training never waits for the disk here except where it asks to: `wait_for(n)` until at most n jobs
are left (MimaCheckpoint's bound on how many checkpoints may be in flight), `flush` until none is.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from mima.core.files import atomic_path

Write = Callable[[Path], None]
Job = tuple[Path, Write | None, Callable[[], None] | None]  # (path, write or None: remove the path, done)


class BackgroundWriter:
    def __init__(self) -> None:
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mima-checkpoint-writer", daemon=True)
        self._thread.start()
        self.bytes_written = 0  # what reached the disk, for benchmarks/checkpoint_io.py
        self._submitted = 0  # jobs queued so far
        self._finished = 0  # jobs done so far (written, removed or skipped after a failure)
        self._progress = threading.Condition()

    def submit(self, path: Path, write: Write, done: Callable[[], None] | None = None) -> None:
        """Queue `write(temporary_path)`; the result is renamed to `path` once complete, then `done()` runs."""
        self._raise_if_failed()
        self._put((Path(path), write, done))

    def submit_removal(self, paths: list[Path]) -> None:
        """Remove files or folders once everything queued before them is on disk."""
        self._raise_if_failed()
        for path in paths:
            self._put((Path(path), None, None))

    @property
    def submitted(self) -> int:
        """How many jobs have been queued so far (a mark for `wait_for_job`)."""
        return self._submitted

    def wait_for_job(self, mark: int) -> None:
        """Wait until the first `mark` jobs queued are done (earlier ones finish first: FIFO)."""
        with self._progress:
            self._progress.wait_for(lambda: self._finished >= mark)
        self._raise_if_failed()

    def flush(self) -> None:
        """Wait until every queued file is on disk."""
        self._jobs.join()
        self._raise_if_failed()

    def close(self) -> None:
        self.flush()
        self._jobs.put(None)
        self._thread.join()

    def _put(self, job: Job) -> None:
        self._submitted += 1
        self._jobs.put(job)

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
                path, write, done = job
                if write is None:
                    if self._error is None:  # a failed write may have left only older states valid
                        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
                elif self._error is None:  # after a failure, later files would refer to a missing one
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with atomic_path(path) as temporary:
                        write(temporary)
                        self.bytes_written += os.path.getsize(temporary)
                    if done is not None:
                        done()
            except BaseException as exc:  # handed to the training thread
                self._error = exc
            finally:
                if job is not None:
                    with self._progress:
                        self._finished += 1
                        self._progress.notify_all()
                self._jobs.task_done()
