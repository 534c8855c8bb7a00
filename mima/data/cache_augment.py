"""Training on the decoded-image cache: random resized crops drawn per example, applied on the device.

The cached training splits (mima.data.cache_store) hold the S x S centre crop of each image as
uint8. `CachedTrainingSet` reads a batch of them by index and draws a crop box for each augmented
example (`crop_box`); `BatchPreparer`, on the device and on the whole batch, resamples the boxes
(`resized_crops`) and normalises. The crop settings are read from the model's training transform
(open_clip's RandomResizedCrop: scale (0.9, 1.0), aspect 3/4..4/3, bicubic).

Deliberate differences from open_clip's per-image training transform:
  - the random resized crop is taken from the cached S x S centre crop, not from the original
    image: a non-square image loses the borders the centre crop cut off, and the crop is resampled
    from S x S pixels rather than from the full-resolution file (for scale (0.9, 1.0) the crop is an
    up-sampling by at most ~1.15x per side);
  - the resampling is torch's bicubic (`grid_sample`, a = -0.75, neighbours outside the crop read
    from the image, clamped to [0, 1]) instead of PIL's bicubic (a = -0.5);
  - crop boxes are drawn per example from a seed of (data seed, task, per-task step, position in
    the step's batch) instead of from the worker's global RNG, so the batches of a run are the same
    at any number of processes and workers, and after a resume.
The crop parameters follow torchvision's `RandomResizedCrop.get_params` (10 tries of a random area
and log-uniform aspect ratio, then a centre crop of the clamped ratio).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from mima.core.errors import MimaError
from mima.data.cache_store import CachedSplit, split_at_to_tensor, transform_steps


@dataclass(frozen=True)
class CropSettings:
    """RandomResizedCrop's parameters, read from the model's training transform."""

    scale: tuple[float, float]
    ratio: tuple[float, float]
    mode: str  # grid_sample mode: bicubic, bilinear or nearest


def crop_settings(preprocess_train: Callable | None) -> CropSettings | None:
    """RandomResizedCrop's settings from the training transform (None: no training transform).
    Any other random step before ToTensor cannot run on cached images: an error, not a silent drop."""
    from torchvision.transforms import InterpolationMode, RandomResizedCrop

    if preprocess_train is None:
        return None
    before, _ = split_at_to_tensor(transform_steps(preprocess_train, "training"), "training")
    crops = [step for step in before if isinstance(step, RandomResizedCrop)]
    others = [type(step).__name__ for step in before
              if not isinstance(step, RandomResizedCrop) and type(step).__name__ not in ("MaybeConvertMode", "function")]
    if len(crops) != 1 or others:
        raise MimaError(f"data.cache: the training transform must be one RandomResizedCrop (+ RGB conversion) before "
                        f"ToTensor, got {', '.join(type(step).__name__ for step in before)}; leave data.cache false")
    crop = crops[0]
    modes = {InterpolationMode.BICUBIC: "bicubic", InterpolationMode.BILINEAR: "bilinear", InterpolationMode.NEAREST: "nearest"}
    if crop.interpolation not in modes:
        raise MimaError(f"data.cache: RandomResizedCrop interpolation {crop.interpolation} has no grid_sample mode")
    return CropSettings(tuple(crop.scale), tuple(crop.ratio), modes[crop.interpolation])


def crop_box(draw: int, size: int, settings: CropSettings) -> tuple[int, int, int, int]:
    """(top, left, height, width) of a random resized crop of a size x size image, from seed `draw`:
    torchvision's RandomResizedCrop.get_params, with its own generator instead of the global one."""
    rng = random.Random(draw)
    area = size * size
    log_low, log_high = math.log(settings.ratio[0]), math.log(settings.ratio[1])
    for _ in range(10):
        target_area = area * rng.uniform(settings.scale[0], settings.scale[1])
        aspect = math.exp(rng.uniform(log_low, log_high))
        width = int(round(math.sqrt(target_area * aspect)))
        height = int(round(math.sqrt(target_area / aspect)))
        if 0 < width <= size and 0 < height <= size:
            return rng.randint(0, size - height), rng.randint(0, size - width), height, width
    # no try fitted: the centre crop of the aspect ratio clamped to the range (a square image: itself)
    width = height = size
    if 1.0 < settings.ratio[0]:
        height = int(round(width / settings.ratio[0]))
    elif 1.0 > settings.ratio[1]:
        width = int(round(height * settings.ratio[1]))
    return (size - height) // 2, (size - width) // 2, height, width


def whole_batch(batch):
    """collate_fn of the cached training loader: CachedTrainingSet.__getitems__ returns a whole batch."""
    return batch


