"""Reading the publishers' archives (zip, tar, tar.gz/tgz, rar) file by file, and placing a
prepared folder all at once.

A tar archive is read as a stream, front to back, once: SUN397.tar.gz is 37 GB and a seek in a
gzip stream restarts it from the beginning. A damaged or truncated archive is one MimaError naming
the file and where it comes from; errors of the disk being written are not mistaken for it.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import lzma
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO

from mima.core.errors import MimaError
from mima.core.files import place_noreplace
from mima.core.publish import remove_folders, stage_folder

# What a damaged, truncated or mislabelled archive raises while it is read (never a write error:
# gzip.BadGzipFile is the one OSError among them).
ARCHIVE_ERRORS = (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, gzip.BadGzipFile, lzma.LZMAError)
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
RAR_TOOLS = (("unrar", ("x", "-idq", "-o+")), ("7z", ("x", "-y", "-bd")), ("bsdtar", ("-x", "-f")))


@contextlib.contextmanager
def damaged_archive(path: Path, source: str) -> Iterator[None]:
    """Turn a read error of the archive at `path` into one line naming it and `source`."""
    try:
        yield
    except ARCHIVE_ERRORS as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise MimaError(f"{path}: damaged or incomplete archive ({reason}); download it again from {source}") from None


def safe_parts(name: str) -> tuple[str, ...]:
    """The parts of a member name, or () for names that would leave the folder they are read into
    (absolute, '..') or name no file."""
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if not parts or parts[0] == "/" or ".." in parts:
        return ()
    return tuple(part for part in parts if part != ".")


def archive_files(path: Path, source: str) -> Iterator[tuple[str, IO[bytes]]]:
    """(member name, open file) of every regular file in the archive at `path`, in archive order.
    The open file is readable until the next item. Read errors become `damaged_archive`'s line
    (the caller reads the files, so it wraps its loop in `damaged_archive` too)."""
    name = path.name.lower()
    with damaged_archive(path, source):
        if name.endswith(".zip"):
            with zipfile.ZipFile(path) as archive:
                for info in archive.infolist():
                    if not info.is_dir():
                        with archive.open(info) as stream:
                            yield info.filename, stream
        elif name.endswith(TAR_SUFFIXES):
            with _decompressed(path) as stream:
                with tarfile.open(fileobj=stream, mode="r|") as archive:
                    yield from tar_files(archive)
                # tarfile takes a cut-off stream for the archive's end; reading the compressed
                # stream to its end checks its length and checksum (EOFError, BadGzipFile)
                while stream.read(1 << 20):
                    pass
        elif name.endswith(".rar"):
            yield from _rar_files(path, source)
        else:
            raise MimaError(f"{path}: not an archive mima reads (zip, tar, tar.gz, tgz, rar)")


def _decompressed(path: Path) -> IO[bytes]:
    name = path.name.lower()
    if name.endswith((".gz", ".tgz")):
        return gzip.open(path, "rb")
    if name.endswith(".bz2"):
        return bz2.open(path, "rb")
    if name.endswith(".xz"):
        return lzma.open(path, "rb")
    return open(path, "rb")


def tar_files(archive: tarfile.TarFile) -> Iterator[tuple[str, IO[bytes]]]:
    for member in archive:
        if member.isfile():
            stream = archive.extractfile(member)
            if stream is not None:
                yield member.name, stream


def nested_tar_files(stream: IO[bytes]) -> Iterator[tuple[str, IO[bytes]]]:
    """The files of a tar archive inside another archive (FER2013's fer2013.tar.gz in Kaggle's zip)."""
    with tarfile.open(fileobj=stream, mode="r|*") as archive:
        yield from tar_files(archive)


def _rar_files(path: Path, source: str) -> Iterator[tuple[str, IO[bytes]]]:
    """Python reads no rar: an installed unrar, 7z or bsdtar unpacks it into a temporary folder
    beside the archive, whose files are then read in name order."""
    tool = next(((program, arguments) for program, arguments in RAR_TOOLS if shutil.which(program)), None)
    if tool is None:
        raise MimaError(f"{path}: reading a .rar needs unrar, 7z or bsdtar on the PATH (none found); "
                        f"install one, or unpack it and pack the folder as a .zip of the same name")
    program, arguments = tool
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=path.parent) as unpacked:
        command = [program, *arguments, str(path.resolve())] + (["-C", unpacked] if program == "bsdtar" else [])
        if program == "7z":
            command.append(f"-o{unpacked}")
        elif program == "unrar":
            command.append(unpacked + os.sep)
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            reason = " ".join((done.stderr or done.stdout).split())[:200]
            raise MimaError(f"{path}: damaged or incomplete archive ({program}: {reason}); download it again from {source}")
        for file in sorted(p for p in Path(unpacked).rglob("*") if p.is_file()):
            with open(file, "rb") as stream:
                yield file.relative_to(unpacked).as_posix(), stream


def copy_to(stream: IO[bytes], destination: Path) -> None:
    destination.parent.mkdir(parents=True, exist_ok=True)
    with open(destination, "wb") as out:
        shutil.copyfileobj(stream, out, length=1 << 20)


@contextlib.contextmanager
def staged_folder(target: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary folder beside `target` to prepare it in; renamed onto `target` only when the
    block succeeds (an existing `target` is replaced only with `overwrite`). A failure or a signal
    leaves neither the temporary folder nor a partial `target`."""
    staging, created = stage_folder(target)
    try:
        yield staging
        # mkdtemp makes it private: give it the permissions of the data folder it is placed in
        staging.chmod(stat.S_IMODE(target.parent.stat().st_mode))
        if overwrite and (target.exists() or target.is_symlink()):
            aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".old", dir=target.parent))
            os.replace(target, aside)  # an empty folder is replaced by the rename
            try:
                place_noreplace(staging, target)
            except BaseException:
                os.replace(aside, target)
                raise
            shutil.rmtree(aside, ignore_errors=True)
        else:
            place_noreplace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        remove_folders(created)
        raise
