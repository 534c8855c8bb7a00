"""The cached training path's host and device work per batch (issue 47, item 5): the per-example code
it replaced (tests/cache_reference.py) against the batch-at-a-time code in mima.data, side by side in
one run, with the ratio old / new (above 1: the new code is faster). Both compute the same values
(tests/data/test_cache_batches.py checks them bit for bit); this only times them.

  * crop boxes: `random.Random(draw)` and get_params' loop per example vs `crop_boxes` (one seeding
    and one read of the generator's words per example, the rest on the whole batch), open_clip's
    RandomResizedCrop (scale 0.9..1, ratio 3/4..4/3) on 224 x 224;
  * draw seeds: one sha256 of the whole string per example vs `draw_seeds` (the step's prefix hashed once);
  * task stream: one permutation read per position vs `TaskStream.batch` (slices of the permutation);
  * preparation: BatchPreparer's images with the augmented rows gathered and scattered back vs its
    whole-batch path (every row augmented, the usual MIMA batch), on --device.

    python benchmarks/cache_batches.py [--batches 128 1024] [--device cpu|cuda] [--prepare-batch 32] [--repeats 20]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/cache_reference.py, the per-example baseline

from mima.data.cache_augment import BatchPreparer, CropSettings, crop_boxes  # noqa: E402
from mima.data.sampler import TaskStream, draw_seeds  # noqa: E402
from tests import cache_reference as reference  # noqa: E402

OPEN_CLIP = CropSettings(scale=(0.9, 1.0), ratio=(3 / 4, 4 / 3), mode="bicubic")
MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)  # open_clip's


def median_seconds(work: Callable[[], object], repeats: int, synchronize: Callable[[], None] = lambda: None) -> float:
    """Median wall time of `work` over `repeats` calls, after one untimed call."""
    work()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def row(name: str, old: float, new: float) -> None:
    print(f"{name:<44} {old * 1e3:10.3f} {new * 1e3:10.3f} {old / new:7.2f}x")


def host_rows(batch: int, repeats: int) -> None:
    rng = random.Random(batch)
    draws = [rng.getrandbits(63) for _ in range(batch)]
    row(f"crop boxes, batch {batch}", median_seconds(lambda: [reference.crop_box(d, 224, OPEN_CLIP) for d in draws], repeats),
        median_seconds(lambda: crop_boxes(draws, 224, OPEN_CLIP), repeats))
    row(f"draw seeds, batch {batch}", median_seconds(lambda: [reference.draw_seed(3, "Cars", 17, p) for p in range(batch)], repeats),
        median_seconds(lambda: draw_seeds(3, "Cars", 17, range(batch)), repeats))
    old_stream, new_stream = reference.TaskStream("Cars", 50_000, 3), TaskStream("Cars", 50_000, 3)
    row(f"task stream, batch {batch}", median_seconds(lambda: old_stream.batch(1, batch), repeats),
        median_seconds(lambda: new_stream.batch(1, batch), repeats))


def prepare_row(batch: int, size: int, device: torch.device, repeats: int) -> None:
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=generator).to(device)
    boxes = torch.from_numpy(crop_boxes(list(range(batch)), size, OPEN_CLIP)).to(device)
    labels = torch.zeros(batch, dtype=torch.long, device=device)
    cached = (images, labels, labels, boxes, np.ones(batch, np.bool_))
    preparer = BatchPreparer(MEAN, STD, size, OPEN_CLIP)
    mean, std = (torch.tensor(values, device=device).view(1, -1, 1, 1) for values in (MEAN, STD))
    assert torch.equal(preparer(cached)[0], reference.prepare_rows(cached, mean, std, OPEN_CLIP.mode))
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    row(f"prepare, batch {batch} x {size}^2 on {device.type}",
        median_seconds(lambda: reference.prepare_rows(cached, mean, std, OPEN_CLIP.mode), repeats, synchronize),
        median_seconds(lambda: preparer(cached), repeats, synchronize))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 1024], help="host work: examples per batch")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prepare-batch", type=int, default=None, help="images per prepared batch (default 128 on cuda, 16 on cpu)")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    prepare_batch = args.prepare_batch or (128 if device.type == "cuda" else 16)
    print(f"{'median ms per batch':<44} {'old':>10} {'new':>10} {'old/new':>8}")
    for batch in args.batches:
        host_rows(batch, args.repeats)
    prepare_row(prepare_batch, args.image_size, device, max(3, args.repeats // 4) if device.type == "cpu" else args.repeats)


if __name__ == "__main__":
    main()
