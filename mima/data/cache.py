"""The decoded-image cache: each task's splits decoded once, stored as uint8, read by index.

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
  train   batches are read by index (no decoding) and moved to the device as uint8 (pinned memory,
          non-blocking copies); `BatchPreparer` then runs, on the device and on the whole batch,
          the training augmentation where the task has one (open_clip's RandomResizedCrop: scale
          (0.9, 1.0), aspect 3/4..4/3, bicubic) and the normalisation.
  eval    validation, test, linear probes and every analysis read the same files (centre-cropped
          images, normalised when read).

The evaluation path gives open_clip's tensors: ToTensor is x / 255 in float32 and Normalize is
(x - mean) / std, the same float operations in the same order, so on the CPU the tensors are equal
(tests/test_data_cache.py asserts a max abs difference <= 1e-6; measured 0).

Deliberate differences from open_clip's per-image training transform:
  - the random resized crop is taken from the cached S x S centre crop, not from the original
    image: a non-square image loses the borders the centre crop cut off, and the crop is resampled
    from S x S pixels rather than from the full-resolution file (for scale (0.9, 1.0) the crop is an
    up-sampling by at most ~1.15x per side);
  - the resampling is torch's bicubic (`grid_sample`, a = -0.75, neighbours outside the crop read
    from the image, clamped to [0, 1]) instead of PIL's bicubic (a = -0.5);
  - crop boxes are drawn per example from a seed of (data seed, task, per-task step, position in
    the step's batch) instead of from the worker's global RNG, so the batches of a run are the same
    at any number of processes and workers, and after a resume.
The crop parameters follow torchvision's `RandomResizedCrop.get_params` (10 tries of a random area
and log-uniform aspect ratio, then a centre crop of the clamped ratio).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from mima.core.errors import MimaError
from mima.core.files import atomic_path
from mima.data.tasks import LoadOptions, TaskData, TaskSpec

FORMAT = 1  # of the sidecar; a change rebuilds every cache
SPLITS = ("train", "val", "test")
BUILD_BATCH = 64


def default_data_cache_dir() -> Path:
    """$MIMA_CACHE_DIR/data or ~/.cache/mima/data (mima.models.clip.default_cache_dir's folder; the
    data layer does not import mima.models)."""
    return Path(os.environ.get("MIMA_CACHE_DIR", Path.home() / ".cache" / "mima")) / "data"


# ---------------------------------------------------------------------------- transforms
@dataclass(frozen=True)
class EvalGeometry:
    """The model's evaluation transform cut at ToTensor: `steps` (PIL -> PIL: resize, centre crop,
    RGB) and the normalisation that follows ToTensor."""

    steps: Callable
    mean: tuple[float, ...]
    std: tuple[float, ...]
    description: str  # what the cache depends on (part of the fingerprint)


@dataclass(frozen=True)
class CropSettings:
    """RandomResizedCrop's parameters, read from the model's training transform."""

    scale: tuple[float, float]
    ratio: tuple[float, float]
    mode: str  # grid_sample mode: bicubic, bilinear or nearest


def _transforms_of(preprocess: Callable, what: str) -> list:
    steps = getattr(preprocess, "transforms", None)
    if steps is None:
        raise MimaError(f"data.cache: the model's {what} transform is not a torchvision Compose ({preprocess!r}); leave data.cache false")
    return list(steps)


def _split_at_to_tensor(steps: list, what: str) -> tuple[list, list]:
    from torchvision.transforms import ToTensor

    cut = next((i for i, step in enumerate(steps) if isinstance(step, ToTensor)), None)
    if cut is None:
        raise MimaError(f"data.cache: the model's {what} transform has no ToTensor step; leave data.cache false")
    return steps[:cut], steps[cut + 1:]


def _normalisation(after: list, what: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    from torchvision.transforms import Normalize

    if not after:
        return (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    if len(after) != 1 or not isinstance(after[0], Normalize):
        raise MimaError(f"data.cache: the model's {what} transform has steps after ToTensor other than one Normalize "
                        f"({', '.join(type(step).__name__ for step in after)}); leave data.cache false")
    mean, std = after[0].mean, after[0].std
    return tuple(float(v) for v in mean), tuple(float(v) for v in std)


def eval_geometry(preprocess: Callable, image_size: int) -> EvalGeometry:
    """The evaluation transform's geometric steps and normalisation (see EvalGeometry)."""
    from torchvision.transforms import Compose

    before, after = _split_at_to_tensor(_transforms_of(preprocess, "evaluation"), "evaluation")
    mean, std = _normalisation(after, "evaluation")
    description = f"size={image_size}|" + "|".join(repr(step) for step in before) + f"|mean={mean}|std={std}"
    return EvalGeometry(Compose(before), mean, std, " ".join(description.split()))


