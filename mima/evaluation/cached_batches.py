"""Evaluation batches read from the decoded-image cache and made on the device (`--cache on`).

The per-item path hands each image to a loader worker, which normalises it on the CPU and collates
a batch of float32 tensors four times the size of the pixels; with 8 workers decoding PNGs a GPU
evaluates about 1,200 images/s. Here a pass over a cached split (mima.data.cache_store.CachedSplit:
uint8 [N, 3, S, S], memory-mapped) reads each batch's rows at once into a host buffer (a thread of
its own fills the next buffer while the device works: numpy's copy releases the GIL), copies them
to the device as uint8 (pinned, non-blocking, on a side CUDA stream; the compute stream waits for
the copy's event, and the reader refills a buffer only once the copy out of it has finished), and
converts and normalises the whole batch there: float32 x / 255, then (x - mean) / std, the
operations CachedSplit applies to each item, in the same order, so the tensors are equal.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from mima.core.errors import MimaError
from mima.data.cache_store import CachedSplit, NotCacheable
from mima.data.tasks import TaskData
from mima.evaluation.cache_use import CacheUse

EVALUATED_SPLITS = ("val", "test")  # what an evaluation reads from the cache: the train split is not decoded
HOST_BUFFERS = 2  # one filled by the reader while the device copies out of the other
Rows = slice | np.ndarray  # a batch's rows of the cached file: a range, or sorted indices (--val-examples)


def cached_rows(dataset: Dataset) -> tuple[CachedSplit, np.ndarray | None] | None:
    """(the cached split, the indices read from it or None for all of it) of a CachedSplit or of a
    Subset of one (`--val-examples`); None for any other dataset (read item by item)."""
    if isinstance(dataset, CachedSplit):
        return dataset, None
    if isinstance(dataset, Subset) and isinstance(dataset.dataset, CachedSplit):
        return dataset.dataset, np.asarray(dataset.indices, dtype=np.int64)
    return None


def cached_eval_splits(data, splits: Mapping[str, TaskData], image_size: int, preprocess,
                       use: CacheUse) -> dict[str, TaskData]:
    """`splits` with each task's validation and test splits from the decoded-image cache (built where
    missing, those two only, through `data`'s TaskSuiteDataModule.cached_task: the files `data.cache:
    true` reads)
    when `use` says so; the train splits (the linear probes' data) stay as they are. A task the cache
    cannot hold keeps its own splits under CacheUse.WHERE_POSSIBLE and is one line under EVERY_TASK."""
    if use == CacheUse.OFF:
        return dict(splits)
    chosen = {}
    for name, task in splits.items():
        try:
            cached = data.cached_task(name, image_size, preprocess, splits=EVALUATED_SPLITS)
        except NotCacheable as refusal:
            if use == CacheUse.EVERY_TASK:
                raise MimaError(f"--cache on: {refusal.reason}, which the decoded-image cache cannot hold; "
                                "give --cache auto (the cache where it can) or --cache off") from None
            chosen[name] = task  # its images are tensors in memory already: nothing to decode
            continue
        chosen[name] = TaskData(train=task.train, val=cached.splits["val"], test=cached.splits["test"])
    return chosen


class _HostReader:
    """Reads each batch's uint8 rows into one of HOST_BUFFERS host buffers (pinned for a GPU), in a
    thread of its own, in order; `next()` gives (buffer, rows read) and `release(buffer, copied)`
    hands a buffer back once its rows are on the device (`copied`: the CUDA event of the copy)."""

    def __init__(self, images: np.ndarray, batches: Sequence[Rows], rows_per_batch: int, gpu: int | None) -> None:
        shape = (rows_per_batch, *images.shape[1:])
        self.gpu = gpu  # the CUDA device whose copies the reader waits for; None: the CPU, nothing pinned
        self.buffers = [torch.empty(shape, dtype=torch.uint8, pin_memory=gpu is not None) for _ in range(HOST_BUFFERS)]
        self.free: queue.Queue = queue.Queue()
        for slot in range(HOST_BUFFERS):
            self.free.put((slot, None))
        self.ready: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._read, args=(images, list(batches)), daemon=True,
                                       name="mima-cached-batches")
        self.thread.start()

    def _read(self, images: np.ndarray, batches: list[Rows]) -> None:
        try:
            if self.gpu is not None:
                # a new thread's current CUDA device is 0: waiting on an event from there would open a
                # context on GPU 0 in every process (mima.evaluation.device)
                torch.cuda.set_device(self.gpu)
            for rows in batches:
                slot, copied = self.free.get()
                if slot is None:  # closed: the pass ended early
                    return
                if copied is not None:
                    copied.synchronize()  # the device's copy out of this buffer has finished
                count = rows.stop - rows.start if isinstance(rows, slice) else len(rows)
                target = self.buffers[slot][:count].numpy()
                if isinstance(rows, slice):
                    np.copyto(target, images[rows])
                else:  # sorted indices into the file; "clip" (never needed: they are in range) writes straight to `out`
                    np.take(images, rows, axis=0, out=target, mode="clip")
                self.ready.put((slot, count))
            self.ready.put(None)
        except BaseException as error:  # handed to the consuming thread, which raises it
            self.ready.put(error)

    def next(self) -> tuple[int, int] | None:
        item = self.ready.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def release(self, slot: int, copied: torch.cuda.Event | None) -> None:
        self.free.put((slot, copied))

    def close(self) -> None:
        self.free.put((None, None))  # wakes a reader waiting for a buffer; one reading finishes its batch
        self.thread.join()


class CachedBatches:
    """One pass over a cached split: (images, labels) batches on `device`, as the evaluation transform
    would give them (normalised float32 [B, 3, S, S], int64 labels), in the split's order."""

    def __init__(self, split: CachedSplit, indices: np.ndarray | None, batch_size: int, device: torch.device) -> None:
        self.split, self.indices, self.batch_size, self.device = split, indices, batch_size, device

    def __len__(self) -> int:
        count = len(self.split) if self.indices is None else len(self.indices)
        return -(-count // self.batch_size)

    def _batches(self) -> list[Rows]:
        size, indices = self.batch_size, self.indices
        if indices is None:
            count = len(self.split)
            return [slice(start, min(start + size, count)) for start in range(0, count, size)]
        return [indices[start:start + size] for start in range(0, len(indices), size)]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        split, device = self.split, self.device
        batches = self._batches()
        if not batches:
            return
        labels = torch.from_numpy(split.labels if self.indices is None else split.labels[self.indices]).to(device)
        mean, std = split.mean.view(1, -1, 1, 1).to(device), split.std.view(1, -1, 1, 1).to(device)
        cuda = device.type == "cuda"
        copies = torch.cuda.Stream(device) if cuda else None
        gpu = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
        reader = _HostReader(split.images, batches, min(self.batch_size, len(labels)), gpu)
        start = 0
        try:
            while (item := reader.next()) is not None:
                slot, count = item
                host = reader.buffers[slot][:count]
                if copies is not None:
                    compute = torch.cuda.current_stream(device)
                    with torch.cuda.stream(copies):
                        pixels = host.to(device, non_blocking=True)
                        copied = torch.cuda.Event()
                        copied.record(copies)
                    compute.wait_event(copied)
                    # allocated on the copy stream, used on the compute stream: not reused before that use ends
                    pixels.record_stream(compute)
                    reader.release(slot, copied)
                else:
                    pixels = host
                # ToTensor's float32 x / 255, then Normalize's (x - mean) / std: CachedSplit's operations, in order
                images = pixels.to(torch.float32).div(255).sub(mean).div(std)
                if copies is None:
                    reader.release(slot, None)  # `images` is new memory: the buffer may be refilled
                yield images, labels[start:start + count]
                start += count
        finally:
            reader.close()
