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
    """What a loader may need: a data root (datasets on disk), the model's input size, its image
    transforms, the split seed, and whether torchvision may download a missing dataset.

    `preprocess` is the evaluation transform (PIL image -> normalised tensor, open_clip's
    deterministic resize + centre crop): validation, test, and anything fitted or scored on clean
    images. `preprocess_train` is the training transform (open_clip's RandomResizedCrop, as
    task_vectors trains); None means the training split goes through `preprocess` as well. Loaders
    of PIL images (the `clip` suite, custom image-folder tasks) apply it to the training split only;
    validation (carved from the training images) and test always use `preprocess`. The tensor
    `digits` suite and the `offline` suite ignore it (no augmentation; their docstrings say why)."""

    root: str | None = None
    image_size: int = 224
    split_seed: int = 0
    preprocess: Callable | None = None
    download: bool = False
    preprocess_train: Callable | None = None


@dataclass(frozen=True)
class TaskSpec:
    name: str
    classnames: tuple[str, ...]
    templates: tuple[str, ...]
    load: Callable[[LoadOptions], TaskData]

    @property
    def num_classes(self) -> int:
        return len(self.classnames)
