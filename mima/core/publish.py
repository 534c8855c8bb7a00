"""Publishing a set of files as a whole: all of them, or none, in the output folder.

`atomic_folder` (and `stage_folder` + `publish_folder`, for a command that stages its files itself)
writes the files of one command (a report, an analysis, a merge with its results) into a temporary
folder beside the output folder, then places them there together: without `overwrite` each is placed
without replacing (mima.core.files.place_noreplace), and a name taken meanwhile takes back what was
placed; with `overwrite` the files replaced are first moved aside into a journal folder in the output
folder (`replace_set`), so that a failure or signal puts the earlier set back at once, and after a
SIGKILL the next publish into the same folder does (`roll_back_interrupted_publishes`). The output
folder holds the earlier set or the new one, never a mix. One file alone: mima.core.files.atomic_path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from mima.core.bounded_json import read_json
from mima.core.errors import MimaError
from mima.core.files import (glob_escape, place_noreplace, process_exists, refuse_overwrite, write_error,
                             write_json_atomic)


@contextlib.contextmanager
def atomic_folder(folder: str | os.PathLike, names: Iterable[str] | None = None, overwrite: bool = False,
                  lock: str | None = None) -> Iterator[Path]:
    """Yield a temporary folder beside `folder`; the files written into it become `folder`'s files
    only if the block succeeds, and all together at the end: a failed command leaves the earlier
    outputs as they were, and no half-written set.

    `names`: the files the command is known to write, refused before the work if they exist and
    `overwrite` is off; every file is placed without replacing unless `overwrite` (then each replaces
    its namesake atomically). Files already in `folder` that the block did not write stay. `lock`: the
    command that takes `folder`'s lock (mima.core.run_lock) while the files are placed."""
    target = Path(folder)
    if names is not None and not overwrite:
        refuse_overwrite([target / name for name in names], what=f"--out {target}")
    staging, created = stage_folder(target)
    try:
        yield staging
        publish_folder(staging, target, overwrite, lock)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        remove_folders(created)
        if isinstance(exc, Exception):
            raise write_error(exc, target, staging) from None
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def stage_folder(target: Path) -> tuple[Path, list[Path]]:
    """A new temporary folder beside `target` (on its filesystem), and the missing parents created for it."""
    created = [path for path in target.parents if not path.exists() and not path.is_symlink()]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent))
    except OSError as exc:
        remove_folders(created)
        raise MimaError(f"{target}: cannot be written ({exc.strerror or exc})") from None
    return staging, created


def remove_folders(created: list[Path]) -> None:
    """Remove folders a failed command created, the deepest first, as long as they are empty."""
    for path in sorted(created, key=lambda p: len(p.parts), reverse=True):
        try:
            path.rmdir()
        except OSError:
            break


def publish_folder(staging: Path, target: Path, overwrite: bool, lock: str | None = None) -> list[Path]:
    """Move every file under `staging` to the same place under `target`, as a whole: all names checked
    first, then each placed without replacing (or, with `overwrite`, replacing: the files it replaces
    are moved aside into a journal first, see `replace_set`); if placing fails or is interrupted, what was
    placed is taken back, so `target` holds the earlier set or the new one, never a mix. Returns the
    placed files."""
    from mima.core.run_lock import RunLock  # core, but only the commands that write folders need it

    written = sorted(p for p in staging.rglob("*") if p.is_file() or p.is_symlink())
    guard = RunLock(target, lock) if lock else contextlib.nullcontext()
    with guard:
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise MimaError(f"{target}: cannot be written ({exc.strerror or exc})") from None
        roll_back_interrupted_publishes(target)
        if overwrite:
            return replace_set(staging, target, [p.relative_to(staging) for p in written])
        refuse_overwrite([target / p.relative_to(staging) for p in written], what=f"--out {target}")
        placed: list[Path] = []
        try:
            for path in written:
                destination = target / path.relative_to(staging)
                destination.parent.mkdir(parents=True, exist_ok=True)
                place_noreplace(path, destination)
                placed.append(destination)
        except BaseException:  # another command came in between: take back what this one placed
            for destination in placed:
                destination.unlink(missing_ok=True)
            raise
    return placed


PUBLISH_JOURNAL = ".publishing-"  # target/.publishing-<pid>/: a set being replaced (journal.json, old/)


def replace_set(staging: Path, target: Path, names: list[Path]) -> list[Path]:
    """Replace the files `names` of `target` by those of `staging`. A journal folder in `target` names the
    staging folder and the set; each file replaced is first moved into the journal's old/. On any
    failure or signal the old set is put back at once; after a SIGKILL, the next publish into `target`
    (`roll_back_interrupted_publishes`) puts it back. The journal goes once the whole set is placed."""
    journal = target / f"{PUBLISH_JOURNAL}{os.getpid()}"
    try:
        (journal / "old").mkdir(parents=True, exist_ok=True)
        write_json_atomic(journal / "journal.json", {"staging": str(staging), "files": [str(name) for name in names]})
    except BaseException as exc:  # nothing was moved yet
        shutil.rmtree(journal, ignore_errors=True)
        if isinstance(exc, OSError):
            raise OSError(exc.errno, exc.strerror, str(target)) from None
        raise
    placed = []
    name = names[0] if names else Path()
    try:
        for name in names:
            destination = target / name
            destination.parent.mkdir(parents=True, exist_ok=True)
            if destination.exists() or destination.is_symlink():
                (journal / "old" / name).parent.mkdir(parents=True, exist_ok=True)
                os.replace(destination, journal / "old" / name)
            os.replace(staging / name, destination)
            placed.append(destination)
    except OSError as exc:  # said of the user's file, not of the journal it was being moved into
        roll_back(journal, target)
        raise OSError(exc.errno, exc.strerror, str(target / name)) from None
    except BaseException:
        roll_back(journal, target)
        raise
    shutil.rmtree(journal, ignore_errors=True)
    return placed


def roll_back(journal: Path, target: Path) -> Path:
    """Put back the set a journal was replacing: a file not yet taken from staging was never touched; one
    taken is removed, and the file it replaced (kept in old/) returns."""
    record = read_json(journal / "journal.json")
    staging = Path(record["staging"])
    for name in map(Path, record["files"]):
        if (staging / name).exists():
            if (journal / "old" / name).exists():  # moved aside, the new file not placed yet
                os.replace(journal / "old" / name, target / name)
            continue
        backup = journal / "old" / name
        if backup.exists() or backup.is_symlink():
            os.replace(backup, target / name)
        else:
            (target / name).unlink(missing_ok=True)  # new in this set: there was no file before
    shutil.rmtree(journal, ignore_errors=True)
    return staging


def roll_back_interrupted_publishes(target: Path) -> None:
    """Journals in `target` left by a process that no longer runs (killed while replacing a set): the
    earlier set put back, said in one line."""
    for journal in sorted(target.glob(f"{PUBLISH_JOURNAL}*")):
        pid = journal.name[len(PUBLISH_JOURNAL):]
        if not pid.isdigit() or process_exists(int(pid)):
            continue
        if (journal / "journal.json").is_file():
            roll_back(journal, target)
        else:  # killed while writing the journal: nothing was moved yet
            shutil.rmtree(journal, ignore_errors=True)
        for staging in target.parent.glob(f".{glob_escape(target.name)}.{pid}.*.tmp"):  # the killed command's
            shutil.rmtree(staging, ignore_errors=True)
        sys.stderr.write(f"mima: {target}: put back the files an interrupted earlier command was replacing\n")
