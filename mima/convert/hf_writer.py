"""Writing a transformers CLIP vision tower: a weights file, or a folder like save_pretrained's.

`mima convert --to hf-clip` writes what mima.convert.hf_conversion computed. The folder is usable
by `transformers` (`CLIPVisionModelWithProjection.from_pretrained`), which is needed only to load
it: `pip install 'mima[hf]'`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from mima.convert.hf_conversion import HF_CONFIG, HF_WEIGHTS
from mima.core.errors import MimaError
from mima.core.files import atomic_path, refuse_overwrite


def _save_hf_weights(path: Path, state: dict[str, torch.Tensor], provenance: dict[str, str]) -> None:
    """safetensors as transformers reads it: its loader requires the header's `format` to be 'pt'
    (plain strings, not the JSON-encoded values of save_state_dict)."""
    from safetensors.torch import save_file

    tensors = {key: value.detach().to("cpu").contiguous() for key, value in state.items()}
    save_file(tensors, str(path), metadata={"format": "pt", **provenance})


def write_hf_output(output: Path, state: dict, config: dict, provenance: dict[str, str], overwrite: bool) -> list[Path]:
    """A .safetensors output gets the weights alone; any other name is a folder like save_pretrained's
    (config.json + model.safetensors). A new folder appears whole (written beside it, then renamed);
    into an existing one, each file is replaced atomically, the weights before the config."""
    if output.suffix == ".safetensors":
        with atomic_path(output, overwrite=overwrite) as tmp:
            _save_hf_weights(tmp, state, provenance)
        return [output]
    files = [output / HF_WEIGHTS, output / HF_CONFIG]
    config_text = json.dumps(config, indent=2) + "\n"
    if output.exists() and not output.is_dir():
        raise MimaError(f"--output {output}: is a file; give a folder name (or a .safetensors file name for the weights alone)")
    if output.is_dir():
        if not overwrite:
            refuse_overwrite(files)
        with atomic_path(files[0]) as tmp:
            _save_hf_weights(tmp, state, provenance)
        with atomic_path(files[1]) as tmp:
            tmp.write_text(config_text)
        return files
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent))
    except OSError as exc:
        raise MimaError(f"--output {output}: cannot be written ({exc.strerror or exc})") from None
    try:
        _save_hf_weights(staging / HF_WEIGHTS, state, provenance)
        (staging / HF_CONFIG).write_text(config_text)
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes 0700; give the folder the usual permissions
        os.rename(staging, output)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return files


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current
