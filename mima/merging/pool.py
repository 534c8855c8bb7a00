"""What data-dependent strategies need from a task pool, and nothing more.

A strategy that needs calibration or unlabelled data (AdaMerging, FW-Merging, Fisher, RegMean) is
given a pool: mima.pools.TaskPool in the product, any object of this shape in tests. Strategies use
it only through these attributes and methods (duck typing); mima.merging never imports the model
and data stack.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Pool(Protocol):
    encoder: nn.Module  # the image encoder whose state dicts are merged (forward passes, module hooks)
    tasks: list[str]  # task names, in the order of the models
    heads: Mapping[str, torch.Tensor]  # each task's frozen classification head

    def loader(self, task: str, split: str, batch_size: int, shuffle: bool = False,
               seed: int | None = None) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """Batches (images, labels) of one task's split; with shuffle, a fixed order per seed."""

    def examples(self, task: str, split: str, count: int, batch_size: int = 32,
                 seed: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches (images, labels) of `count` examples drawn in a fixed random order."""

    def logits(self, weights: Mapping[str, torch.Tensor], task: str, images: torch.Tensor) -> torch.Tensor:
        """The task's logits with the encoder's weights replaced by `weights` (differentiable)."""
