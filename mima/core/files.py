"""Writing a file so that nothing is lost: one atomic write, one refusal to overwrite.

Every file mima writes goes through `atomic_path`: the bytes land in a temporary file beside the
target, are flushed to disk, and are renamed onto the target only when the write succeeded. A crash
or a signal mid-write leaves the previous file (if any) untouched and no partial file behind. A
temporary file carries its writer's process id, so one left by a killed process (SIGKILL leaves no
chance to clean up) is found and removed, with a message, by the next write to the same target.
Every command that writes outputs asks `refuse_overwrite` first, before any work starts.

A write that must not replace an existing file (`overwrite=False`) checks again at the end, in the same
step that puts the file in place (`place_noreplace`: a hard link, which fails if the name exists, or
`renameat2(RENAME_NOREPLACE)` where the filesystem takes no hard links): of two commands writing the
same new output, one wins and the other is refused, and neither file is ever replaced silently.
A set of files written together (a report, an analysis, a merge with its results) is published as
a whole by mima.core.publish, over these; JSON records are read back by mima.core.bounded_json.

A write the system refuses (a full disk, a file size limit, a read-only folder) is raised as an
OSError naming the file the user asked for, not the temporary one (`write_error`), so the command's
one-line error says which output could not be written.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
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
        if overwrite:
            os.replace(tmp, target)
        else:  # the refusal above was made before the work: another writer may have come since
            place_noreplace(tmp, target)
    except Exception as exc:
        raise write_error(exc, target, tmp) from None
    finally:
        if tmp.exists():
            tmp.unlink()


STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)


def write_error(exc: Exception, target: Path, temporary: Path) -> Exception:
    """The error to raise for `exc`, raised while `target` was written through `temporary` (a file, or
    a staging folder standing for the folder `target`): a refused write, or any error said of the
    temporary path, becomes one naming `target` (or the file under it), which the user can act on;
    anything else is returned as it is.
    Libraries that wrap the system's error in their own type (safetensors) are recognised by the
    system's message in theirs."""
    if isinstance(exc, MimaError) and str(temporary) in str(exc):  # a file check's message, said of the user's path
        return MimaError(str(exc).replace(str(temporary), str(target)))
    if isinstance(exc, OSError):
        code, message, name = exc.errno, exc.strerror, exc.filename
    else:
        code = next((code for code in STORAGE_ERRNOS if os.strerror(code) in str(exc)), None)
        message, name = (os.strerror(code) if code else None), None
    if code not in STORAGE_ERRNOS and not (name is not None and Path(name).is_relative_to(temporary)):
        return exc
    if name is None or Path(name) == temporary:
        return OSError(code, message, str(target))
    try:
        return OSError(code, message, str(target / Path(name).relative_to(temporary)))
    except ValueError:  # a file outside the temporary one: its own name says it
        return exc


def place_noreplace(source: Path, target: Path) -> None:
    """Move `source` to `target` in one atomic step that fails if `target` exists (a MimaError naming
    it); `source` is gone afterwards either way only if it was placed."""
    try:
        os.link(source, target)  # atomic create-or-fail, on local and network filesystems alike
    except FileExistsError:
        raise _exists(target) from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS):
            raise MimaError(f"{target}: cannot be written ({exc.strerror or exc})") from None
        _rename_noreplace(source, target)  # a filesystem without hard links
        return
    os.unlink(source)


def _exists(target: Path) -> MimaError:
    return MimaError(f"{target}: already exists (written by another command meanwhile; pass --overwrite to replace it)")


_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def _rename_noreplace(source: Path, target: Path) -> None:
    """renameat2(RENAME_NOREPLACE) (Linux); where neither it nor hard links exist, a check then a
    rename (the one case with a window, on filesystems that offer no atomic way)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is not None:
        result = renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), _RENAME_NOREPLACE)
        if result == 0:
            return
        code = ctypes.get_errno()
        if code == errno.EEXIST:
            raise _exists(target)
        if code not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise MimaError(f"{target}: cannot be written ({os.strerror(code)})")
    if target.exists() or target.is_symlink():
        raise _exists(target)
    os.rename(source, target)


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Remove the temporary files of writes to `target` whose process no longer exists."""
    removed = []
    for leftover in target.parent.glob(f".{glob_escape(target.name)}.*.tmp"):
        pid = leftover.name[len(target.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not process_exists(int(pid)):
            if leftover.is_dir() and not leftover.is_symlink():  # a staged set (mima merge with its results)
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
            removed.append(leftover)
            sys.stderr.write(f"mima: removed {leftover}, left by an interrupted earlier write of {target.name}\n")
    return removed


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def process_exists(pid: int) -> bool:
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
