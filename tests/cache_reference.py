"""The cached path's per-example rules as they were written before they were vectorised (issue 47,
item 5): one example at a time, in plain Python. tests/data/test_cache_batches.py checks the vectorised
code in mima.data against them; benchmarks/cache_batches.py times both."""

from __future__ import annotations

import hashlib
import math
import random

import numpy as np
import torch

from mima.data.cache_augment import CropSettings, resized_crops
from mima.data.sampler import stream_seed


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


def draw_seed(seed: int, task: str, task_step: int, position: int) -> int:
    """The seed of example `position` of task `task`'s batch at per-task step `task_step`."""
    digest = hashlib.sha256(f"mima/{seed}/{task}/draw/{task_step}/{position}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class TaskStream:
    """mima.data.sampler.TaskStream as it was: each epoch a fresh seeded permutation, read one position at a time."""

    def __init__(self, task: str, size: int, seed: int) -> None:
        self.task, self.size, self.seed = task, size, seed
        self.epoch, self.order = -1, torch.empty(0, dtype=torch.long)

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self.epoch:
            generator = torch.Generator().manual_seed(stream_seed(self.seed, self.task, epoch))
            self.epoch, self.order = epoch, torch.randperm(self.size, generator=generator)
        return self.order

    def batch(self, task_step: int, batch_size: int) -> list[int]:
        start = task_step * batch_size
        indices = []
        for position in range(start, start + batch_size):
            epoch, offset = divmod(position, self.size)
            indices.append(int(self.permutation(epoch)[offset]))
        return indices


def prepare_rows(batch, mean: torch.Tensor, std: torch.Tensor, mode: str) -> torch.Tensor:
    """BatchPreparer's images as they were computed: the augmented rows gathered, resampled and
    scattered back (mean and std as [1, 3, 1, 1] tensors on the batch's device)."""
    images, _, _, boxes, augmented = batch
    pixels = images.to(torch.float32).div_(255)
    augmented = np.asarray(augmented)
    if augmented.any():
        rows = torch.from_numpy(np.flatnonzero(augmented)).to(pixels.device)
        pixels[rows] = resized_crops(pixels[rows], boxes[rows], mode)
    return pixels.sub_(mean).div_(std)
