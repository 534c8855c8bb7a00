"""What a task is: class names and prompt templates (for its zero-shot head) plus its data splits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.utils.data import Dataset


@dataclass(frozen=True)
class TaskData:
    """The three splits of a task. `val` is carved from the training set; `test` is never used for selection."""

    train: Dataset
    val: Dataset
    test: Dataset


@dataclass(frozen=True)
class LoadOptions:
    """What a loader may need: a data root (real datasets), the model's input size, the split seed."""

    root: str | None = None
    image_size: int = 224
    split_seed: int = 0


@dataclass(frozen=True)
class TaskSpec:
    name: str
    classnames: tuple[str, ...]
    templates: tuple[str, ...]
    load: Callable[[LoadOptions], TaskData]

    @property
    def num_classes(self) -> int:
        return len(self.classnames)
