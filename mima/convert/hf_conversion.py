"""open_clip image encoders <-> Hugging Face `transformers` CLIP vision towers: reading either side
from disk and converting it in memory.

This is how FusionBench publishes its task models (e.g. tanganke/clip-vit-base-patch32_<task>).
The conversion is a pure renaming of tensors (the table, the shape checks and the choice of
architecture are mima.models.hf_clip's); this module finds and reads the files: a save_pretrained
folder (config.json with model.safetensors, a sharded model.safetensors index, or
pytorch_model.bin read through mima.convert.pickle_reader's restricted unpickler), a bare weights
file, or an open_clip state dict. It never imports `transformers` nor runs code from the
checkpoint; writing a transformers model is mima.convert.hf_writer's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mima.convert.pickle_reader import load_restricted, module_state_dict
from mima.core.errors import MimaError
from mima.core.bounded_json import read_json
from mima.core.safetensors_io import load_state_dict
from mima.models.hf_clip import (
    HF_PROJECTION,
    HFVisionConfig,
    OpenClipArchitecture,
    check_hf_config,
    choose_architecture,
    hf_config_dict,
    hf_geometry,
    hf_to_open_clip,
    open_clip_geometry,
    open_clip_to_hf,
    parse_hf_config,
)

# The files of a save_pretrained folder (what is read here and what mima.convert.hf_writer writes).
HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
HF_PICKLED_WEIGHTS = "pytorch_model.bin"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


@dataclass
class HFCheckpoint:
    """A transformers CLIP checkpoint as read: its tensors, its config (None for a bare weights file)
    and the files it was read from (so that none of them is ever chosen as an output)."""

    state: dict[str, torch.Tensor]
    config: HFVisionConfig | None
    files: list[Path]


def read_tensor_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or of a pickled state dict (pytorch_model.bin) read with
    the restricted unpickler (mima.convert.pickle_reader)."""
    if not path.is_file():
        raise MimaError(f"{path}: no such file")
    if path.suffix in PICKLE_SUFFIXES:
        state = module_state_dict(load_restricted(path), source=path)
        if not state:
            raise MimaError(f"{path}: holds no tensor state dict")
        return state
    return load_state_dict(path)


def _index_shards(index_path: Path) -> dict[str, Path]:
    """key -> shard file of a sharded checkpoint's index; shard names must stay inside the folder."""
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise MimaError(f"{index_path}: has no 'weight_map' of tensor names to files")
    shards = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise MimaError(f"{index_path}: shard {name!r} of '{key}' is not a file name in the same folder")
        shards[key] = index_path.parent / name
    return shards


def hf_checkpoint_files(source: Path) -> tuple[Path | None, list[Path]]:
    """config.json (None for a bare file) and the weight files that `read_hf_checkpoint` reads."""
    if source.is_file():
        return None, [source]
    if not source.is_dir():
        raise MimaError(f"{source}: no such file or folder")
    config = source / HF_CONFIG
    if not config.is_file():
        raise MimaError(f"{source}: has no {HF_CONFIG} (expected a folder written by save_pretrained; "
                        "for a bare weights file give the file itself)")
    if (source / HF_WEIGHTS).is_file():
        return config, [source / HF_WEIGHTS]
    if (source / HF_INDEX).is_file():
        return config, [source / HF_INDEX, *sorted(set(_index_shards(source / HF_INDEX).values()))]
    if (source / HF_PICKLED_WEIGHTS).is_file():
        return config, [source / HF_PICKLED_WEIGHTS]
    raise MimaError(f"{source}: has no {HF_WEIGHTS}, {HF_INDEX} or {HF_PICKLED_WEIGHTS} (no weights in the folder)")


def read_hf_checkpoint(source: Path) -> HFCheckpoint:
    """A save_pretrained folder (config.json with model.safetensors, a sharded model.safetensors
    index, or pytorch_model.bin) or a bare weights file."""
    config_path, files = hf_checkpoint_files(source)
    config = parse_hf_config(read_json(config_path), str(config_path)) if config_path is not None else None
    if files[0].name == HF_INDEX:  # each tensor from the shard the index names, as transformers reads it
        shard_of = _index_shards(files[0])
        shards = {shard: read_tensor_file(shard) for shard in files[1:]}
        state = {}
        for key, shard in shard_of.items():
            if key not in shards[shard]:
                raise MimaError(f"{files[0]}: '{key}' is not in its shard {shard.name}")
            state[key] = shards[shard][key]
    else:
        state = read_tensor_file(files[0])
    return HFCheckpoint(state, config, ([config_path] if config_path else []) + files)


