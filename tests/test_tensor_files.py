"""The streaming safetensors reader accepts exactly what the safetensors library accepts (hostile headers
included) and reads the same tensors."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mima.core.errors import MimaError
from mima.core.tensor_files import SafetensorsReader


def _file(path, header: object, data: bytes, raw_header: bytes | None = None):
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def _f32(shape, start, end):
    return {"dtype": "F32", "shape": shape, "data_offsets": [start, end]}


HOSTILE = {
    "overlapping ranges": ({"a": _f32([2], 0, 8), "b": _f32([2], 4, 12)}, 12),
    "one range, two names": ({"a": _f32([2], 0, 8), "b": _f32([2], 0, 8)}, 8),
    "negative offset": ({"a": _f32([2], -4, 4)}, 8),
    "gap": ({"a": _f32([1], 0, 4), "b": _f32([1], 8, 12)}, 12),
    "trailing bytes": ({"a": _f32([2], 0, 8)}, 12),
    "float offsets": ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]}}, 8),
    "negative shape": ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, 8),
    "huge shape": ({"a": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 8]}}, 8),
    "header is a list": ([1, 2, 3], 0),
    "header is a string": ("tensor", 0),
    "unknown dtype": ({"a": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}}, 8),
    "metadata not strings": ({"__metadata__": {"x": 1}, "a": _f32([2], 0, 8)}, 8),
    "truncated data": ({"a": _f32([4], 0, 16)}, 8),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers_are_refused_like_the_safetensors_library(tmp_path, case):
    header, data_size = HOSTILE[case]
    path = _file(tmp_path / "x.safetensors", header, bytes(data_size))
    with pytest.raises(Exception):  # the reference: the library refuses the file
        with safe_open(str(path), framework="pt") as library:
            for key in library.keys():
                library.get_tensor(key)
    with pytest.raises(MimaError, match=str(path)):
        with SafetensorsReader(path) as reader:
            for key in reader:
                reader[key]


def test_deeply_nested_header_is_refused(tmp_path):
    path = _file(tmp_path / "x.safetensors", None, b"", raw_header=b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(MimaError, match="not JSON|not an object"):
        SafetensorsReader(path)


def test_files_of_the_library_read_back_the_same_tensors(tmp_path):
    tensors = {"w": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "empty": torch.zeros(0, 4),
               "h": torch.randn(2, 2).to(torch.bfloat16), "flag": torch.tensor([True, False])}
    save_file(tensors, str(tmp_path / "lib.safetensors"), metadata={"note": "x"})
    with SafetensorsReader(tmp_path / "lib.safetensors") as reader:
        assert set(reader) == set(tensors) and reader.metadata == {"note": "x"}
        for key, value in tensors.items():
            assert reader[key].dtype == value.dtype and torch.equal(reader[key], value), key
