"""Writing a full open_clip CLIP that `open_clip.create_model_and_transforms("local-dir:DIR")` loads:
open_clip's folder layout (open_clip_config.json + open_clip_model.safetensors, the Hugging Face hub
layout of open_clip's own models) with a model card (README.md, mima.convert.model_card).

An image encoder of mima (a merge, a fine-tuned task model) holds the image tower only. The rest of
the CLIP (text tower, logit scale) is the run's, built exactly as `mima fit` built it (load_clip of the
run's model.clip, model.pretrained and model.quick_gelu), so the exported model's zero-shot heads are
the run's heads. The activation the model was built with is written into the config (`quick_gelu`):
open_clip builds most architectures with GELU, and a CLIP trained with QuickGELU and rebuilt with
GELU loads without complaint and is silently another network.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import open_clip
import torch
from open_clip.transformer import QuickGELU
from torch import nn

from mima.config.run_config import RunConfig, load_run_config
from mima.core.cache_dir import cache_dir_or_default
from mima.core.errors import MimaError
from mima.core.bounded_json import read_json
from mima.core.publish import atomic_folder
from mima.models.clip import EMBEDDED_PREFIX, LOCAL_DIR_PREFIX, LoadedClip, effective_pretrained, load_clip

# open_clip's names for the folder's files (open_clip.constants.HF_CONFIG_NAME, HF_SAFE_WEIGHTS_NAME)
OPEN_CLIP_CONFIG = "open_clip_config.json"
OPEN_CLIP_WEIGHTS = "open_clip_model.safetensors"
MODEL_CARD = "README.md"
OPEN_CLIP_FILES = (OPEN_CLIP_CONFIG, OPEN_CLIP_WEIGHTS, MODEL_CARD)
StateDict = dict[str, torch.Tensor]


@dataclass
class OpenClipExport:
    """The full CLIP's tensors, its open_clip_config.json, and what they were built from (for the card)."""

    state: StateDict
    config: dict
    clip: str  # the run's model.clip
    pretrained: str | None  # the run's model.pretrained, None where model.clip carries its weights
    quick_gelu: bool


def built_with_quick_gelu(model: nn.Module) -> bool:
    """Whether the model's MLPs use QuickGELU (what the weights need), read from the built modules."""
    return any(isinstance(module, QuickGELU) for module in model.modules())


def source_model_cfg(clip: str, cache_dir: Path) -> dict:
    """open_clip's model_cfg of the run's model.clip: an architecture's, or a local or embedded folder's."""
    if clip.startswith(EMBEDDED_PREFIX):
        from mima.models.embedded import ensure_embedded_model

        folder = ensure_embedded_model(clip[len(EMBEDDED_PREFIX):], cache_dir, progress=False)
        return dict(read_json(folder / OPEN_CLIP_CONFIG)["model_cfg"])
    if clip.startswith(LOCAL_DIR_PREFIX):
        return dict(read_json(Path(clip[len(LOCAL_DIR_PREFIX):]) / OPEN_CLIP_CONFIG)["model_cfg"])
    config = open_clip.get_model_config(clip)
    if config is None:
        raise MimaError(f"model.clip: open_clip has no config for '{clip}'")
    return dict(config)


def with_image_tower(loaded: LoadedClip, encoder: StateDict, source: str) -> StateDict:
    """The CLIP's state dict with `encoder` as its image tower: every key of the tower replaced, refused
    in one line when the keys or shapes are not the run's image encoder's."""
    visual = loaded.model.visual.state_dict()
    missing, unexpected = sorted(set(visual) - set(encoder)), sorted(set(encoder) - set(visual))
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"has {unexpected[0]}, not in the image tower"
        raise MimaError(f"{source}: not an image encoder of {loaded.source} ({what})")
    for key, tensor in visual.items():
        if encoder[key].shape != tensor.shape:
            raise MimaError(f"{source}: '{key}' has shape {tuple(encoder[key].shape)}, "
                            f"the image tower of {loaded.source} has {tuple(tensor.shape)}")
    state = {key: tensor.detach().clone() for key, tensor in loaded.model.state_dict().items()}
    state.update({f"visual.{key}": encoder[key].detach().to(visual[key].dtype) for key in visual})
    return state


def open_clip_export(encoder: StateDict, config: RunConfig | str | os.PathLike, source: str) -> OpenClipExport:
    """The full CLIP of the run `config` (a `mima fit` config or run folder) with `encoder` as its image
    tower; `source` names the encoder in messages."""
    run = config if isinstance(config, RunConfig) else load_run_config(config)
    model = run.model
    cache = cache_dir_or_default(model.cache_dir)
    loaded = load_clip(model.clip, model.pretrained, cache_dir=cache, quick_gelu=model.quick_gelu)
    quick_gelu = built_with_quick_gelu(loaded.model)
    model_cfg = {**source_model_cfg(model.clip, cache), "quick_gelu": quick_gelu}
    open_clip_config = {"model_cfg": model_cfg, "preprocess_cfg": dict(loaded.model.visual.preprocess_cfg)}
    return OpenClipExport(with_image_tower(loaded, encoder, source), open_clip_config, model.clip,
                          effective_pretrained(model.clip, model.pretrained), quick_gelu)


def refuse_existing_folder(output: Path, overwrite: bool) -> None:
    """An output folder that exists is replaced only with --overwrite; a file is never replaced by a folder."""
    if output.exists() and not output.is_dir():
        raise MimaError(f"--output {output}: is a file; give a folder name for the open_clip model")
    if output.exists() and not overwrite:
        raise MimaError(f"--output {output}: already exists (pass --overwrite to replace its files, or choose another folder)")


def write_open_clip_files(folder: Path, export: OpenClipExport, card: str) -> list[Path]:
    """The three files, written into `folder` (a staging folder: see write_open_clip_folder)."""
    from safetensors.torch import save_file

    # plain strings, and `format` 'pt', as the hub's readers expect (not save_state_dict's JSON-encoded values)
    tensors = {key: value.detach().to("cpu").contiguous() for key, value in export.state.items()}
    save_file(tensors, str(folder / OPEN_CLIP_WEIGHTS), metadata={"format": "pt", "written_by": "mima"})
    (folder / OPEN_CLIP_CONFIG).write_text(json.dumps(export.config, indent=2) + "\n")
    (folder / MODEL_CARD).write_text(card)
    return [folder / name for name in OPEN_CLIP_FILES]


def write_open_clip_folder(output: Path, export: OpenClipExport, card: str, overwrite: bool) -> list[Path]:
    """The folder, appearing whole (written beside it, then moved in: mima.core.publish.atomic_folder)."""
    refuse_existing_folder(output, overwrite)
    with atomic_folder(output, OPEN_CLIP_FILES, overwrite=overwrite) as staging:
        write_open_clip_files(staging, export, card)
    return [output / name for name in OPEN_CLIP_FILES]