def crop_settings(preprocess_train: Callable | None) -> CropSettings | None:
    """RandomResizedCrop's settings from the training transform (None: no training transform).
    Any other random step before ToTensor cannot run on cached images: an error, not a silent drop."""
    from torchvision.transforms import InterpolationMode, RandomResizedCrop

    if preprocess_train is None:
        return None
    before, _ = _split_at_to_tensor(_transforms_of(preprocess_train, "training"), "training")
    crops = [step for step in before if isinstance(step, RandomResizedCrop)]
    others = [type(step).__name__ for step in before
              if not isinstance(step, RandomResizedCrop) and type(step).__name__ not in ("MaybeConvertMode", "function")]
    if len(crops) != 1 or others:
        raise MimaError(f"data.cache: the training transform must be one RandomResizedCrop (+ RGB conversion) before "
                        f"ToTensor, got {', '.join(type(step).__name__ for step in before)}; leave data.cache false")
    crop = crops[0]
    modes = {InterpolationMode.BICUBIC: "bicubic", InterpolationMode.BILINEAR: "bilinear", InterpolationMode.NEAREST: "nearest"}
    if crop.interpolation not in modes:
        raise MimaError(f"data.cache: RandomResizedCrop interpolation {crop.interpolation} has no grid_sample mode")
    return CropSettings(tuple(crop.scale), tuple(crop.ratio), modes[crop.interpolation])


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
        digest.update(f"{path}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())


def _path_pairs(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], tuple) and isinstance(value[0][0], (str, os.PathLike))


def _path_list(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], (str, os.PathLike))


def source_fingerprint(dataset: Dataset, digest=None) -> str:
    """A hash of what `dataset` reads: its files' names, sizes and modification times, or the bytes
    of its in-memory arrays; Subset indices included. Transforms are not part of it."""
    digest = digest if digest is not None else hashlib.sha256()
    from torchvision.datasets import VisionDataset

    if isinstance(dataset, Subset):
        _hash_array(digest, np.asarray(dataset.indices, dtype=np.int64))
        source_fingerprint(dataset.dataset, digest)
    elif _path_pairs(getattr(dataset, "samples", None) or getattr(dataset, "_samples", None)):
        # ImageFiles, ImageFolder (EuroSAT, RESISC45), GTSRB, StanfordCars: (file, label) pairs
        pairs = getattr(dataset, "samples", None) or dataset._samples
        _hash_files(digest, [str(path) for path, _ in pairs])
        _hash_array(digest, np.asarray([label for _, label in pairs], dtype=np.int64))
    elif _path_list(getattr(dataset, "_image_files", None) or getattr(dataset, "_images", None)):
        # DTD, SUN397, Flowers102, Food101, OxfordIIITPet: a list of files and one of labels
        _hash_files(digest, [str(path) for path in (getattr(dataset, "_image_files", None) or dataset._images)])
        _hash_array(digest, np.asarray(getattr(dataset, "_labels", []), dtype=np.int64))
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
    elif isinstance(dataset, VisionDataset) and dataset.root:  # every file below its root
        files = []
        for directory, subdirs, names in os.walk(dataset.root, followlinks=True):
            subdirs.sort()
            files += [os.path.join(directory, name) for name in sorted(names)]
        _hash_files(digest, files)
        digest.update(f"{type(dataset).__name__}|{getattr(dataset, 'split', '')}|{getattr(dataset, 'train', '')}".encode())
    else:
        raise MimaError(f"data.cache: cannot fingerprint a {type(dataset).__name__} dataset; leave data.cache false")
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


