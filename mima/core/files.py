"""Writing files so that nothing is lost: one atomic write, one refusal to overwrite.

Every file mima writes goes through `atomic_path`: the bytes land in a temporary file beside the
target, are flushed to disk, and are renamed onto the target only when the write succeeded. A crash
or a signal mid-write leaves the previous file (if any) untouched and no partial file behind. A
temporary file carries its writer's process id, so one left by a killed process (SIGKILL leaves no
chance to clean up) is found and removed, with a message, by the next write to the same target.
Every command that writes outputs asks `refuse_overwrite` first, before any work starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from mima.core.errors import MimaError


def refuse_overwrite(paths: Iterable[str | os.PathLike], what: str | None = None, hint: str = "pass --overwrite") -> None:
    """Raise a MimaError naming the first existing path (or `what`, e.g. '--out DIR') unless none exists."""
    existing = [Path(path) for path in paths if Path(path).exists() or Path(path).is_symlink()]
    if not existing:
        return
    if what is None:
        if existing[0].is_dir():  # no --overwrite replaces a folder by a file: say what is wrong
            raise MimaError(f"{existing[0]}: is a folder; give a file name to write")
        raise MimaError(f"{existing[0]}: already exists ({hint} to replace it)")
    names = ", ".join(path.name for path in existing)
    raise MimaError(f"{what}: already holds {names}; {hint} or choose another")


def refuse_input_as_output(output: str | os.PathLike, inputs: Iterable[str | os.PathLike], option: str = "--output") -> None:
    """Raise a MimaError if `output` already is one of `inputs` (the same file under any name: a
    symlink, a hard link, another spelling of the path), so that no `--overwrite` can replace an input."""
    output = Path(output)
    if not output.exists():
        return
    for path in inputs:
        if Path(path).exists() and os.path.samefile(output, path):
            raise MimaError(f"{option} {output}: is the input {path}; an input is never replaced, choose another output")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, overwrite: bool = True, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it onto `path` only if the block succeeds.

    With `overwrite=False` an existing file is an error, raised before any work.
    """
    target = Path(path)
    if not overwrite:
        refuse_overwrite([target])
    if target.is_dir():
        raise MimaError(f"{target}: is a folder; give a file name to write")
    # SIGINT/SIGTERM wait while the temporary file is made: a handler that raised between its
    # creation and the `try` below would leave it behind
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(target)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent)
        os.close(fd)
        tmp = Path(tmp_name)
    except OSError as exc:  # a read-only folder, a path through a file, a full disk
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        raise MimaError(f"{target}: cannot be written ({exc.strerror or exc})") from None
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)  # a signal that waited is handled here
        yield tmp
        if fsync:  # the data must be on disk before the rename makes it the file
            with open(tmp, "rb+") as stream:
                os.fsync(stream.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Remove the temporary files of writes to `target` whose process no longer exists."""
    removed = []
    for leftover in target.parent.glob(f".{glob_escape(target.name)}.*.tmp"):
        pid = leftover.name[len(target.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _process_exists(int(pid)):
            leftover.unlink(missing_ok=True)
            removed.append(leftover)
            sys.stderr.write(f"mima: removed {leftover}, left by an interrupted earlier write of {target.name}\n")
    return removed


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def write_text_atomic(path: str | os.PathLike, text: str, overwrite: bool = True) -> None:
    with atomic_path(path, overwrite=overwrite) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | os.PathLike, obj: object, overwrite: bool = True) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n", overwrite=overwrite)


def replace_symlink(target_name: str, link: Path) -> None:
    """Point `link` at `target_name` (relative), atomically: a new link renamed over the old one."""
    temporary = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    if temporary.is_symlink() or temporary.exists():
        temporary.unlink()
    os.symlink(target_name, temporary)
    os.replace(temporary, link)


def read_json(path: str | os.PathLike, expect: type = dict) -> object:
    """A JSON file that a mima command wrote (run folders, results), or one line naming the file if
    it was damaged or edited into something else."""
    path = Path(path)
    try:
        value = json.loads(path.read_text())
    except OSError as exc:
        raise MimaError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MimaError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, expect):
        raise MimaError(f"{path}: expected a JSON {'object' if expect is dict else 'list'}, found {type(value).__name__}")
    return value


def read_json_lines(path: str | os.PathLike) -> list[dict]:
    """A JSON-lines file of objects (metrics.jsonl), one line naming the file and line if damaged."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise MimaError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise MimaError(f"{path}: not JSON lines (not a text file)") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise MimaError(f"{path}: line {number} is not valid JSON ({exc})") from None
        if not isinstance(record, dict):
            raise MimaError(f"{path}: line {number} is not a JSON object")
        records.append(record)
    return records

