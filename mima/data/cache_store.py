"""The decoded-image cache on disk: each task's splits decoded once, stored as uint8, read by index.

Without the cache every training step decodes, resizes and crops every image on CPU workers
(open_clip's transform, image by image); with a few cores per GPU that, not the model, sets the
pace. With `data.cache: true` (or `mima data cache --config FILE` beforehand):

  build   each split of each task is read once through the geometric part of the model's
          evaluation transform (open_clip: resize the shorter side, centre crop, RGB) and stored as
          uint8 [N, 3, S, S] in one memory-mapped .npy file per (task, split), with a JSON sidecar
          holding the labels and a fingerprint (the source files' names/sizes/mtimes, or the bytes
          of in-memory arrays, plus the transform's settings and S). A sidecar whose fingerprint does
          not match is stale: the split is rebuilt. Files are written atomically (temporary file +
          rename; the sidecar last), in parallel (a DataLoader with workers), with a tqdm bar.
  train   batches are read by index (no decoding) and moved to the device as uint8, where the
          training augmentation and the normalisation run on the whole batch: mima.data.cache_augment.
  eval    validation, test, linear probes and every analysis read the same files (centre-cropped
          images, normalised when read: `CachedSplit`); `mima evaluate --cache on` reads them in
          whole batches and normalises them on the device (mima.evaluation.cached_batches).

The evaluation path gives open_clip's tensors: ToTensor is x / 255 in float32 and Normalize is
(x - mean) / std, the same float operations in the same order, so on the CPU the tensors are equal
(tests/data/test_data_cache.py asserts a max abs difference <= 1e-6; measured 0).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from mima.core.errors import MimaError
from mima.core.files import atomic_path
from mima.data.tasks import LoadOptions, TaskData, TaskSpec

if TYPE_CHECKING:  # for the annotation only: torchvision is imported inside the functions that use it
    from torchvision.datasets import VisionDataset

FORMAT = 2  # of the sidecar; a change rebuilds every cache (2: the .npy file's checksum)
CHECKSUM_CHUNK = 16 * 2**20
SPLITS = ("train", "val", "test")
BUILD_BATCH = 64


class NotCacheable(MimaError):
    """What the cache cannot hold (a model transform it cannot cut at ToTensor, a task built from
    tensors, a dataset it cannot fingerprint); `reason` says why, without the option's name, so that
    `mima evaluate --cache` can name its own option, and `auto` can leave such a task on its own path."""

    def __init__(self, reason: str, advice: str = "leave data.cache false") -> None:
        super().__init__(f"data.cache: {reason}; {advice}")
        self.reason = reason


# ---------------------------------------------------------------------------- transforms
@dataclass(frozen=True)
class EvalGeometry:
    """The model's evaluation transform cut at ToTensor: `steps` (PIL -> PIL: resize, centre crop,
    RGB) and the normalisation that follows ToTensor."""

    steps: Callable
    mean: tuple[float, ...]
    std: tuple[float, ...]
    description: str  # what the cache depends on (part of the fingerprint)


def transform_steps(preprocess: Callable, what: str) -> list:
    """The steps of a torchvision Compose (the model's `what` transform: evaluation or training)."""
    steps = getattr(preprocess, "transforms", None)
    if steps is None:
        raise NotCacheable(f"the model's {what} transform is not a torchvision Compose ({preprocess!r})")
    return list(steps)


def split_at_to_tensor(steps: list, what: str) -> tuple[list, list]:
    """The steps before ToTensor (PIL -> PIL: what the cache can store) and those after it."""
    from torchvision.transforms import ToTensor

    cut = next((i for i, step in enumerate(steps) if isinstance(step, ToTensor)), None)
    if cut is None:
        raise NotCacheable(f"the model's {what} transform has no ToTensor step")
    return steps[:cut], steps[cut + 1:]


def _normalisation(after: list, what: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    from torchvision.transforms import Normalize

    if not after:
        return (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    if len(after) != 1 or not isinstance(after[0], Normalize):
        raise NotCacheable(f"the model's {what} transform has steps after ToTensor other than one Normalize "
                           f"({', '.join(type(step).__name__ for step in after)})")
    mean, std = after[0].mean, after[0].std
    return tuple(float(v) for v in mean), tuple(float(v) for v in std)


def eval_geometry(preprocess: Callable, image_size: int) -> EvalGeometry:
    """The evaluation transform's geometric steps and normalisation (see EvalGeometry)."""
    from torchvision.transforms import Compose

    before, after = split_at_to_tensor(transform_steps(preprocess, "evaluation"), "evaluation")
    mean, std = _normalisation(after, "evaluation")
    description = f"size={image_size}|" + "|".join(repr(step) for step in before) + f"|mean={mean}|std={std}"
    return EvalGeometry(Compose(before), mean, std, " ".join(description.split()))


class ToUint8:
    """The cache's loader transform: PIL image -> the geometric steps -> uint8 tensor [3, S, S]."""

    def __init__(self, steps: Callable) -> None:
        self.steps = steps
        self.calls = 0  # counted in the process that calls it (the probe runs in the main process)

    def __call__(self, image) -> torch.Tensor:
        self.calls += 1
        image = self.steps(image)
        if getattr(image, "mode", "RGB") != "RGB":
            image = image.convert("RGB")
        return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()


# --------------------------------------------------------------------------- fingerprint
def _hash_array(digest, array) -> None:
    data = array.numpy() if isinstance(array, torch.Tensor) else np.asarray(array)
    digest.update(f"{data.dtype}{data.shape}".encode())
    digest.update(np.ascontiguousarray(data).view(np.uint8).reshape(-1).data)


def _hash_files(digest, paths: Sequence[str]) -> None:
    for path in paths:
        stat = os.stat(path)
        # fsencode: a name that is not valid UTF-8 hashes as its bytes (the same bytes as encode() for any other)
        digest.update(os.fsencode(path) + f"|{stat.st_size}|{stat.st_mtime_ns}\n".encode())


def _path_pairs(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], tuple) and isinstance(value[0][0], (str, os.PathLike))


# The folder below `root` where each torchvision dataset that mima reads (mima.data.clip_tasks) keeps
# its files, as torchvision 0.29 lays them out (mima's own list of the files each task needs names
# the same folders). These classes list their files in private attributes only, so the fingerprint
# covers this whole folder: both splits' files and the annotations. `root` itself would be too
# much for the classes that take the whole data root (StanfordCars, GTSRB, FER2013).
TORCHVISION_FOLDERS = {
    "StanfordCars": "stanford_cars", "GTSRB": "gtsrb", "OxfordIIITPet": "oxford-iiit-pet", "Flowers102": "flowers-102",
    "Food101": "food-101", "RenderedSST2": "rendered-sst2", "FER2013": "fer2013", "PCAM": "pcam",
}


def dataset_folder(dataset: VisionDataset) -> Path:
    """The folder a torchvision dataset reads its files from: its own folder below `root` for the
    classes of TORCHVISION_FOLDERS, else `root`."""
    import torchvision.datasets

    for name, folder in TORCHVISION_FOLDERS.items():
        if isinstance(dataset, getattr(torchvision.datasets, name)):
            return Path(dataset.root) / folder
    return Path(dataset.root)


def files_below(folder: Path) -> list[str]:
    """Every file below `folder` (following links), in a fixed sorted order."""
    files = []
    for directory, subdirs, names in os.walk(folder, followlinks=True):
        subdirs.sort()
        files += [os.path.join(directory, name) for name in sorted(names)]
    return files


def source_fingerprint(dataset: Dataset, digest=None) -> str:
    """A hash of what `dataset` reads: its files' names, sizes and modification times, or the bytes
    of its in-memory arrays; Subset indices included. Transforms are not part of it."""
    digest = digest if digest is not None else hashlib.sha256()
    from torchvision.datasets import VisionDataset

    if isinstance(dataset, Subset):
        _hash_array(digest, np.asarray(dataset.indices, dtype=np.int64))
        source_fingerprint(dataset.dataset, digest)
    elif _path_pairs(getattr(dataset, "samples", None)):
        # ImageFiles (DTD, EuroSAT, RESISC45, SUN397, custom folders), ImageFolder: (file, label) pairs
        _hash_files(digest, [str(path) for path, _ in dataset.samples])
        _hash_array(digest, np.asarray([label for _, label in dataset.samples], dtype=np.int64))
    elif isinstance(getattr(dataset, "images", None), np.ndarray):  # arrays in memory (the offline suite)
        _hash_array(digest, dataset.images)
        _hash_array(digest, dataset.labels)
    elif isinstance(getattr(dataset, "data", None), (np.ndarray, torch.Tensor)):  # MNIST, CIFAR, SVHN, STL10
        _hash_array(digest, dataset.data)
        labels = getattr(dataset, "targets", None) if getattr(dataset, "targets", None) is not None else getattr(dataset, "labels", [])
        _hash_array(digest, np.asarray(labels, dtype=np.int64))
    elif isinstance(dataset, TensorDataset):
        for tensor in dataset.tensors:
            _hash_array(digest, tensor)
    elif isinstance(dataset, VisionDataset) and dataset.root:  # every file of its folder (see TORCHVISION_FOLDERS)
        _hash_files(digest, files_below(dataset_folder(dataset)))
        digest.update(f"{type(dataset).__name__}|{getattr(dataset, 'split', '')}|{getattr(dataset, 'train', '')}".encode())
    else:
        raise NotCacheable(f"cannot fingerprint a {type(dataset).__name__} dataset")
    return digest.hexdigest()


# ------------------------------------------------------------------------------ splits
class CachedSplit(Dataset):
    """One cached split: uint8 images [N, 3, S, S] (memory-mapped, opened lazily in each process: a
    pickled memmap would be copied whole into every DataLoader worker) and int64 labels.
    Indexed like the source split, it returns (normalised float image, label), the evaluation
    transform's output."""

    def __init__(self, path: Path, labels: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> None:
        self.path, self.labels = Path(path), labels
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
        self._images: np.ndarray | None = None

    @property
    def images(self) -> np.ndarray:
        if self._images is None:
            self._images = np.load(self.path, mmap_mode="r")
        return self._images

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_images": None}

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        pixels = torch.from_numpy(np.array(self.images[index]))
        # ToTensor's float32 x / 255, then Normalize's (x - mean) / std: the same operations in order
        return pixels.to(torch.float32).div(255).sub(self.mean).div(self.std), int(self.labels[index])


@dataclass
class CachedTask:
    """A task's cached splits, and whether its training split is augmented (its loader applies the
    model's training transform; the offline and tensor suites do not)."""

    name: str
    splits: dict[str, CachedSplit]
    augment: bool

    def task_data(self) -> TaskData:
        return TaskData(**self.splits)


def _cache_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def file_checksum(path: Path) -> str:
    """The file's size and CRC-32 (zlib's, read in large chunks: about a second per GB), checked every
    time a run opens the cache."""
    crc = 0
    with open(path, "rb") as stream:
        while chunk := stream.read(CHECKSUM_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{path.stat().st_size}:{crc:08x}"


def _read_sidecar(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # a damaged sidecar: the cache entry is rebuilt
        return None


def _build_split(dataset: Dataset, image_size: int, target: Path, workers: int, what: str, progress: bool) -> np.ndarray:
    """Decode `dataset` (items: uint8 [3, S, S], label) into the .npy file `target`, atomically."""
    from tqdm.auto import tqdm

    count = len(dataset)
    labels = np.empty(count, dtype=np.int64)
    loader = DataLoader(dataset, batch_size=BUILD_BATCH, num_workers=workers, persistent_workers=False)
    with atomic_path(target) as temporary:
        images = np.lib.format.open_memmap(temporary, mode="w+", dtype=np.uint8, shape=(count, 3, image_size, image_size))
        position = 0
        with tqdm(total=count, desc=f"caching {what}", unit="img", disable=None if progress else True, mininterval=1.0, leave=False) as bar:
            for batch_images, batch_labels in loader:
                if batch_images.dtype != torch.uint8 or tuple(batch_images.shape[1:]) != (3, image_size, image_size):
                    raise MimaError(f"data.cache: {what} gave {batch_images.dtype} images of shape "
                                    f"{tuple(batch_images.shape[1:])}, expected uint8 (3, {image_size}, {image_size})")
                size = len(batch_labels)
                images[position:position + size] = batch_images.numpy()
                labels[position:position + size] = batch_labels.numpy()
                position += size
                bar.update(size)
        images.flush()
        del images
    return labels


def load_cached_task(
    spec: TaskSpec,
    options: LoadOptions,
    preprocess: Callable,
    cache_dir: Path,
    identity: dict,
    workers: int = 0,
    progress: bool = True,
    splits: Sequence[str] = SPLITS,
) -> CachedTask:
    """The cached splits of task `spec`, built or rebuilt where missing or stale: `splits` of them
    (an evaluation needs no training split, often the largest to decode and to checksum).

    `options` gives the root, image size, split seed and download flag; its transforms are replaced
    by the cache's. `identity` names the task's data (suite, root, custom path) for the file name."""
    geometry = eval_geometry(preprocess, options.image_size)
    eval_loader, train_loader = ToUint8(geometry.steps), ToUint8(geometry.steps)
    # The training split gets a transform of its own (the same steps) only to learn whether the
    # loader would augment it: the offline and tensor suites never do, image folders and `clip` do.
    loaded = spec.load(LoadOptions(root=options.root, image_size=options.image_size, split_seed=options.split_seed,
                                   preprocess=eval_loader, download=options.download, preprocess_train=train_loader))
    probe, _ = loaded.train[0]  # in this process: tells whether the loader applies its training transform
    if not isinstance(probe, torch.Tensor) or probe.dtype != torch.uint8:
        raise NotCacheable(f"task '{spec.name}' is built from tensors, not images (it ignores the model's transform)",
                           "leave data.cache false for this suite")
    augment = train_loader.calls > 0
    key = _cache_key({"task": spec.name, **identity, "split_seed": options.split_seed, "geometry": geometry.description})
    folder = Path(cache_dir) / f"{spec.name}-{key[:16]}"
    unknown = [split for split in splits if split not in SPLITS]
    if unknown:
        raise ValueError(f"unknown splits {unknown}: expected some of {SPLITS}")
    wanted, splits = splits, {}
    for split in wanted:
        dataset = getattr(loaded, split)
        fingerprint = _cache_key({"format": FORMAT, "key": key, "split": split, "count": len(dataset),
                                  "source": source_fingerprint(dataset)})
        images_path, sidecar_path = folder / f"{split}.npy", folder / f"{split}.json"
        sidecar = _read_sidecar(sidecar_path)
        fresh = sidecar is not None and sidecar.get("fingerprint") == fingerprint and images_path.is_file()
        if fresh and file_checksum(images_path) != sidecar.get("checksum"):
            # a cache file changed after it was written (zeroed, cut short, edited): trained on, it would
            # teach the model other images without a word
            print(f"data.cache: {images_path} does not match the checksum it was written with (damaged or edited); "
                  "decoding the split again", file=sys.stderr)
            fresh = False
        if not fresh:
            labels = _build_split(dataset, options.image_size, images_path, workers, f"{spec.name}/{split}", progress)
            sidecar = {"format": FORMAT, "fingerprint": fingerprint, "task": spec.name, "split": split,
                       "count": len(labels), "image_size": options.image_size, "geometry": geometry.description,
                       "labels": labels.tolist(), "checksum": file_checksum(images_path)}
            with atomic_path(sidecar_path) as temporary:  # last: a sidecar means a complete .npy beside it
                temporary.write_text(json.dumps(sidecar))
        splits[split] = CachedSplit(images_path, np.asarray(sidecar["labels"], dtype=np.int64), geometry.mean, geometry.std)
    return CachedTask(spec.name, splits, augment)