def read_projection(path: Path) -> torch.Tensor:
    """The image projection (open_clip layout, width x embed_dim) of the pretrained CLIP: from a
    transformers checkpoint (visual_projection.weight, transposed) or an open_clip state dict (proj,
    or visual.proj of a whole CLIP)."""
    state = read_hf_checkpoint(path).state if path.is_dir() else read_tensor_file(path)
    if HF_PROJECTION in state:
        return state[HF_PROJECTION].t().contiguous()
    for key in ("proj", "visual.proj"):
        if key in state:
            return state[key]
    raise MimaError(f"{path}: has no '{HF_PROJECTION}' nor 'proj' (expected the pretrained CLIP: a transformers "
                    "CLIPModel or CLIPVisionModelWithProjection, or an open_clip image-encoder state dict)")


@dataclass
class HFConversion:
    state: dict[str, torch.Tensor]
    architecture: OpenClipArchitecture
    activation: str | None  # None: a bare file, nothing says (OpenAI's weights use quick_gelu)
    inputs: list[Path]


def convert_from_hf_clip(source: Path, arch: str | None = None, projection_from: Path | None = None,
                         activation: str | None = None) -> HFConversion:
    """open_clip's `model.visual.state_dict()` from a transformers CLIP checkpoint (see the module
    docstring); the architecture is `arch`, checked against the weights, or the known one they fit."""
    checkpoint = read_hf_checkpoint(source)
    geometry = hf_geometry(checkpoint.state, str(source))
    if checkpoint.config is not None:
        geometry = check_hf_config(checkpoint.config, geometry, str(source / HF_CONFIG))
        if activation is not None and activation != checkpoint.config.hidden_act:
            raise MimaError(f"--activation {activation}: {source / HF_CONFIG} says hidden_act '{checkpoint.config.hidden_act}'")
        activation = checkpoint.config.hidden_act
    projection = read_projection(projection_from) if projection_from is not None else None
    state = hf_to_open_clip(checkpoint.state, str(source), projection)
    converted = open_clip_geometry(state, str(source))  # embed_dim known now, also for a borrowed projection
    architecture = choose_architecture(replace(converted, heads=geometry.heads), str(source), arch)
    if activation is None and architecture.quick_gelu:
        activation = "quick_gelu"
    inputs = checkpoint.files + ([projection_from] if projection_from is not None else [])
    return HFConversion(state, architecture, activation, inputs)


def read_open_clip_state(source: Path) -> dict[str, torch.Tensor]:
    """An open_clip image-encoder state dict (keys of `model.visual.state_dict()`), or the image
    tower of a whole open_clip CLIP (keys under visual.)."""
    if source.suffix in PICKLE_SUFFIXES:
        raise MimaError(f"{source}: a pickled checkpoint; turn it into safetensors first (mima convert {source} OUT.safetensors)")
    state = load_state_dict(source)
    if "class_embedding" not in state and "visual.class_embedding" in state:
        state = {key[len("visual."):]: value for key, value in state.items() if key.startswith("visual.")}
    return state


def convert_to_hf_clip(source: Path, arch: str | None = None, activation: str | None = None) -> tuple[dict, dict, OpenClipArchitecture]:
    """(state dict, config.json) of a transformers CLIPVisionModelWithProjection from an open_clip
    image encoder; the head count comes from the architecture, the activation from --activation."""
    state = read_open_clip_state(source)
    architecture = choose_architecture(open_clip_geometry(state, str(source)), str(source), arch)
    if activation is None:
        if not architecture.quick_gelu:
            raise MimaError("--activation: name the activation the weights were trained with: quick_gelu (OpenAI's CLIP "
                            "weights, FusionBench's task models) or gelu (open_clip's LAION and DataComp weights)")
        activation = "quick_gelu"
    return open_clip_to_hf(state, str(source)), hf_config_dict(architecture.geometry, activation), architecture
