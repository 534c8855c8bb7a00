"""Streaming access to safetensors files: read one tensor at a time, write one tensor at a time.

Reading never maps a file into memory. The header is checked by the safetensors library
(`safe_open`, closed again at once: offsets that tile the data exactly, no overlap, sizes without
overflow, known dtypes, string metadata); each tensor's bytes are then read with plain reads
(`os.preadv`) from the file descriptor opened first, into a tensor the caller owns alone. An input
that another program truncates or rewrites while a merge reads it therefore cannot kill the process
(a mapped page past a shortened end is SIGBUS); the reader compares the open file's size and
modification time before and after each read and refuses a file that changed with one line ("changed
while being read"). A file replaced by a rename or removed still reads as it was opened (the
descriptor holds the old inode). Reading T models one key at a time holds only the tensors the caller
keeps.

The writer knows every output tensor's shape and dtype up front (a merge preserves them), writes
the header first and then each tensor as it is produced, into a temporary file renamed into place
at the end (nothing partial is left on error). It follows the safetensors format: an 8-byte
little-endian header length, a JSON header with dtype, shape and data offsets per tensor (the
data start 8-byte aligned), then the raw little-endian data; the tests read its files back with
`safe_open`.

A merge that reads one key of every input at a time reads through a `GroupPrefetcher`: one background
thread reads the next key's tensors while the caller computes on the current ones (the reads are
`os.preadv` calls, which let go of the GIL), never more than one group ahead, and inspects each tensor
it read (the merge engine: whether it is finite) so that the caller need not.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from mima.core.errors import MimaError
from mima.core.files import atomic_path

# The format's dtype names (the library's) for the dtypes a merge computes with on the CPU or
# copies from theta_0. Not here: float8 (torch's CPU kernels cannot sum or check them), complex, and
# the sub-byte floats; a file holding one is refused with the key and the dtype named.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


def unreadable_dtype(where: str, key: str, found: str, readable: Sequence[str]) -> MimaError:
    """A tensor of a dtype no merge reads (complex, float8, ...): of a file, or of a state dict given
    in Python (mima.services.arguments), in the same words."""
    return MimaError(f"{where}: tensor '{key}' has dtype {found}; mima reads {', '.join(readable)}")


@dataclass(frozen=True)
class TensorInfo:
    """What the header says about a tensor (enough to check compatibility without reading data)."""

    shape: torch.Size
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return int(self.shape.numel())


class SafetensorsReader(Mapping[str, torch.Tensor]):
    """A lazy, read-only state dict backed by a safetensors file: `reader[key]` reads that tensor.

    Keys come in the order of their data in the file (the order the file was written in)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise MimaError(f"{self.path}: no such file")
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as error:
            raise MimaError(f"{self.path}: cannot be read ({error.strerror or error})") from None
        self._open = True
        try:
            self._identity = _identity(os.fstat(self._fd))
            try:
                # the library checks the header (it maps the file while open; no tensor data is touched)
                with safe_open(str(self.path), framework="pt") as handle:
                    self.metadata: dict[str, str] = handle.metadata() or {}
                    order = list(handle.offset_keys())
                    self.infos: dict[str, TensorInfo] = {key: self._info(handle, key) for key in order}
            except (SafetensorError, OSError, RuntimeError) as error:
                # RuntimeError: the library's size check ("smaller than the required mapping size")
                # when the file is shorter than its header says, e.g. cut by another program just now
                if self._has_changed():
                    raise self._changed("the header") from None
                raise self._refusal(error) from None
            self._offsets = self._read_offsets()
        except BaseException:
            self.close()
            raise

    def _refusal(self, error: Exception) -> MimaError:
        """The library's reason, on one line, after what it means for the user."""
        reason = " ".join(str(error).split())
        # "not fully covered": the header promises data the file does not hold (or holds more than);
        # a file cut short, the common case, says so.
        cut_short = "not fully covered" in reason or "smaller than the required" in reason
        what = "truncated, or damaged" if cut_short else "not a safetensors file, or a damaged one"
        return MimaError(f"{self.path}: {what} (safetensors: {reason})")

    def _info(self, handle, key: str) -> TensorInfo:
        view = handle.get_slice(key)  # the header's entry; reads no data
        name = view.get_dtype()
        if name not in DTYPES:
            raise unreadable_dtype(str(self.path), key, name, list(DTYPES))
        return TensorInfo(torch.Size(view.get_shape()), DTYPES[name])

    def _read_offsets(self) -> dict[str, tuple[int, int]]:
        """Each tensor's byte range in the file, from the header the library has just checked."""
        length = struct.unpack("<Q", self._pread(8, 0, "the header"))[0]
        header = json.loads(self._pread(length, 8, "the header"))
        start = 8 + length
        offsets = {}
        for key in self.infos:
            begin, end = header[key]["data_offsets"]
            offsets[key] = (start + int(begin), int(end) - int(begin))
        return offsets

    def _pread(self, size: int, offset: int, what: str) -> bytes:
        data = os.pread(self._fd, size, offset)
        if len(data) != size:
            raise self._changed(what)
        return data

    def _changed(self, what: str) -> MimaError:
        _, size, _ = _identity(os.fstat(self._fd))
        how = "truncated" if size < self._identity[1] else "changed"
        return MimaError(f"{self.path}: {how} while being read ({what}); an input must stay as it is during a merge, run it again")

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.read_job(key)()

    def read_job(self, key: str) -> Callable[[], torch.Tensor]:
        """Reading `key` in two steps: its buffer allocated now, by the calling thread, and its bytes read
        when the returned job runs (GroupPrefetcher runs it in its background thread). Buffers come from
        the allocator of the thread that allocated them, and memory freed by another thread was more
        often handed back to the system and faulted in again: a task arithmetic over 9 ViT-B/32-sized
        files took a median 475k page faults with buffers allocated by the reading thread, 270k so
        (benchmarks/README.md, "Reading ahead in streamed merges")."""
        if key not in self.infos:
            raise KeyError(key)  # as a Mapping should
        buffer = torch.empty(self._offsets[key][1], dtype=torch.uint8)
        return lambda: self._read_into(key, buffer)

    def _read_into(self, key: str, buffer: torch.Tensor) -> torch.Tensor:
        if not self._open:
            raise MimaError(f"{self.path}: read after the file was closed (tensor '{key}')")
        if self._has_changed():
            raise self._changed(f"before tensor '{key}'")
        info = self.infos[key]
        offset, size = self._offsets[key]
        view = memoryview(buffer.numpy())
        done = 0
        while done < size:  # one read returns at most about 2 GiB
            try:
                count = os.preadv(self._fd, [view[done:]], offset + done)
            except OSError as error:
                raise MimaError(f"{self.path}: cannot be read ({error.strerror or error}; tensor '{key}')") from None
            if count == 0:
                raise self._changed(f"tensor '{key}'")
            done += count
        if self._has_changed():  # rewritten while the bytes were read: they may be half old, half new
            raise self._changed(f"tensor '{key}'")
        return buffer.view(info.dtype).reshape(info.shape)

    def _has_changed(self) -> bool:
        """Whether the opened file (the descriptor's inode) has changed size or been written since it
        was opened. A file replaced by a rename or removed is not a change: the old inode is read."""
        return _identity(os.fstat(self._fd))[1:] != self._identity[1:]

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def __len__(self) -> int:
        return len(self.infos)

    def close(self) -> None:
        """Let go of the file."""
        if self._open:
            self._open = False
            os.close(self._fd)

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class GroupPrefetcher:
    """Reads ahead, in one background thread, the tensors of the key that comes next in a fixed order.

    `read(source, key)` returns `sources[source][key]`: the same tensor, owned by the caller alone,
    as a direct read gives. A *group* is one key's tensors from the sources that read the previous key
    (all of them at first): when the first read of a key arrives, that key's group (read ahead while
    the caller worked on the previous key) becomes the one served, and the next key's group is
    submitted. Each prefetched tensor is handed out once; a second read of the same tensor, a source
    the group left out, or a key out of order (a strategy's second pass, a jump) reads directly, and
    what was read ahead for another key is dropped. So memory holds at most two groups (the one served
    and the one being read), results do not depend on the timing, and nothing is read before the first
    `read`. Every call comes from one thread (the caller's); the background thread only reads, and
    runs `inspect` on each tensor it read (`read_inspected` hands the verdict over with the tensor).
    """

    def __init__(self, sources: Sequence[Mapping[str, torch.Tensor]], order: Sequence[str],
                 inspect: Callable[[torch.Tensor], object] | None = None) -> None:
        self.sources, self.order, self.inspect = list(sources), list(order), inspect
        self.position = {key: index for index, key in enumerate(self.order)}
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mima-prefetch")
        self.current: int | None = None  # the position of the key being served
        self.served: dict[int, Future] = {}  # source -> its tensor of the current key (not yet handed out)
        self.ahead: dict[int, Future] = {}  # source -> its tensor of the next key (being read)
        self.readers: set[int] = set()  # the sources that read the current key so far
        self.expected: set[int] = set(range(len(self.sources)))  # the sources read ahead for each key

    def read(self, source: int, key: str) -> torch.Tensor:
        return self.read_inspected(source, key)[0]

    def read_inspected(self, source: int, key: str) -> tuple[torch.Tensor, object]:
        """(`sources[source][key]`, what `inspect` said of it), the verdict None where the tensor was
        read directly (not ahead), or without `inspect`."""
        position = self.position[key]
        if position != self.current:
            self._move_to(position)
        self.readers.add(source)
        future = self.served.pop(source, None)
        return future.result() if future is not None else (self.sources[source][key], None)

    def _submit(self, source: int, key: str) -> Future:
        """Read `key` of `source` in the background; a source that can (SafetensorsReader.read_job) has its
        buffer allocated here, by the caller's thread, which frees it."""
        read_job = getattr(self.sources[source], "read_job", None)
        job = read_job(key) if read_job is not None else functools.partial(self.sources[source].__getitem__, key)
        return self.executor.submit(self._fetch, job)

    def _fetch(self, job: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, object]:
        """Run in the background thread."""
        tensor = job()
        return tensor, self.inspect(tensor) if self.inspect is not None else None

    def _move_to(self, position: int) -> None:
        following = self.current is not None and position == self.current + 1
        if following:  # the caller reads in order: the sources it read last time are those it will read next
            self.expected, served = self.readers, self.ahead
        else:
            self._drop(self.ahead)
            served = {}
        self._drop(self.served)  # the current group's tensors nobody asked for
        self.current, self.served, self.readers = position, served, set()
        following_key = self.order[position + 1] if position + 1 < len(self.order) else None
        self.ahead = {} if following_key is None else {
            source: self._submit(source, following_key) for source in sorted(self.expected)
        }

    @staticmethod
    def _drop(futures: dict[int, Future]) -> None:
        """Forget tensors read ahead for nothing: those not started are never read, the others are freed
        when read (an error in such a read concerns a tensor nobody asked for)."""
        for future in futures.values():
            future.cancel()
        futures.clear()

    def close(self) -> None:
        """Stop reading ahead and wait for the read in progress (before the sources close)."""
        self._drop(self.served)
        self._drop(self.ahead)
        self.executor.shutdown(wait=True)

    def __enter__(self) -> GroupPrefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _identity(stat: os.stat_result) -> tuple[tuple[int, int], int, int]:
    """(device, inode), size and modification time: which file a descriptor holds, and its state."""
    return (stat.st_dev, stat.st_ino), stat.st_size, stat.st_mtime_ns


