"""Reading and writing state dicts as safetensors files, atomically and with clear errors."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mima.core.errors import MimaError
from mima.core.files import atomic_path

StateDict = dict[str, torch.Tensor]


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
