"""Streaming access to safetensors files: read one tensor at a time, write one tensor at a time.

`safetensors.safe_open` maps the whole file into memory; every page a merge touches then stays in
the process's resident set, so merging T models would hold T models' worth of pages. The reader
here parses the header itself and reads each tensor with plain file reads into a fresh buffer, so
memory holds only the tensors the caller keeps. The writer knows every output tensor's shape and
dtype up front (a merge preserves them), writes the header first and then each tensor as it is
produced, into a temporary file renamed into place at the end (nothing partial is left on error).
Both follow the safetensors format: an 8-byte little-endian header length, a JSON header with
dtype, shape and data offsets per tensor, then the raw little-endian data.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mima.core.errors import MimaError
from mima.core.files import atomic_path

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class TensorInfo:
    """What the header says about a tensor (enough to check compatibility without reading data)."""

    shape: torch.Size
    dtype: torch.dtype
    start: int
    end: int

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


class SafetensorsReader(Mapping[str, torch.Tensor]):
    """A lazy, read-only state dict backed by a safetensors file: `reader[key]` reads that tensor."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise MimaError(f"{self.path}: no such file")
        self._file = open(self.path, "rb")
        self.infos, self.metadata, self._data_start = self._read_header()

    def _read_header(self) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
        size = os.fstat(self._file.fileno()).st_size
        prefix = self._file.read(8)
        if len(prefix) < 8:
            raise MimaError(f"{self.path}: not a safetensors file (shorter than its 8-byte header length)")
        (header_length,) = struct.unpack("<Q", prefix)
        if header_length > min(MAX_HEADER, size - 8):
            raise MimaError(f"{self.path}: not a safetensors file, or truncated (header of {header_length} bytes)")
        try:
            header = json.loads(self._file.read(header_length))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise MimaError(f"{self.path}: not a safetensors file (its header is not JSON)") from None
        if not isinstance(header, dict):
            raise MimaError(f"{self.path}: not a safetensors file (its header is a JSON {type(header).__name__}, not an object)")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise MimaError(f"{self.path}: damaged header: __metadata__ must map names to strings")
        data_start, data_size = 8 + header_length, size - 8 - header_length
        infos = {key: self._entry(key, entry) for key, entry in header.items()}
        ordered = dict(sorted(infos.items(), key=lambda item: (item[1].start, item[1].end)))
        # The safetensors library's rule: the tensors tile the data exactly, in offset order, with
        # no gap, no overlap (two names for one range, or ranges that share bytes) and nothing after.
        position = 0
        for key, info in ordered.items():
            if info.start != position:
                problem = "overlaps the tensor before it" if info.start < position else f"leaves a gap at byte {position}"
                raise MimaError(f"{self.path}: damaged header: tensor '{key}' (bytes {info.start}-{info.end}) {problem}")
            position = info.end
        if position != data_size:
            what = f"truncated: the tensors need {position} bytes of data, the file has {data_size}" if position > data_size \
                else f"damaged: {data_size - position} bytes after the last tensor"
            raise MimaError(f"{self.path}: {what}")
        return ordered, metadata, data_start

    def _entry(self, key: str, entry: object) -> TensorInfo:
        """One header entry, checked: a known dtype, a shape of whole numbers >= 0, two whole offsets
        that hold exactly the shape's bytes (sizes in Python integers, which cannot overflow)."""
        def whole(values: object, count: int | None = None) -> bool:
            return (isinstance(values, list) and (count is None or len(values) == count)
                    and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values))

        if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES or not whole(entry.get("shape")) \
                or not whole(entry.get("data_offsets"), 2):
            raise MimaError(f"{self.path}: damaged header entry for tensor '{key}' (expected a known dtype, a shape "
                            "and two data offsets of whole numbers >= 0)")
        dtype, shape, (start, end) = DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
        needed = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - start != needed:
            raise MimaError(f"{self.path}: damaged: tensor '{key}' holds {end - start} bytes, its shape {shape} needs {needed}")
        return TensorInfo(torch.Size(shape), dtype, start, end)

    def __getitem__(self, key: str) -> torch.Tensor:
        info = self.infos[key]
        buffer = torch.empty(info.end - info.start, dtype=torch.uint8)
        self._file.seek(self._data_start + info.start)
        if self._file.readinto(memoryview(buffer.numpy())) != info.end - info.start:
            raise MimaError(f"{self.path}: truncated while reading tensor '{key}'")
        return buffer.view(info.dtype).reshape(info.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def __len__(self) -> int:
        return len(self.infos)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
