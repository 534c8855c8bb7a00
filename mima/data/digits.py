"""The embedded task suite: scikit-learn's bundled 8x8 handwritten digits (1797 real images).

Every task classifies the digit 0-9, but sees it through a different geometric transform, so
each task needs its own features:
  upright   the digits as written (the domain the embedded CLIP is pretrained on)
  rot90 / rot180 / rot270   rotated counter-clockwise by that many degrees
  mirror    flipped left-right
Splits are shared by all tasks: a fixed 30% test holdout (scikit-learn ships no split), then
validation carved from the other 1258 images by task_vectors' rule (`mima.data.splits.carve_validation`:
`random_split` with `manual_seed(split_seed)`, the permutation's tail, 10% = 125 images), leaving
1133 for training. Each split is a Subset of the 1797 images, so `mima data splits` reports its
indices into scikit-learn's order.
Images are scaled to [-1, 1], upsampled bilinearly to the model's input size, three channels.
The splits are tensor datasets built from `LoadOptions.image_size` alone: the model's transforms
(`preprocess`, `preprocess_train`) are ignored and no split is augmented, so the demo's training
batches, and its results, do not depend on open_clip's training transform.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Subset, TensorDataset

from mima.data.splits import carve_validation, holdout_split
from mima.data.tasks import LoadOptions, TaskData, TaskSpec

CLASSNAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TEMPLATES = (
    "a photo of the number {}.",
    "a handwritten digit {}.",
    "an image of the digit {}.",
)
TEST_FRACTION = 0.3
TEST_SPLIT_SEED = 20240601

TRANSFORMS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "upright": lambda image: image,
    "rot90": lambda image: np.rot90(image, k=1),
    "rot180": lambda image: np.rot90(image, k=2),
    "rot270": lambda image: np.rot90(image, k=3),
    "mirror": lambda image: np.fliplr(image),
}
DEFAULT_TASKS = ("rot90", "rot180", "rot270", "mirror")


@lru_cache(maxsize=1)
def _raw_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images.astype(np.float32), bunch.target.astype(np.int64)


def split_indices(split_seed: int) -> dict[str, torch.Tensor]:
    """Indices into the 1797 digits of the train / val / test examples (the same for every task;
    train and val in the order of task_vectors' random_split)."""
    images, _ = _raw_digits()
    rest, test = holdout_split(len(images), TEST_FRACTION, TEST_SPLIT_SEED + split_seed)
    train_pos, val_pos = carve_validation(len(rest), split_seed)
    return {"train": rest[train_pos], "val": rest[val_pos], "test": test}


def transformed_images(transform: str, image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits under `transform`, as [N, 3, size, size] tensors in [-1, 1], and labels."""
    images, labels = _raw_digits()
    moved = np.stack([np.ascontiguousarray(TRANSFORMS[transform](image)) for image in images])
    pixels = torch.from_numpy(moved).unsqueeze(1) / 8.0 - 1.0  # the raw values run 0..16
    pixels = F.interpolate(pixels, size=(image_size, image_size), mode="bilinear", align_corners=False)
    return pixels.expand(-1, 3, -1, -1).contiguous(), torch.from_numpy(labels)


def _loader(transform: str) -> Callable[[LoadOptions], TaskData]:
    def load(options: LoadOptions) -> TaskData:
        """Tensor splits sized by options.image_size; options.preprocess(_train) are not used (no augmentation)."""
        pixels, labels = transformed_images(transform, options.image_size)
        splits = split_indices(options.split_seed)
        everything = TensorDataset(pixels, labels)
        return TaskData(**{name: Subset(everything, idx.tolist()) for name, idx in splits.items()})

    return load


TASKS: dict[str, TaskSpec] = {
    name: TaskSpec(name=name, classnames=CLASSNAMES, templates=TEMPLATES, load=_loader(name)) for name in TRANSFORMS
}
