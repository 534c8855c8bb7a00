"""Training on the decoded-image cache: random resized crops drawn per example, applied on the device.

The cached training splits (mima.data.cache_store) hold the S x S centre crop of each image as
uint8. `CachedTrainingSet` reads a batch of them by index and draws a crop box for each augmented
example (`crop_boxes`, the whole batch's at once); `BatchPreparer`, on the device and on the whole
batch, resamples the boxes (`resized_crops`) and normalises. The crop settings are read from the
model's training transform (open_clip's RandomResizedCrop: scale (0.9, 1.0), aspect 3/4..4/3, bicubic).

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

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from mima.core.errors import MimaError
from mima.data.cache_store import CachedSplit, split_at_to_tensor, transform_steps


@dataclass(frozen=True)
class CropSettings:
    """RandomResizedCrop's parameters, read from the model's training transform."""

    scale: tuple[float, float]
    ratio: tuple[float, float]
    mode: str  # grid_sample mode: bicubic, bilinear or nearest


def crop_settings(preprocess_train: Callable | None) -> CropSettings | None:
    """RandomResizedCrop's settings from the training transform (None: no training transform).
    Any other random step before ToTensor cannot run on cached images: an error, not a silent drop."""
    from torchvision.transforms import InterpolationMode, RandomResizedCrop

    if preprocess_train is None:
        return None
    before, _ = split_at_to_tensor(transform_steps(preprocess_train, "training"), "training")
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


TRIES = 10  # get_params' tries of a random area and aspect ratio
# 32-bit words of a draw's generator read at once: the tries' two random() calls (2 words each), then
# the two offsets (one word each, more where one is rejected), with room to spare. A draw whose offsets
# need more words is read again with 4 times as many (rare: each offset's word is rejected with
# probability below 1/2).
STREAM_WORDS = 4 * TRIES + 8


def crop_boxes(draws: Sequence[int], size: int, settings: CropSettings, words: int = STREAM_WORDS) -> np.ndarray:
    """[B, 4] int64 (top, left, height, width) of a random resized crop of a size x size image per
    draw seed: torchvision's RandomResizedCrop.get_params run on `random.Random(draw)` instead of the
    global generator (10 tries of a random area and log-uniform aspect ratio, then a centre crop of
    the clamped ratio), for every draw at once.

    Bit for bit what that per-draw loop gives (tests/cache_reference.py): the only per-draw step is
    seeding the Mersenne Twister and reading its next 32-bit words (`getrandbits` returns them in the
    order random() and randint() consume them); random()'s doubles, the tries, the first try that
    fits and randint's rejection sampling are then computed on all draws together with the same
    float64 operations (math.exp itself for the aspect ratio: numpy's exp may differ in the last bit)."""
    boxes = np.empty((len(draws), 4), dtype=np.int64)
    pending, words = list(range(len(draws))), max(words, 4 * TRIES)
    while pending:
        found, drawn = _boxes_from_words(_generator_words([draws[row] for row in pending], words), size, settings)
        rows = np.asarray(pending)
        boxes[rows[found]] = drawn[found]
        pending = rows[~found].tolist()
        words *= 4
    return boxes


def _generator_words(draws: Sequence[int], count: int) -> np.ndarray:
    """[B, count] uint32: the first `count` outputs of random.Random(draw)'s generator, per draw
    (getrandbits(32 n) holds the generator's next n outputs, the first in the lowest 32 bits)."""
    rng = random.Random()
    streams = []
    for draw in draws:
        rng.seed(draw)  # as random.Random(draw)
        streams.append(rng.getrandbits(32 * count).to_bytes(4 * count, "little"))
    return np.frombuffer(b"".join(streams), dtype="<u4").reshape(len(draws), count)


def _boxes_from_words(words: np.ndarray, size: int, settings: CropSettings) -> tuple[np.ndarray, np.ndarray]:
    """(found [B], boxes [B, 4]) from each draw's generator words; found is False where the offsets'
    rejection sampling ran past the words read."""
    count = words.shape[0]
    # random(): (a >> 5, b >> 6) of two consecutive words, as 53 bits; try t uses words 4t .. 4t+3
    high, low = (words[:, 0:4 * TRIES:2] >> 5).astype(np.float64), (words[:, 1:4 * TRIES:2] >> 6).astype(np.float64)
    uniform = (high * 67108864.0 + low) * (1.0 / 9007199254740992.0)
    log_low, log_high = math.log(settings.ratio[0]), math.log(settings.ratio[1])
    target_area = size * size * (settings.scale[0] + (settings.scale[1] - settings.scale[0]) * uniform[:, 0::2])
    log_aspect = log_low + (log_high - log_low) * uniform[:, 1::2]
    aspect = np.fromiter(map(math.exp, log_aspect.ravel().tolist()), np.float64, log_aspect.size).reshape(count, TRIES)
    width = np.rint(np.sqrt(target_area * aspect)).astype(np.int64)  # rint: round half to even, as round()
    height = np.rint(np.sqrt(target_area / aspect)).astype(np.int64)
    fits = (width > 0) & (width <= size) & (height > 0) & (height <= size)
    rows, first = np.arange(count), fits.argmax(axis=1)
    height, width = height[rows, first], width[rows, first]
    top, after_top, top_found = _randint_from(words, 4 * (first + 1), size - height)
    left, _, left_found = _randint_from(words, after_top, size - width)
    fitted = fits.any(axis=1)
    boxes = np.stack([top, left, height, width], axis=1)
    boxes[~fitted] = _centre_box(size, settings)
    return ~fitted | (top_found & left_found), boxes


def _randint_from(words: np.ndarray, start: np.ndarray, high: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """randint(0, high) per row from the words at `start` on: Python's rejection sampling (the top
    k = bit_length(high + 1) bits of a word until one is <= high). Returns (value, next word, found)."""
    bound = high + 1
    bits = np.frexp(bound.astype(np.float64))[1]  # bit_length of a positive integer below 2**53
    candidates = words.astype(np.int64) >> (32 - bits)[:, None]
    accepted = (candidates < bound[:, None]) & (np.arange(words.shape[1]) >= start[:, None])
    index = accepted.argmax(axis=1)
    return candidates[np.arange(len(words)), index], index + 1, accepted.any(axis=1)


def _centre_box(size: int, settings: CropSettings) -> tuple[int, int, int, int]:
    """get_params' box when no try fits: the centre crop of the aspect ratio clamped to the range (a
    square image: itself)."""
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
        slot_list, example_list, draw_list = (list(column) for column in zip(*indices))
        slot_array, examples = np.asarray(slot_list, dtype=np.int64), np.asarray(example_list, dtype=np.int64)
        slots = torch.from_numpy(slot_array)
        boxes = torch.tensor([[0, 0, size, size]], dtype=torch.long).repeat(count, 1)
        # a numpy array, not a tensor: Lightning moves only tensors to the device, so which rows to crop
        # is known on the host and choosing them makes the host wait for nothing
        augmented = np.zeros(count, dtype=np.bool_)
        present = sorted(set(slot_list))
        if len(present) == 1:  # a MIMA batch: one task, read straight into the batch (no second copy)
            split = self.splits[present[0]]
            images = torch.from_numpy(split.images[examples])
            labels = torch.from_numpy(split.labels[examples])
        else:  # a joint batch: every task's part, one read per task
            images = torch.empty((count, 3, size, size), dtype=torch.uint8)
            labels = torch.empty(count, dtype=torch.long)
        for slot in present:
            rows = np.flatnonzero(slot_array == slot)
            if len(present) > 1:
                images[rows] = torch.from_numpy(self.splits[slot].images[examples[rows]])
                labels[rows] = torch.from_numpy(self.splits[slot].labels[examples[rows]])
            if self.augment[slot] and self.crop is not None:
                augmented[rows] = True
                boxes[rows] = torch.from_numpy(crop_boxes([draw_list[row] for row in rows], size, self.crop))
        return images, labels, slots, boxes, augmented


class BatchPreparer:
    """Runs on the device, on a whole cached batch: uint8 -> float in [0, 1], the random resized crop
    of the augmented rows (one grid_sample over them: over the whole batch when every row is
    augmented, gathered and scattered back otherwise), normalisation. Returns (images, labels, slots),
    the batch of the per-image path."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], image_size: int, crop: CropSettings | None) -> None:
        self.mean, self.std = tuple(mean), tuple(std)
        self.image_size, self.crop = image_size, crop
        self.constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # mean, std per device

    def __call__(self, batch):
        images, labels, slots, boxes, augmented = batch
        pixels = images.to(torch.float32).div_(255)  # in place: one float buffer for the whole preparation
        augmented = np.asarray(augmented)  # on the host (see CachedTrainingSet.__getitems__)
        if self.crop is not None and augmented.all():  # every MIMA batch of an augmented task: no gather, no scatter
            pixels = resized_crops(pixels, boxes, self.crop.mode)
        elif self.crop is not None and augmented.any():  # a joint batch with tasks that are not augmented
            rows = torch.from_numpy(np.flatnonzero(augmented)).to(pixels.device, non_blocking=True)
            pixels[rows] = resized_crops(pixels[rows], boxes[rows], self.crop.mode)
        mean, std = self._normalisation(pixels.device)
        return pixels.sub_(mean).div_(std), labels, slots

    def _normalisation(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and std as [1, 3, 1, 1] tensors on `device`, copied there once, not at every batch."""
        if device not in self.constants:
            self.constants[device] = tuple(torch.tensor(values, dtype=torch.float32, device=device).view(1, -1, 1, 1)
                                           for values in (self.mean, self.std))
        return self.constants[device]


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