class CachedTrainingSet(Dataset):
    """The cached training splits of a process's tasks, read a batch at a time.

    Indexed by the samplers' (slot, example, draw) triples; `__getitems__` returns the whole batch:
    uint8 images [B, 3, S, S], labels, slots, crop boxes [B, 4] (top, left, height, width) and
    whether each row is augmented (its task's loader applies the training transform)."""

    def __init__(self, splits: Sequence[CachedSplit], augment: Sequence[bool], crop: CropSettings | None, image_size: int) -> None:
        self.splits, self.augment, self.crop, self.image_size = list(splits), list(augment), crop, image_size

    def __len__(self) -> int:
        return sum(len(split) for split in self.splits)

    def __getitem__(self, index):
        return self.__getitems__([index])

    def __getitems__(self, indices: Sequence[tuple[int, int, int]]):
        count, size = len(indices), self.image_size
        slot_list = [slot for slot, _, _ in indices]
        slots = torch.tensor(slot_list, dtype=torch.long)
        boxes = torch.tensor([[0, 0, size, size]], dtype=torch.long).repeat(count, 1)
        # a numpy array, not a tensor: Lightning moves only tensors to the device, so which rows to crop
        # is known on the host and choosing them makes the host wait for nothing
        augmented = np.zeros(count, dtype=np.bool_)
        present = sorted(set(slot_list))
        if len(present) == 1:  # a MIMA batch: one task, read straight into the batch (no second copy)
            examples = np.asarray([example for _, example, _ in indices], dtype=np.int64)
            split = self.splits[present[0]]
            images = torch.from_numpy(split.images[examples])
            labels = torch.from_numpy(split.labels[examples])
        else:  # a joint batch: every task's part, one read per task
            images = torch.empty((count, 3, size, size), dtype=torch.uint8)
            labels = torch.empty(count, dtype=torch.long)
        for slot in present:
            rows = [row for row, s in enumerate(slot_list) if s == slot]
            if len(present) > 1:
                examples = np.asarray([indices[row][1] for row in rows], dtype=np.int64)
                images[rows] = torch.from_numpy(self.splits[slot].images[examples])
                labels[rows] = torch.from_numpy(self.splits[slot].labels[examples])
            if self.augment[slot] and self.crop is not None:
                augmented[rows] = True
                boxes[rows] = torch.tensor([crop_box(indices[row][2], size, self.crop) for row in rows], dtype=torch.long)
        return images, labels, slots, boxes, augmented


class BatchPreparer:
    """Runs on the device, on a whole cached batch: uint8 -> float in [0, 1], the random resized crop
    of the augmented rows (one grid_sample over them), normalisation. Returns (images, labels, slots),
    the batch of the per-image path."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], image_size: int, crop: CropSettings | None) -> None:
        self.mean, self.std = tuple(mean), tuple(std)
        self.image_size, self.crop = image_size, crop
        self.constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # mean, std per device

    def __call__(self, batch):
        images, labels, slots, boxes, augmented = batch
        pixels = images.to(torch.float32).div_(255)  # in place: one float buffer for the whole preparation
        augmented = np.asarray(augmented)  # on the host (see CachedTrainingSet.__getitems__)
        if self.crop is not None and augmented.any():
            rows = torch.from_numpy(np.flatnonzero(augmented)).to(pixels.device, non_blocking=True)
            pixels[rows] = resized_crops(pixels[rows], boxes[rows], self.crop.mode)
        mean, std = self._normalisation(pixels.device)
        return pixels.sub_(mean).div_(std), labels, slots

    def _normalisation(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std as [1, 3, 1, 1] tensors on `device`, copied there once, not at every batch."""
        if device not in self.constants:
            self.constants[device] = tuple(torch.tensor(values, dtype=torch.float32, device=device).view(1, -1, 1, 1)
                                           for values in (self.mean, self.std))
        return self.constants[device]


def resized_crops(pixels: torch.Tensor, boxes: torch.Tensor, mode: str = "bicubic") -> torch.Tensor:
    """Each image's box (top, left, height, width) resampled to the image's own size, in one
    grid_sample: output pixel centre u maps to x = left + (u + 1/2) * width / S - 1/2 in the source,
    i.e. in grid_sample's [-1, 1] units (align_corners=False) x_n = (w/S) u_n + (2 left + w)/S - 1.
    Values are clamped to [0, 1], as PIL clamps its bicubic overshoot to 0..255."""
    count, _, height, width = pixels.shape
    top, left, box_h, box_w = (boxes[:, i].to(pixels.dtype) for i in range(4))
    theta = torch.zeros((count, 2, 3), dtype=pixels.dtype, device=pixels.device)
    theta[:, 0, 0] = box_w / width
    theta[:, 0, 2] = (2 * left + box_w) / width - 1
    theta[:, 1, 1] = box_h / height
    theta[:, 1, 2] = (2 * top + box_h) / height - 1
    grid = F.affine_grid(theta, [count, 3, height, width], align_corners=False)
    sampled = F.grid_sample(pixels, grid, mode=mode, padding_mode="border", align_corners=False)
    return sampled.clamp_(0, 1)
