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

One writer serves a process's checkpoints and its final task models (`mima fit` hands the same one to
MimaCheckpoint and MimaSyncCallback), so a state that refers to a final file is never on disk before
it; `pending(path)` tells a caller that a file is queued and not yet written. The thread starts
with the first job.
"""

from __future__ import annotations

import os
import queue
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mima.core.files import atomic_path

Write = Callable[[Path], None]


@dataclass(frozen=True)
class Job:
    """One job: `write(temporary)` renamed to `path`; or `call()`, which writes `paths` itself (each
    atomically); or, with neither, the removal of `path`. `done()` runs once it is complete."""

    path: Path
    write: Write | None = None
    call: Callable[[], None] | None = None
    paths: tuple[Path, ...] = ()
    done: Callable[[], None] | None = None

    def targets(self) -> tuple[Path, ...]:
        return self.paths if self.call is not None else (self.path,)


class BackgroundWriter:
    def __init__(self) -> None:
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None  # started with the first job
        self.bytes_written = 0  # what reached the disk, for benchmarks/checkpoint_io.py
        self._submitted = 0  # jobs queued so far
        self._finished = 0  # jobs done so far (written, removed or skipped after a failure)
        self._progress = threading.Condition()
        self._pending: dict[Path, int] = {}  # path -> queued jobs that write it and are not done

    def submit(self, path: Path, write: Write, done: Callable[[], None] | None = None) -> None:
        """Queue `write(temporary_path)`; the result is renamed to `path` once complete, then `done()` runs."""
        self._raise_if_failed()
        self._put(Job(Path(path), write=write, done=done))

    def submit_call(self, paths: Sequence[Path], call: Callable[[], None]) -> None:
        """Queue `call()`, which writes `paths` itself (each atomically, e.g. through
        mima.core.files.atomic_path), in order with the other jobs."""
        self._raise_if_failed()
        targets = tuple(Path(path) for path in paths)
        self._put(Job(targets[0], call=call, paths=targets))

    def submit_removal(self, paths: list[Path]) -> None:
        """Remove files or folders once everything queued before them is on disk."""
        self._raise_if_failed()
        for path in paths:
            self._put(Job(Path(path)))

    def pending(self, path: Path) -> bool:
        """Whether a queued job that writes `path` has not finished yet."""
        with self._progress:
            return self._pending.get(Path(path), 0) > 0

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
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _put(self, job: Job) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mima-checkpoint-writer", daemon=True)
            self._thread.start()
        self._submitted += 1
        if job.write is not None or job.call is not None:
            with self._progress:
                for path in job.targets():
                    self._pending[path] = self._pending.get(path, 0) + 1
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
                if self._error is not None:
                    pass  # after a failure, later files would refer to a missing one; a removal, to an older state
                elif job.call is not None:
                    job.call()
                    self.bytes_written += sum(os.path.getsize(path) for path in job.paths if path.is_file())
                elif job.write is None:
                    shutil.rmtree(job.path) if job.path.is_dir() else job.path.unlink(missing_ok=True)
                else:
                    job.path.parent.mkdir(parents=True, exist_ok=True)
                    with atomic_path(job.path) as temporary:
                        job.write(temporary)
                        self.bytes_written += os.path.getsize(temporary)
                if job.done is not None and self._error is None:
                    job.done()
            except BaseException as exc:  # handed to the training thread
                self._error = exc
            finally:
                if job is not None:
                    with self._progress:
                        self._finished += 1
                        if job.write is not None or job.call is not None:
                            for path in job.targets():
                                self._pending[path] -= 1
                        self._progress.notify_all()
                self._jobs.task_done()
