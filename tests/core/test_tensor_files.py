"""The streaming safetensors reader (the safetensors library underneath) refuses what the library refuses
with a one-line MimaError, reads the same tensors in the file's order, hands out tensors the caller owns
(not views into the library's memory map of the file), and the writer's files load with the library.
Also the merge engine's finite check, which runs on every tensor read."""

from __future__ import annotations

import gc
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mima.core.errors import MimaError
from mima.core.tensor_files import SafetensorsReader, SafetensorsWriter
from mima.merging.common import all_finite


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


def _one_line_refusal(path: Path) -> str:
    with pytest.raises(MimaError) as refused:
        with SafetensorsReader(path) as reader:
            for key in reader:
                reader[key]
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers_are_refused_like_the_safetensors_library(tmp_path, case):
    header, data_size = HOSTILE[case]
    path = _file(tmp_path / "x.safetensors", header, bytes(data_size))
    with pytest.raises(Exception):  # the reference: the library refuses the file
        with safe_open(str(path), framework="pt") as library:
            for key in library.keys():
                library.get_tensor(key)
    message = _one_line_refusal(path)
    assert "(safetensors: " in message  # the library's reason, wrapped with the file name
    assert "needs 0 bytes" not in message  # (carried over from the `mima merge` copy of this check)


def test_deeply_nested_header_is_refused(tmp_path):
    path = _file(tmp_path / "x.safetensors", None, b"", raw_header=b"[" * 100_000 + b"]" * 100_000)
    assert "not a safetensors file" in _one_line_refusal(path)


