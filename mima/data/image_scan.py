"""Image files below folders of class folders, listed and checked: what a folder-based task reads
(a user's custom task, mima.data.image_folder; the folder-based benchmark tasks, mima.data.clip_tasks).

Listing (`scan_split`): classes are the sub-folders, in sorted order, and files are read recursively
below each, in torchvision ImageFolder's order (`image_files`), so split indices are ImageFolder's.
A folder reached twice through links is walked once, a file reached twice is counted once
(`without_repeats`), and one file under two classes is an error.

Integrity: an image name on something that is not a regular file (a FIFO, device or socket, or a
link to one) stops the command naming it, before anything opens it (`refuse_special_file`); so does
a class folder whose name is not valid UTF-8 (`class_folders`, shown as its bytes). Every image
file can be opened and verified (PIL's `verify`: the header, and for PNG every chunk's checksum)
before anything is written (`readable_samples`): an unreadable file stops the command with its
name, or is left out with a count.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image

from mima.core.errors import MimaError
from mima.core.names import IMAGE_EXTENSIONS  # the files read as images (mima.data.prepare extracts the same)


def class_folders(folder: Path) -> list[str]:
    """The sub-folder names of `folder`, sorted (torchvision ImageFolder's class order).

    A name that is not valid UTF-8 stops the command, shown as its bytes: it would become a class
    name (prompt text, JSON, hashes), which must be text."""
    names = sorted(entry.name for entry in os.scandir(folder) if entry.is_dir() and not entry.name.startswith("."))
    for name in names:
        if not name.isascii():
            try:
                name.encode("utf-8")  # os.scandir keeps undecodable bytes as lone surrogates, which do not encode
            except UnicodeEncodeError:
                raise MimaError(f"{folder}: folder name {escaped_name(name)} is not valid UTF-8; rename it") from None
    return names


def escaped_name(name: str) -> str:
    """A file name as its bytes with backslash escapes (b'caf\\xe9'), printable whatever its encoding."""
    return repr(os.fsencode(name))


def image_files(folder: Path) -> list[str]:
    """Every image file below `folder` (recursively, following links), in torchvision ImageFolder's
    order (folders sorted by path, files sorted by name), so that split indices are ImageFolder's.

    Each folder is walked once: a link back to a folder already walked (a loop such as `loop -> .`, or
    a second link to the same folder) is not followed again (of two paths to one folder, the first in
    sorted order is walked). An image name on something that is not a regular file (a FIFO, device or
    socket, or a link to one) stops the command naming it, before anything opens it: opening a FIFO
    waits forever for a writer. A broken link stays listed (opening it fails with its name, as for any
    unreadable file)."""
    walked: set[tuple[int, int]] = set()
    listing = []
    for directory, subfolders, files in os.walk(folder, followlinks=True):
        identity = file_identity(directory)
        if identity in walked:
            subfolders[:] = []  # a folder reached again through a link: already listed
            continue
        walked.add(identity)
        subfolders.sort()  # sorted descent: which of two paths to one folder is walked does not depend on the disk
        listing.append((directory, sorted(name for name in files if name.lower().endswith(IMAGE_EXTENSIONS))))
    found = [os.path.join(directory, name) for directory, names in sorted(listing) for name in names]
    for path in found:
        refuse_special_file(path)
    return found


def file_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of what `path` leads to (links followed); None for a broken link."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def refuse_special_file(path: str) -> None:
    """A one-line error when `path` (links followed) exists but is not a regular file."""
    try:
        mode = os.stat(path).st_mode  # stat, not open: it never blocks on a FIFO
    except OSError:
        return
    if not stat.S_ISREG(mode):
        kinds = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                 (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"))
        kind = next((word for test, word in kinds if test(mode)), "not a regular file")
        link = " (through a symbolic link)" if os.path.islink(path) else ""
        raise MimaError(f"{path}: is {kind}{link}, not an image file; remove it from the data folder")


def without_repeats(samples: list[tuple[str, int]], what: str, class_names: Sequence[str]) -> list[tuple[str, int]]:
    """`samples` with each image file counted once: a path that leads to a file listed before (a link, a
    hard link) is left out and counted in one line on stderr; one file under two classes is an error
    (which label would it have?)."""
    first: dict[tuple[int, int], tuple[str, int]] = {}
    kept, repeats = [], []
    for path, label in samples:
        identity = file_identity(path)
        if identity is None:  # a broken link: its reader names it
            kept.append((path, label))
            continue
        earlier = first.setdefault(identity, (path, label))
        if earlier == (path, label):
            kept.append((path, label))
        elif earlier[1] != label:
            raise MimaError(f"{what}: {path} (class '{class_names[label]}') is the same file as {earlier[0]} (class "
                            f"'{class_names[earlier[1]]}'); an image has one class: remove one of them")
        else:
            repeats.append((path, earlier[0]))
    if repeats:
        print(f"{what}: {len(repeats)} paths lead to image files already listed (links or hard links) and are counted "
              f"once (first: {repeats[0][0]} is {repeats[0][1]})", file=sys.stderr)
    return kept


def scan_split(
    folder: Path,
    class_to_index: Mapping[str, int],
    what: str,
    require_all: bool = False,
    keep: Callable[[str], bool] | None = None,
) -> list[tuple[str, int]]:
    """(file, label) pairs of a folder of class sub-folders whose labels come from `class_to_index`.

    A sub-folder that is not a known class is an error (labels would silently shift otherwise);
    with `require_all` every class must have a folder. `keep` filters files by path. `what` names
    the task and split in messages."""
    if not folder.is_dir():
        raise MimaError(f"{what}: {folder} is not a folder")
    present = class_folders(folder)
    unknown = [name for name in present if name not in class_to_index]
    if unknown:
        raise MimaError(f"{what}: folder '{unknown[0]}' in {folder} is not one of the task's {len(class_to_index)} classes")
    if require_all and len(present) < len(class_to_index):
        absent = [name for name in class_to_index if name not in present]
        raise MimaError(f"{what}: {folder} lacks {len(absent)} of the {len(class_to_index)} class folders (e.g. '{absent[0]}')")
    samples = []
    for name in present:
        files = image_files(folder / name)
        samples += [(path, class_to_index[name]) for path in files if keep is None or keep(path)]
    samples = without_repeats(samples, what, sorted(class_to_index, key=class_to_index.get))
    if not samples:
        raise MimaError(f"{what}: no image files ({', '.join(IMAGE_EXTENSIONS[:3])}, ...) below {folder}")
    return samples


def image_problem(path: str) -> str | None:
    """Why PIL cannot open `path` (None when it can): header, format and, for PNG, chunk checksums."""
    try:
        with Image.open(path) as image:
            image.verify()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def readable_samples(samples: list[tuple[str, int]], what: str, skip_bad: bool) -> list[tuple[str, int]]:
    """`samples` whose files open; an unreadable one is an error naming it, or with `skip_bad` left out
    and counted in one line on stderr. `what` names the task and split in messages."""
    # threads: verify is file reading and checksums, mostly outside the GIL
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        problems = list(pool.map(image_problem, [path for path, _ in samples]))
    bad = [(path, problem) for (path, _), problem in zip(samples, problems) if problem is not None]
    if not bad:
        return samples
    first = f"{bad[0][0]}: {bad[0][1]}"
    if not skip_bad:
        raise MimaError(f"{what}: {len(bad)} of {len(samples)} image files cannot be opened (first: {first}); "
                        "remove them or set bad_images: skip")
    print(f"{what}: leaving out {len(bad)} of {len(samples)} image files that cannot be opened (first: {first})",
          file=sys.stderr)
    return [sample for sample, problem in zip(samples, problems) if problem is None]
