"""issue 47, item 5: the cached path's batches computed a batch at a time (crop boxes, draw seeds, task
streams, the whole-batch resampling) are bit for bit the per-example rules they replaced
(tests/cache_reference.py), so every run's batches, results and resumes are unchanged."""

from __future__ import annotations

import hashlib
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mima.core.plan import PhasePlan
from mima.data.cache_augment import BatchPreparer, CachedTrainingSet, CropSettings, crop_boxes
from mima.data.sampler import JointBatchSampler, PhaseBatchSampler, TaskStream, draw_seeds
from tests import cache_reference as reference

OPEN_CLIP = CropSettings(scale=(0.9, 1.0), ratio=(3 / 4, 4 / 3), mode="bicubic")
SETTINGS = [
    OPEN_CLIP,
    CropSettings(scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), mode="bilinear"),  # torchvision's defaults: early fits
    CropSettings(scale=(0.5, 1.0), ratio=(1.5, 2.0), mode="bicubic"),  # wide: many rows fall back to the centre box
    CropSettings(scale=(0.5, 1.0), ratio=(0.3, 0.5), mode="nearest"),  # tall: the other clamp
    CropSettings(scale=(0.9, 1.0), ratio=(1.0, 1.0), mode="bicubic"),
]


def _draws(count: int, seed: int) -> list[int]:
    """Random 63-bit draw seeds (as draw_seeds gives) plus small ones and the edges of the seeding's
    32-bit words (a seed below 2**32 seeds Python's generator with one word, not two)."""
    rng = random.Random(seed)
    return [rng.getrandbits(63) for _ in range(count)] + list(range(40)) + [2**32 - 1, 2**32, 2**63 - 1]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.scale}-{s.ratio}")
def test_crop_boxes_of_a_batch_are_the_per_example_boxes(settings):
    for size in (1, 3, 16, 224):
        draws = _draws(1500, size)
        expected = [reference.crop_box(draw, size, settings) for draw in draws]
        assert [tuple(box) for box in crop_boxes(draws, size, settings).tolist()] == expected, size
    # few words read per draw: most rows' offsets run past them and are read again, to the same boxes
    draws = _draws(300, 1)
    assert [tuple(box) for box in crop_boxes(draws, 224, settings, words=41).tolist()] == \
        [reference.crop_box(draw, 224, settings) for draw in draws]


def test_crop_boxes_of_an_empty_batch_are_empty():
    assert crop_boxes([], 224, OPEN_CLIP).shape == (0, 4)


def test_draw_seeds_of_a_batch_are_the_per_example_hashes():
    for seed, task, step in ((0, "a", 0), (3, "Cars", 12345), (2**40, "x/y ü", 7)):
        positions = [*range(300), 10**6]
        seeds = draw_seeds(seed, task, step, positions)
        assert seeds == [reference.draw_seed(seed, task, step, position) for position in positions]
        assert all(type(value) is int for value in seeds)  # Python ints: random.Random seeds from them
    assert draw_seeds(1, "a", 2, range(16, 24)) == draw_seeds(1, "a", 2, range(32))[16:24]  # a shard's slice


@pytest.mark.parametrize("size,batch", [(1, 3), (7, 8), (50, 8), (13, 40), (100, 100), (1000, 128)])
def test_task_stream_batches_are_the_per_position_reads(size, batch):
    stream, old = TaskStream("t", size, 4), reference.TaskStream("t", size, 4)
    for step in (0, 1, 2, 5, 3, 11):  # out of order too, as after a resume
        assert stream.batch(step, batch) == old.batch(step, batch), step


def _digest(value) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def test_sampler_batches_and_boxes_are_the_ones_recorded_before_they_were_vectorised():
    """Digests of the samplers' (slot, example, draw) triples and of crop boxes, taken with the
    per-example code before issue 47's item 5: the batches of every existing run stay as they were."""
    plan = PhasePlan(tasks=("a", "b", "c"), local_tasks=(0, 2), total_steps=12, iterations=3)
    phase = [list(PhaseBatchSampler(plan, [50, 7], 8, seed=5, shard=shard, accumulate=accumulate, draws=draws,
                                    start_step=start))
             for shard, accumulate, draws, start in (((0, 1), 1, True, 0), ((1, 2), 2, True, 3), ((0, 1), 1, False, 0))]
    joint = [list(JointBatchSampler(["a", "b"], [13, 40], 6, 8, seed=2, shard=shard, accumulate=accumulate, draws=True))
             for shard, accumulate in (((0, 1), 1), ((1, 4), 2))]
    boxes = [[tuple(box) for box in crop_boxes([d * 7919 + (d << 40) for d in range(3000)], size, settings).tolist()]
             for settings in SETTINGS[:4] for size in (16, 224)]
    assert (_digest(phase), _digest(joint), _digest(boxes)) == ("7c3a5a29ddf52223", "9364471c58a815b7", "768eff400ea6f1d1")


# ------------------------------------------------------------------------------ batches
SIZE = 12


