"""Fixed random subsets: the same examples every time for the same seed."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch.utils.data import Dataset, Subset


def fixed_order(size: int, seed: int) -> torch.Tensor:
    """A permutation of range(size) that depends only on `seed`."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed))


def fixed_subset(dataset: Dataset, count: int | None, seed: int = 0) -> Dataset:
    """At most `count` examples drawn in a fixed random order and kept in dataset order (the whole
    dataset for None or more)."""
    size = len(dataset)
    if count is None or count >= size:
        return dataset
    return Subset(dataset, sorted(fixed_order(size, seed)[:count].tolist()))


def first_examples(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches (images, labels) holding the first `count` examples of `batches` (the last one cut)."""
    taken = 0
    for images, labels in batches:
        if taken >= count:
            return
        keep = min(len(labels), count - taken)
        taken += keep
        yield images[:keep], labels[:keep]
