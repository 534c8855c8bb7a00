"""Reading and writing state dicts as safetensors files, atomically and with clear errors."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mima.errors import MimaError

StateDict = dict[str, torch.Tensor]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it onto `path` only if the block succeeds.

    A crash mid-write leaves the previous file (if any) untouched, and a failed write leaves
    nothing behind. With `overwrite=False` an existing file is an error, raised before any work.
    """
    target = Path(path)
    if not overwrite and target.exists():
        raise MimaError(f"{target}: already exists (pass --overwrite to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual permissions
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json_atomic(path: str | os.PathLike, obj: object) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def save_state_dict(
    path: str | os.PathLike,
    state_dict: Mapping[str, torch.Tensor],
    metadata: Mapping[str, object] | None = None,
    overwrite: bool = True,
) -> None:
    """Save tensors as safetensors (contiguous copies, so views and shared storage are fine).

    `metadata` values are stored JSON-encoded in the file header.
    """
    tensors = {key: value.detach().to("cpu").contiguous().clone() for key, value in state_dict.items()}
    header = {key: json.dumps(value) for key, value in (metadata or {}).items()}
    with atomic_path(path, overwrite=overwrite) as tmp:
        save_file(tensors, str(tmp), metadata=header)


def load_state_dict(path: str | os.PathLike, device: str = "cpu") -> StateDict:
    """Load every tensor of a safetensors file; a missing or unreadable file is a MimaError."""
    file = Path(path)
    if not file.is_file():
        raise MimaError(f"{file}: no such file")
    try:
        with safe_open(str(file), framework="pt", device=device) as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise MimaError(f"{file}: not a readable safetensors file ({exc})") from None


def read_metadata(path: str | os.PathLike) -> dict[str, object]:
    """The JSON-decoded metadata written by `save_state_dict`."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            raw = handle.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise MimaError(f"{path}: not a readable safetensors file ({exc})") from None
    return {key: json.loads(value) for key, value in raw.items()}