def _splits(counts, seed: int = 0) -> list[SimpleNamespace]:
    """Stand-ins for cached training splits: what CachedTrainingSet.__getitems__ reads of them."""
    rng = np.random.default_rng(seed)
    splits = []
    for count in counts:
        labels = rng.integers(0, 5, count)
        splits.append(SimpleNamespace(images=rng.integers(0, 256, (count, 3, SIZE, SIZE), dtype=np.uint8), labels=labels))
    return splits


def _normalisation(preparer: BatchPreparer) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.tensor(values).view(1, -1, 1, 1) for values in (preparer.mean, preparer.std))


def _reference_batch(splits, augment, crop, indices):
    """CachedTrainingSet's batch computed one example at a time from the per-example rules."""
    images = torch.stack([torch.from_numpy(np.array(splits[slot].images[example])) for slot, example, _ in indices])
    labels = torch.tensor([int(splits[slot].labels[example]) for slot, example, _ in indices])
    boxes = torch.tensor([reference.crop_box(draw, SIZE, crop) if augment[slot] else (0, 0, SIZE, SIZE)
                          for slot, _, draw in indices])
    augmented = np.array([augment[slot] for slot, _, _ in indices])
    return images, labels, torch.tensor([slot for slot, _, _ in indices]), boxes, augmented


@pytest.mark.parametrize("mode", ["mima", "joint"])
def test_cached_batches_and_their_preparation_are_the_per_example_ones(mode):
    """The loader's batches (one task per batch, or a joint batch mixing augmented and plain tasks)
    equal the per-example reference, and BatchPreparer's images equal the gathered-and-scattered
    row path bit for bit: over the whole batch when every row is augmented, over the rows otherwise."""
    splits, augment = _splits([30, 9, 17]), [True, False, True]
    dataset = CachedTrainingSet(splits, augment, OPEN_CLIP, SIZE)
    if mode == "mima":
        plan = PhasePlan(tasks=("a", "b", "c"), local_tasks=(0, 1, 2), total_steps=6, iterations=2)
        sampler = PhaseBatchSampler(plan, [30, 9, 17], 8, seed=1, draws=True)
    else:
        sampler = JointBatchSampler(["a", "b", "c"], [30, 9, 17], 4, 8, seed=1, draws=True)
    preparer = BatchPreparer((0.5, 0.4, 0.3), (0.2, 0.25, 0.3), SIZE, OPEN_CLIP)
    mean, std = _normalisation(preparer)
    seen = set()
    for indices in sampler:
        batch = dataset.__getitems__(indices)
        want = _reference_batch(splits, augment, OPEN_CLIP, indices)
        for got, expected in zip(batch[:4], want[:4]):
            assert got.dtype == expected.dtype and torch.equal(got, expected)
        assert np.array_equal(batch[4], want[4])
        images, labels, slots = preparer(batch)
        assert torch.equal(images, reference.prepare_rows(want, mean, std, OPEN_CLIP.mode))
        assert torch.equal(labels, want[1]) and torch.equal(slots, want[2])
        seen.add((bool(batch[4].all()), bool(batch[4].any())))
    # the whole-batch path, the row path and the batch with nothing to crop were all taken
    assert seen == ({(True, True), (False, False)} if mode == "mima" else {(False, True)})


def test_whole_batch_resampling_equals_the_row_path_on_a_large_batch():
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, generator=generator)
    boxes = torch.from_numpy(crop_boxes(_draws(21, 3), 32, OPEN_CLIP))
    batch = (images, torch.zeros(64, dtype=torch.long), torch.zeros(64, dtype=torch.long), boxes, np.ones(64, np.bool_))
    preparer = BatchPreparer((0.48, 0.46, 0.41), (0.27, 0.26, 0.28), 32, OPEN_CLIP)
    mean, std = _normalisation(preparer)
    assert torch.equal(preparer(batch)[0], reference.prepare_rows(batch, mean, std, OPEN_CLIP.mode))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream copy runs on a GPU only")
def test_a_batch_copied_on_the_side_stream_prepares_to_the_same_images():
    from mima.data.datamodule import TaskSuiteDataModule

    device = torch.device("cuda", torch.cuda.current_device())
    data = TaskSuiteDataModule(suite="offline", tasks=["digits"], cache=True)
    generator = torch.Generator().manual_seed(0)
    preparer = BatchPreparer((0.48, 0.46, 0.41), (0.27, 0.26, 0.28), 32, OPEN_CLIP)
    for _ in range(3):
        images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, generator=generator).pin_memory()
        boxes = torch.from_numpy(crop_boxes(_draws(21, 3), 32, OPEN_CLIP)).pin_memory()
        batch = (images, torch.arange(64), torch.zeros(64, dtype=torch.long), boxes, np.ones(64, np.bool_))
        moved = data.transfer_batch_to_device(batch, device, 0)
        assert all(tensor.device == device for tensor in moved[:4]) and isinstance(moved[4], np.ndarray)
        plain = tuple(value.to(device) if isinstance(value, torch.Tensor) else value for value in batch)
        for got, expected in zip(preparer(moved), preparer(plain)):
            assert torch.equal(got, expected)