def _read_sidecar(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
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
        with tqdm(total=count, desc=f"caching {what}", unit="img", disable=not progress, mininterval=1.0, leave=False) as bar:
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
) -> CachedTask:
    """The cached splits of task `spec`, built or rebuilt where missing or stale.

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
        raise MimaError(f"data.cache: task '{spec.name}' is built from tensors, not images (it ignores the model's "
                        "transform); leave data.cache false for this suite")
    augment = train_loader.calls > 0
    key = _cache_key({"task": spec.name, **identity, "split_seed": options.split_seed, "geometry": geometry.description})
    folder = Path(cache_dir) / f"{spec.name}-{key[:16]}"
    splits = {}
    for split in SPLITS:
        dataset = getattr(loaded, split)
        fingerprint = _cache_key({"format": FORMAT, "key": key, "split": split, "count": len(dataset),
                                  "source": source_fingerprint(dataset)})
        images_path, sidecar_path = folder / f"{split}.npy", folder / f"{split}.json"
        sidecar = _read_sidecar(sidecar_path)
        if sidecar is None or sidecar.get("fingerprint") != fingerprint or not images_path.is_file():
            labels = _build_split(dataset, options.image_size, images_path, workers, f"{spec.name}/{split}", progress)
            sidecar = {"format": FORMAT, "fingerprint": fingerprint, "task": spec.name, "split": split,
                       "count": len(labels), "image_size": options.image_size, "geometry": geometry.description,
                       "labels": labels.tolist()}
            with atomic_path(sidecar_path) as temporary:  # last: a sidecar means a complete .npy beside it
                temporary.write_text(json.dumps(sidecar))
        splits[split] = CachedSplit(images_path, np.asarray(sidecar["labels"], dtype=np.int64), geometry.mean, geometry.std)
    return CachedTask(spec.name, splits, augment)


# ------------------------------------------------------------------------------ training
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


def whole_batch(batch):
    """collate_fn of the cached training loader: CachedTrainingSet.__getitems__ returns a whole batch."""
    return batch


class CachedTrainingSet(Dataset):
    """The cached training splits of a process's tasks, read a batch at a time.

    Indexed by the samplers' (slot, example, draw) triples; `__getitems__` returns the whole batch:
    uint8 images [B, 3, S, S], labels, slots, crop boxes [B, 4] (top, left, height, width) and
    whether each row is augmented (its task's loader applies the training transform)."""

    def __init__(self, splits: Sequence[CachedSplit], augment: Sequence[bool], crop: CropSettings | None, image_size: int) -> None:
        self.splits, self.augment, self.crop, self.image_size = list(splits), list(augment), crop, image_size

    def __len__(self) -> int:
        return sum(len(split) for split in self.splits)

    def __getitem__(self, index):
        return self.__getitems__([index])

    def __getitems__(self, indices: Sequence[tuple[int, int, int]]):
        count, size = len(indices), self.image_size
        slot_list = [slot for slot, _, _ in indices]
        slots = torch.tensor(slot_list, dtype=torch.long)
        boxes = torch.tensor([[0, 0, size, size]], dtype=torch.long).repeat(count, 1)
        augmented = torch.zeros(count, dtype=torch.bool)
        present = sorted(set(slot_list))
        if len(present) == 1:  # a MIMA batch: one task, read straight into the batch (no second copy)
            examples = np.asarray([example for _, example, _ in indices], dtype=np.int64)
            split = self.splits[present[0]]
            images = torch.from_numpy(split.images[examples])
            labels = torch.from_numpy(split.labels[examples])
        else:  # a joint batch: every task's part, one read per task
            images = torch.empty((count, 3, size, size), dtype=torch.uint8)
            labels = torch.empty(count, dtype=torch.long)
        for slot in present:
            rows = [row for row, s in enumerate(slot_list) if s == slot]
            if len(present) > 1:
                examples = np.asarray([indices[row][1] for row in rows], dtype=np.int64)
                images[rows] = torch.from_numpy(self.splits[slot].images[examples])
                labels[rows] = torch.from_numpy(self.splits[slot].labels[examples])
            if self.augment[slot] and self.crop is not None:
                augmented[rows] = True
                boxes[rows] = torch.tensor([crop_box(indices[row][2], size, self.crop) for row in rows], dtype=torch.long)
        return images, labels, slots, boxes, augmented


class BatchPreparer:
    """Runs on the device, on a whole cached batch: uint8 -> float in [0, 1], the random resized crop
    of the augmented rows (one grid_sample over them), normalisation. Returns (images, labels, slots),
    the batch of the per-image path."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], image_size: int, crop: CropSettings | None) -> None:
        self.mean, self.std = tuple(mean), tuple(std)
        self.image_size, self.crop = image_size, crop

    def __call__(self, batch):
        images, labels, slots, boxes, augmented = batch
        pixels = images.to(torch.float32).div_(255)  # in place: one float buffer for the whole preparation
        if self.crop is not None and bool(augmented.any()):
            rows = augmented.nonzero().squeeze(1)
            pixels[rows] = resized_crops(pixels[rows], boxes[rows], self.crop.mode)
        mean = torch.tensor(self.mean, dtype=torch.float32, device=pixels.device).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32, device=pixels.device).view(1, -1, 1, 1)
        return pixels.sub_(mean).div_(std), labels, slots


def resized_crops(pixels: torch.Tensor, boxes: torch.Tensor, mode: str = "bicubic") -> torch.Tensor:
    """Each image's box (top, left, height, width) resampled to the image's own size, in one
    grid_sample: output pixel centre u maps to x = left + (u + 1/2) * width / S - 1/2 in the source,
    i.e. in grid_sample's [-1, 1] units (align_corners=False) x_n = (w/S) u_n + (2 left + w)/S - 1.
    Values are clamped to [0, 1], as PIL clamps its bicubic overshoot to 0..255."""
    count, _, height, width = pixels.shape
    top, left, box_h, box_w = (boxes[:, i].to(pixels.dtype) for i in range(4))
    theta = torch.zeros((count, 2, 3), dtype=pixels.dtype, device=pixels.device)
    theta[:, 0, 0] = box_w / width
    theta[:, 0, 2] = (2 * left + box_w) / width - 1
    theta[:, 1, 1] = box_h / height
    theta[:, 1, 2] = (2 * top + box_h) / height - 1
    grid = F.affine_grid(theta, [count, 3, height, width], align_corners=False)
    sampled = F.grid_sample(pixels, grid, mode=mode, padding_mode="border", align_corners=False)
    return sampled.clamp_(0, 1)
