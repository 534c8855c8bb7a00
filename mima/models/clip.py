"""Building open_clip models from a name + pretrained tag, a local file, or a local folder.

Accepted sources (`name` / `pretrained`):
  ViT-B-32 / openai                an open_clip architecture and tag (downloads; not possible offline)
  ViT-B-32 / /path/weights.pt      an architecture and a local checkpoint file
  ViT-B-32 / none                  an architecture with random weights (offline smoke tests)
  local-dir:/path/folder           a folder with open_clip_config.json and weights (the HF-hub layout)
  embedded:tiny-digits             mima's own tiny CLIP, pretrained on first use and cached
Small test models are written as local-dir folders and loaded the same way as downloaded ones.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import open_clip
from open_clip.transform import PreprocessCfg, image_transform_v2
import torch
from torch import nn

from mima.core.errors import MimaError

EMBEDDED_PREFIX = "embedded:"
LOCAL_DIR_PREFIX = "local-dir:"
RANDOM_WEIGHTS = ("none", "random")


@dataclass
class LoadedClip:
    """A CLIP model with its tokenizer; `source` names where it came from (for messages and caches)."""

    model: nn.Module
    tokenizer: object
    source: str

    @property
    def encoder(self) -> nn.Module:
        return self.model.visual

    @property
    def preprocess(self) -> Callable:
        """open_clip's evaluation transform (PIL image -> normalised tensor): resize the shorter side,
        centre crop, normalise; deterministic. Used for validation, test, zero-shot evaluation and the
        images linear probes are fitted on (task_vectors' `val_preprocess`)."""
        return image_transform_v2(PreprocessCfg(**self.model.visual.preprocess_cfg), is_train=False)

    @property
    def preprocess_train(self) -> Callable:
        """open_clip's training transform (PIL image -> normalised tensor): RandomResizedCrop to the
        input size with scale (0.9, 1.0) (area fraction of the source image; aspect ratio 3/4 to 4/3;
        bicubic), then normalise; random. task_vectors fine-tunes on exactly this transform: its
        `ImageEncoder` keeps the `train_preprocess` of `open_clip.create_model_and_transforms`, and
        `finetune.py` builds the training set with `model.train_preprocess`."""
        return image_transform_v2(PreprocessCfg(**self.model.visual.preprocess_cfg), is_train=True)

    @property
    def image_size(self) -> int:
        size = getattr(self.model.visual, "image_size", 224)
        return int(size[0] if isinstance(size, (tuple, list)) else size)


def default_cache_dir() -> Path:
    """Where mima caches the embedded model and zero-shot heads: $MIMA_CACHE_DIR or ~/.cache/mima."""
    return Path(os.environ.get("MIMA_CACHE_DIR", Path.home() / ".cache" / "mima"))


def load_clip(name: str, pretrained: str | None = None, cache_dir: str | Path | None = None) -> LoadedClip:
    """Load an open_clip CLIP (see the module docstring for accepted sources)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if name.startswith((EMBEDDED_PREFIX, LOCAL_DIR_PREFIX)) or (pretrained or "").lower() in RANDOM_WEIGHTS:
        pretrained = None  # these sources carry their own weights; "none" asks for random ones
    if name.startswith(EMBEDDED_PREFIX):
        from mima.models.embedded import ensure_embedded_model

        folder = ensure_embedded_model(name[len(EMBEDDED_PREFIX) :], cache)
        return _create(f"{LOCAL_DIR_PREFIX}{folder}", None, source=name)
    if name.startswith(LOCAL_DIR_PREFIX):
        folder = Path(name[len(LOCAL_DIR_PREFIX) :])
        if not (folder / "open_clip_config.json").is_file():
            raise MimaError(f"model.clip: {folder} has no open_clip_config.json (expected an open_clip model folder)")
        return _create(name, None, source=name)
    if name not in open_clip.list_models():
        raise MimaError(
            f"model.clip: unknown open_clip architecture '{name}' "
            f"(use e.g. ViT-B-32, local-dir:PATH or embedded:tiny-digits)"
        )
    if pretrained and not os.path.isfile(pretrained) and pretrained not in open_clip.list_pretrained_tags_by_model(name):
        raise MimaError(
            f"model.pretrained: '{pretrained}' is neither a file nor a known tag of {name} "
            f"(tags: {', '.join(open_clip.list_pretrained_tags_by_model(name)) or 'none'})"
        )
    return _create(name, pretrained, source=f"{name}:{pretrained}")


def _create(name: str, pretrained: str | None, source: str) -> LoadedClip:
    try:
        model = open_clip.create_model(name, pretrained=pretrained)
    except RuntimeError as exc:
        # open_clip raises RuntimeError for failed downloads and for weights that do not fit.
        raise MimaError(f"model '{source}': could not be loaded ({str(exc).splitlines()[0]})") from None
    tokenizer = open_clip.get_tokenizer(name)
    model.eval()
    return LoadedClip(model=model, tokenizer=tokenizer, source=source)


def text_tower_fingerprint(model: nn.Module) -> str:
    """A hash of every weight outside the image tower: zero-shot heads depend on nothing else."""
    digest = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        if key.startswith("visual."):
            continue
        digest.update(key.encode())
        data = tensor.detach().to("cpu").contiguous()
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