class SafetensorsWriter:
    """Write tensors one by one, in the order given, to a safetensors file (atomically)."""

    def __init__(
        self,
        path: str | os.PathLike,
        specs: Sequence[tuple[str, torch.Size, torch.dtype]],
        metadata: Mapping[str, object] | None = None,
        overwrite: bool = False,
    ) -> None:
        self.path, self.overwrite = Path(path), overwrite
        header: dict[str, object] = {}
        if metadata:
            header["__metadata__"] = {key: json.dumps(value) for key, value in metadata.items()}
        offset = 0
        self._expected: list[tuple[str, torch.Size, torch.dtype]] = []
        for key, shape, dtype in specs:
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[key] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
            self._expected.append((key, torch.Size(shape), dtype))
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self._header = struct.pack("<Q", len(encoded)) + encoded
        self._written = 0

    def __enter__(self) -> SafetensorsWriter:
        self._atomic = atomic_path(self.path, overwrite=self.overwrite)  # refuses before anything is written
        self._temporary = self._atomic.__enter__()
        self._file = open(self._temporary, "wb")
        self._file.write(self._header)
        return self

    def write(self, key: str, tensor: torch.Tensor) -> None:
        if self._written >= len(self._expected):
            raise RuntimeError(f"tensor '{key}' is one more than the header announced")
        expected_key, shape, dtype = self._expected[self._written]
        if key != expected_key or tensor.shape != shape or tensor.dtype != dtype:
            raise RuntimeError(
                f"expected tensor '{expected_key}' {tuple(shape)} {dtype}, got '{key}' {tuple(tensor.shape)} {tensor.dtype}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._written += 1

    def __exit__(self, exc_type, exc, traceback) -> None:
        complete = exc_type is None and self._written == len(self._expected)
        self._file.close()
        if complete:
            self._atomic.__exit__(None, None, None)  # fsync, then rename onto the target
            return
        stopped = exc if exc is not None else RuntimeError(
            f"the merge stopped before tensor '{self._expected[self._written][0]}'"
        )
        self._atomic.__exit__(type(stopped), stopped, traceback)  # removes the temporary file
        if exc_type is None:
            raise stopped
