"""A data-free suite for throughput and smoke tests: random images with random labels.

Nothing is learnt from these tasks (labels are independent of the pixels); they exist so that any
model (e.g. a ViT-B/32 with `--model.pretrained none`) can be pushed through `mima fit` at its own
input size with no dataset on disk, as benchmarks/gpu_throughput.py does. Each task keeps a pool of
POOL_SIZE distinct images (uint8, seeded by the task) and cycles through it, so memory stays small
at 224x224 while the train split is long enough for any number of steps; pixels are scaled to
[-1, 1] when an example is read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import Dataset

from mima.data.tasks import LoadOptions, TaskData, TaskSpec

CLASSNAMES = tuple(f"pattern {index}" for index in range(10))
TEMPLATES = ("a photo of a {}.", "an image of a {}.")
POOL_SIZE = 256
SPLIT_SIZES = {"train": 65536, "val": 512, "test": 512}
DEFAULT_TASKS = ("synthetic_a", "synthetic_b")


class CyclingNoise(Dataset):
    """`length` examples drawn from a pool of random images and labels."""

    def __init__(self, pool: torch.Tensor, labels: torch.Tensor, length: int, offset: int) -> None:
        self.pool, self.labels, self.length, self.offset = pool, labels, length, offset

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        slot = (index + self.offset) % len(self.pool)
        return self.pool[slot].float() / 127.5 - 1.0, self.labels[slot]


def _loader(task_seed: int) -> Callable[[LoadOptions], TaskData]:
    def load(options: LoadOptions) -> TaskData:
        generator = torch.Generator().manual_seed(task_seed + 7919 * options.split_seed)
        size = options.image_size
        pool = torch.randint(0, 256, (POOL_SIZE, 3, size, size), generator=generator, dtype=torch.uint8)
        labels = torch.randint(0, len(CLASSNAMES), (POOL_SIZE,), generator=generator)
        offsets = {"train": 0, "val": POOL_SIZE // 2, "test": POOL_SIZE // 4}
        return TaskData(**{split: CyclingNoise(pool, labels, length, offsets[split]) for split, length in SPLIT_SIZES.items()})

    return load


TASKS: dict[str, TaskSpec] = {
    f"synthetic_{letter}": TaskSpec(name=f"synthetic_{letter}", classnames=CLASSNAMES, templates=TEMPLATES, load=_loader(seed))
    for seed, letter in enumerate("abcd")
}