def test_garbage_and_cut_files_say_what_they_are(tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00\x01 not a tensor file")
    assert _one_line_refusal(garbage).startswith(f"{garbage}: not a safetensors file")
    whole = tmp_path / "whole.safetensors"
    save_file({"w": torch.ones(64)}, str(whole))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(whole.read_bytes()[:-100])
    assert _one_line_refusal(cut).startswith(f"{cut}: truncated")
    assert _one_line_refusal(tmp_path / "absent.safetensors") == f"{tmp_path / 'absent.safetensors'}: no such file"


def test_a_dtype_the_library_knows_but_mima_does_not_is_named(tmp_path):
    path = _file(tmp_path / "x.safetensors", {"z": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8))
    with safe_open(str(path), framework="pt") as library:  # the library itself reads it
        assert library.get_tensor("z").dtype == torch.complex64
    message = _one_line_refusal(path)
    assert "tensor 'z' has dtype C64" in message


def test_files_of_the_library_read_back_the_same_tensors(tmp_path):
    tensors = {"w": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "empty": torch.zeros(0, 4),
               "h": torch.randn(2, 2).to(torch.bfloat16), "flag": torch.tensor([True, False]),
               "u": torch.tensor([0, 65535], dtype=torch.uint16)}
    save_file(tensors, str(tmp_path / "lib.safetensors"), metadata={"note": "x"})
    with SafetensorsReader(tmp_path / "lib.safetensors") as reader:
        assert set(reader) == set(tensors) and len(reader) == 6 and reader.metadata == {"note": "x"}
        for key, value in tensors.items():
            info = reader.infos[key]
            assert (info.shape, info.dtype, info.numel) == (value.shape, value.dtype, value.numel()), key
            assert reader[key].dtype == value.dtype and torch.equal(reader[key], value), key
        with pytest.raises(KeyError):
            reader["missing"]
    with pytest.raises(MimaError, match="after the file was closed"):
        reader["w"]


def test_keys_come_in_the_order_of_their_data(tmp_path):
    """The header lists 'a' first but its data lies after 'c''s and 'b''s: the file's order is c, b, a."""
    header = {"a": _f32([1], 8, 12), "b": _f32([1], 4, 8), "c": _f32([1], 0, 4)}
    path = _file(tmp_path / "x.safetensors", header, struct.pack("<3f", 3.0, 2.0, 1.0))
    with SafetensorsReader(path) as reader:
        assert list(reader) == ["c", "b", "a"] and list(reader.infos) == ["c", "b", "a"]
        assert [reader[key].item() for key in reader] == [3.0, 2.0, 1.0]


def test_the_writers_files_load_with_the_library(tmp_path):
    order = ["z.weight", "a.bias", "m.count", "e.empty", "h.half"]
    tensors = {"z.weight": torch.randn(4, 3), "a.bias": torch.randn(5).double(), "m.count": torch.tensor([3, -1], dtype=torch.int32),
               "e.empty": torch.zeros(2, 0), "h.half": torch.randn(3).to(torch.bfloat16)}
    path = tmp_path / "out.safetensors"
    specs = [(key, tensors[key].shape, tensors[key].dtype) for key in order]
    with SafetensorsWriter(path, specs, metadata={"method": "ties", "lam": 0.5}) as writer:
        for key in order:
            writer.write(key, tensors[key])
    with safe_open(str(path), framework="pt") as library:
        assert library.offset_keys() == order  # the data lie in the order written
        assert library.metadata() == {"method": '"ties"', "lam": "0.5"}  # values JSON-encoded
        for key in order:
            assert torch.equal(library.get_tensor(key), tensors[key]), key
    header_length = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert (8 + header_length) % 8 == 0  # the data start 8-byte aligned


def test_a_file_cut_short_after_opening_is_refused_not_a_crash(tmp_path):
    """The library maps the file: touching a page past a shortened end would kill the process (SIGBUS)."""
    path = tmp_path / "x.safetensors"
    save_file({"first": torch.ones(4096), "second": torch.ones(4096)}, str(path))
    with SafetensorsReader(path) as reader:
        os.truncate(path, path.stat().st_size // 2)
        with pytest.raises(MimaError, match="truncated while being read"):
            reader[list(reader)[-1]]


def test_a_file_removed_or_replaced_after_opening_still_reads_as_opened(tmp_path):
    """The mapping holds the opened inode: a new, shorter file under the same name is not a cut one."""
    path = tmp_path / "x.safetensors"
    save_file({"w": torch.arange(4.0)}, str(path))
    with SafetensorsReader(path) as reader:
        path.unlink()
        assert torch.equal(reader["w"], torch.tensor([0.0, 1.0, 2.0, 3.0]))
        save_file({"w": torch.zeros(1)}, str(path))
        assert torch.equal(reader["w"], torch.tensor([0.0, 1.0, 2.0, 3.0]))


FINITE_CASES = {
    "plain": torch.randn(1000),
    "nan in the middle": torch.randn(1000).index_fill_(0, torch.tensor([517]), float("nan")),
    "inf at the end": torch.randn(4097).index_fill_(0, torch.tensor([4096]), float("inf")),
    "-inf first": torch.randn(33).index_fill_(0, torch.tensor([0]), -float("inf")),
    "both infinities (sum NaN)": torch.tensor([float("inf"), 1.0, -float("inf")]),
    "float32 sum overflows, entries finite": torch.full((4,), 3e38),
    "float16 sum overflows, entries finite": torch.full((10,), 6e4, dtype=torch.float16),
    "bfloat16 nan": torch.tensor([1.0, float("nan")], dtype=torch.bfloat16),
    "non-contiguous with nan": torch.randn(6, 5).index_fill_(0, torch.tensor([4]), float("nan")).t(),
    "empty": torch.zeros(0, 3),
    "integers": torch.arange(5),
}


@pytest.mark.parametrize("case", sorted(FINITE_CASES))
def test_the_read_paths_finite_check_agrees_with_an_entry_by_entry_check(case):
    """The engine checks every tensor it reads (and writes) with a one-pass sum; Python's math.isfinite
    on every entry is the reference, overflowing sums of finite entries included."""
    tensor = FINITE_CASES[case]
    expected = all(math.isfinite(value) for value in tensor.double().reshape(-1).tolist())
    assert all_finite(tensor) is expected


def _anonymous_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssAnon from Linux's /proc")
def test_tensors_read_are_the_callers_own_and_reading_holds_only_what_the_caller_keeps(tmp_path):
    """Measured in a fresh interpreter: inside the test session, memory that earlier tests freed can
    be handed out again without RssAnon growing (seen in the full suite), which would hide the copies."""
    code = ("import sys; from pathlib import Path; from tests.core.test_tensor_files import _check_reads_hold_only_kept; "
            "_check_reads_hold_only_kept(Path(sys.argv[1]))")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=Path(__file__).resolve().parents[2],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def _check_reads_hold_only_kept(tmp_path: Path) -> None:
    """T = 3 files of two 36 MiB tensors, read key by key and changed in place (as a merge may do).

    Views into the library's private mapping would turn every changed page into an anonymous
    copy-on-write page that lives as long as the mapping: 6 x 36 MiB after the loop. Tensors of
    their own hold T x 36 MiB while the caller keeps them and nothing after. (Blocks this large are
    mmap-ed by malloc and given back to the kernel when freed, so RssAnon follows them.)"""
    elements = 9 * 2**20
    size = elements * 4
    paths = []
    for index in range(3):
        paths.append(tmp_path / f"m{index}.safetensors")
        save_file({"k0": torch.full((elements,), float(index)), "k1": torch.full((elements,), 10.0 + index)}, str(paths[-1]))
    readers = [SafetensorsReader(path) for path in paths]
    try:
        gc.collect()
        start = _anonymous_bytes()
        while_kept = []
        for key, offset in (("k0", 0.0), ("k1", 10.0)):
            kept = [reader[key] for reader in readers]
            for tensor in kept:
                tensor.add_(1.0)  # the caller's own change
            while_kept.append(_anonymous_bytes() - start)
            for tensor in kept[1:]:
                kept[0].add_(tensor)
            assert kept[0][::4096].eq(3 * offset + 6).all()  # offset + i + 1 summed over i = 0, 1, 2
            del kept, tensor
        gc.collect()
        after = _anonymous_bytes() - start
        for held in while_kept:
            assert 3 * size - 8 * 2**20 <= held <= 3 * size + 16 * 2**20, [h / 2**20 for h in while_kept]
        assert after <= size // 2, after / 2**20
        # the files are unchanged by the caller's changes; a tensor still held does not hold the mapping
        held_over = readers[2]["k1"]
        assert held_over[::4096].eq(12.0).all()
    finally:
        for reader in readers:
            reader.close()
    mapped = Path("/proc/self/maps").read_text()
    assert not any(str(path) in mapped for path in paths) and held_over[-1].item() == 12.0
