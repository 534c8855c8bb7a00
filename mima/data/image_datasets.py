"""Datasets of image files and a folder task's splits.

`ImageFiles` reads (image, label) pairs from files with PIL, made RGB, through the model's transform
(`rgb_transform`); `with_training_transform` and `retransformed` give the training split the
model's training transform while validation and test keep the evaluation transform, also where
validation is carved from the training images. `with_validation` carves a validation split by the
task_vectors rule (mima.data.splits.carve_validation). A custom task's splits (`folder_splits`, and
`check_split_sizes`, which applies the same rules to the counts before anything loads): test from
its test folder or a holdout of TEST_FRACTION of the training images, validation from its val folder
or carved from what is left.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path

from PIL import Image
from torch.utils.data import Dataset, Subset

from mima.core.errors import MimaError
from mima.data.splits import carve_validation, holdout_split, validation_size
from mima.data.tasks import LoadOptions, TaskData

TEST_FRACTION = 0.2
TEST_SPLIT_SEED = 20240607  # + split_seed: the holdout moves with the split seed, as the digits suite does


class ImageFiles(Dataset):
    """(image, label) pairs from image files: read with PIL, made RGB, then `transform`."""

    def __init__(self, samples: Sequence[tuple[str, int]], transform: Callable) -> None:
        self.samples = list(samples)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        try:
            with Image.open(path) as image:
                rgb = image.convert("RGB")  # decodes the whole file: a damaged one fails here
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            raise MimaError(f"{path}: not a readable image ({type(exc).__name__}: {exc}); remove or replace it") from None
        return self.transform(rgb), label


def rgb_transform(options: LoadOptions, train: bool = False) -> Callable:
    """The model's preprocessing after a conversion to RGB (grayscale datasets such as MNIST give
    one-channel images; CLIP towers want three): the evaluation transform, or with `train` the
    training transform where the options carry one. Without a model transform (loader tests),
    images are resized and centre-cropped to `options.image_size`, as tensors in [0, 1]."""
    from torchvision import transforms

    chosen = options.preprocess_train if train and options.preprocess_train is not None else options.preprocess
    preprocess = chosen or transforms.Compose(
        [transforms.Resize(options.image_size), transforms.CenterCrop(options.image_size), transforms.ToTensor()]
    )
    return transforms.Compose([_to_rgb, preprocess])


def with_training_transform(train: Dataset, options: LoadOptions) -> Dataset:
    """The training split read through the model's training transform (`options.preprocess_train`),
    or `train` itself when the options carry none. Nothing is read again: the result views the same
    files or arrays with the other transform, so a validation split carved from the same images
    (a Subset of the original) keeps the evaluation transform."""
    if options.preprocess_train is None:
        return train
    return retransformed(train, rgb_transform(options, train=True))


def retransformed(dataset: Dataset, transform: Callable) -> Dataset:
    """`dataset` with its image transform replaced: ImageFiles, torchvision datasets (a shallow copy
    sharing their arrays) and Subsets of either."""
    from torchvision.datasets import VisionDataset
    from torchvision.datasets.vision import StandardTransform

    if isinstance(dataset, Subset):
        return Subset(retransformed(dataset.dataset, transform), dataset.indices)
    if isinstance(dataset, ImageFiles):
        return ImageFiles(dataset.samples, transform)
    if isinstance(dataset, VisionDataset):
        other = copy.copy(dataset)
        other.transform = transform  # most torchvision datasets apply .transform, a few .transforms
        other.transforms = StandardTransform(transform, dataset.target_transform)
        return other
    raise TypeError(f"cannot replace the image transform of a {type(dataset).__name__}")


def _to_rgb(image: Image.Image) -> Image.Image:
    return image if image.mode == "RGB" else image.convert("RGB")


def with_validation(train: Dataset, val: Dataset | None, split_seed: int) -> tuple[Dataset, Dataset]:
    """(train, val): the given validation split, or else one carved from `train` by the task_vectors
    rule (`carve_validation`: random_split with manual_seed(split_seed); validation is the
    permutation's tail, 10% of the training set, at most 5000 examples; both in permutation order)."""
    if val is not None:
        return train, val
    train_idx, val_idx = carve_validation(len(train), split_seed)
    return Subset(train, train_idx.tolist()), Subset(train, val_idx.tolist())


def check_split_sizes(samples: dict[str, list[tuple[str, int]]], what: str, train_folder: Path) -> None:
    """Every split gets at least one image (by the same rules `folder_splits` splits with); `samples`:
    each split folder's (file, label) pairs, `what` names the task in the message."""
    training = len(samples["train"])
    test = len(samples["test"]) if "test" in samples else int(round(TEST_FRACTION * training))
    remaining = training if "test" in samples else training - test
    val = len(samples["val"]) if "val" in samples else validation_size(remaining)
    train = remaining if "val" in samples else remaining - val
    sizes = {"train": train, "val": val, "test": test}
    empty = [split for split, size in sizes.items() if size < 1]
    if empty:
        raise MimaError(
            f"{what}: {training} readable training images under {train_folder} leave the "
            f"{empty[0]} split empty (splits: {', '.join(f'{k} {v}' for k, v in sizes.items())}); add images"
        )


def folder_splits(samples_by_split: dict[str, list[tuple[str, int]]], options: LoadOptions, what: str,
                  train_folder: Path) -> TaskData:
    """A folder task's train, val and test datasets from its split folders' (file, label) pairs: test
    from its test folder or a holdout of TEST_FRACTION of the training images, val from its val folder
    or carved from the rest (`with_validation`); only the training split takes the training transform."""
    transform = rgb_transform(options)
    samples = samples_by_split["train"]
    if "test" in samples_by_split:
        train_all = ImageFiles(samples, transform)
        test: Dataset = ImageFiles(samples_by_split["test"], transform)
    else:
        everything = ImageFiles(samples, transform)
        rest, held = holdout_split(len(everything), TEST_FRACTION, TEST_SPLIT_SEED + options.split_seed)
        train_all, test = Subset(everything, rest.tolist()), Subset(everything, held.tolist())
    val = ImageFiles(samples_by_split["val"], transform) if "val" in samples_by_split else None
    train, val = with_validation(train_all, val, options.split_seed)
    train = with_training_transform(train, options)  # val and test keep the evaluation transform
    for split, dataset in (("train", train), ("val", val), ("test", test)):
        if len(dataset) == 0:
            raise MimaError(f"{what}: the {split} split is empty ({len(samples)} training images under {train_folder})")
    return TaskData(train=train, val=val, test=test)
