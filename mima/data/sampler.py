"""The MIMA batch schedule: batch b of process step g depends only on (seed, task, per-task step).

Each task reads its training set as an endless stream of seeded permutations (one per epoch of
that task); per-task step s takes stream positions [s*B, (s+1)*B). Because nothing depends on
which process runs a task or on what ran before it, a run resumed at step g, a run with tasks
spread over several processes, and a single-task fine-tune all see the same batches.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, Subset, TensorDataset

from mima.core.plan import PhasePlan


def stream_seed(seed: int, task: str, epoch: int) -> int:
    """A 63-bit seed for one epoch of one task, stable across processes and Python runs."""
    digest = hashlib.sha256(f"mima/{seed}/{task}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class TaskStream:
    """Example indices of one task's training set, epoch after epoch, each epoch a fresh permutation."""

    def __init__(self, task: str, size: int, seed: int) -> None:
        if size < 1:
            raise ValueError(f"task '{task}' has an empty training set")
        self.task, self.size, self.seed = task, size, seed
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(stream_seed(self.seed, self.task, epoch))
            self._epoch, self._order = epoch, torch.randperm(self.size, generator=generator)
        return self._order

    def batch(self, task_step: int, batch_size: int) -> list[int]:
        """The example indices at stream positions [s B, (s + 1) B): slices of each epoch's permutation."""
        start, end = task_step * batch_size, (task_step + 1) * batch_size
        parts = []
        while start < end:
            epoch, offset = divmod(start, self.size)
            take = min(end - start, self.size - offset)  # the rest of this epoch, or of the batch
            parts.append(self._permutation(epoch)[offset : offset + take])
            start += take
        return torch.cat(parts).tolist()


def draw_seeds(seed: int, task: str, task_step: int, positions: Sequence[int]) -> list[int]:
    """The seeds of examples `positions` of task `task`'s batch at per-task step `task_step`: what the
    random crop of each example is drawn from (on the cached path and the per-image path). They
    depend on neither the process nor the shard nor the worker, so augmented batches are the same at
    any W and after a resume. Seed = the first 8 bytes (little-endian, 63 bits) of
    sha256("mima/{seed}/{task}/draw/{task_step}/{position}"); the step's prefix is hashed once and
    each position's digest continues a copy of it (the same digest: sha256 reads its input in order)."""
    prefix = hashlib.sha256(f"mima/{seed}/{task}/draw/{task_step}/".encode())
    heads = []
    for position in positions:
        digest = prefix.copy()
        digest.update(str(position).encode())
        heads.append(digest.digest()[:8])
    return (np.frombuffer(b"".join(heads), dtype="<u8") & np.uint64((1 << 63) - 1)).tolist()


def with_draws(pairs: list[tuple[int, int]], seed: int, task: str, task_step: int, positions: range) -> list[tuple[int, int, int]]:
    """(slot, example) pairs of a step's batch -> (slot, example, draw seed) triples."""
    return [(slot, example, draw) for (slot, example), draw in zip(pairs, draw_seeds(seed, task, task_step, positions))]


@contextlib.contextmanager
def seeded_randomness(draw: int) -> Iterator[None]:
    """Inside the block, torch's CPU generator, Python's `random` and numpy's global generator are
    seeded from `draw`; after it, all three are back where they were. A transform that draws from
    the global generators (torchvision's RandomResizedCrop, open_clip's colour jitter) then gives the
    same output for the same draw in any process or DataLoader worker, whatever ran before."""
    torch_state, python_state, numpy_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    torch.default_generator.manual_seed(draw)  # the CPU generator only: CUDA's stay as they are
    random.seed(draw)
    np.random.seed(draw % (1 << 32))
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _indexes_tensors(dataset: Dataset) -> bool:
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return isinstance(dataset, TensorDataset)


class MultiTaskDataset(Dataset):
    """Indexed by (slot, example) or (slot, example, draw): returns (image, label, slot) from the
    slot-th task's dataset. With a draw (`draw_seed`: data seed, task, per-task step, position in
    the step's batch) the example is read, and its training transform's random crop drawn, under
    `seeded_randomness(draw)`: an augmented batch is the same at any number of processes and
    workers and after a resume, as on the cached path, and no worker seeding is needed."""

    def __init__(self, datasets: Sequence[Dataset]) -> None:
        self.datasets = list(datasets)
        # A TensorDataset (or a Subset of one) only indexes its tensors: it draws nothing, so its
        # examples skip the seeding (saving and restoring three generators per example was a fifth of
        # a digits step on a CPU).
        self.draws_matter = [not _indexes_tensors(dataset) for dataset in self.datasets]

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)  # type: ignore[arg-type]

    def __getitem__(self, index: tuple[int, int] | tuple[int, int, int]):
        slot, example = index[0], index[1]
        if len(index) > 2 and self.draws_matter[slot]:
            with seeded_randomness(index[2]):
                image, label = self.datasets[slot][example]
        else:
            image, label = self.datasets[slot][example]
        return image, label, slot


def shard_slice(batch_size: int, shard: tuple[int, int]) -> slice:
    """The i-th of R equal slices of a batch, for shard = (i, R)."""
    index, count = shard
    if batch_size % count:
        raise ValueError(f"batch size {batch_size} does not split into {count} equal shards")
    size = batch_size // count
    return slice(index * size, (index + 1) * size)


def micro_batches(examples: list, accumulate: int) -> list[list]:
    """A step's examples (this replica's share) cut into `accumulate` equal consecutive micro-batches:
    Lightning averages their losses, so the step's gradient is the mean over the whole step batch,
    as without accumulation (up to the order of float sums)."""
    size = len(examples) // accumulate
    return [examples[i * size : (i + 1) * size] for i in range(accumulate)]


class PhaseBatchSampler(Sampler[list[tuple[int, int]]]):
    """Yields, for process steps start_step .. end, the batch of (slot, example) pairs of that step.

    Its length is always the whole plan: Lightning counts a resumed epoch's batches from where the
    checkpoint left off, so the sampler starts there instead of replaying the epoch's first batches.
    With R replicas per task, `shard = (i, R)` keeps the i-th of R equal slices of each task batch.
    With `accumulate = a` every step's batch holds a x batch_size examples, yielded as a micro-batches
    of batch_size (each replica's slice cut into a), so a step is the same set of examples as in a
    run with batch a x batch_size.
    """

    def __init__(
        self,
        plan: PhasePlan,
        train_sizes: Sequence[int],
        batch_size: int,
        seed: int,
        start_step: int = 0,
        shard: tuple[int, int] = (0, 1),
        accumulate: int = 1,
        draws: bool = False,
    ) -> None:
        if len(train_sizes) != len(plan.local_tasks):
            raise ValueError("one training-set size per local task is needed")
        if plan.batched:
            raise ValueError("a batched plan takes a batch of every local task per step: JointBatchSampler")
        self.plan, self.start_step, self.accumulate = plan, start_step, accumulate
        self.seed, self.draws = seed, draws  # draws: yield (slot, example, draw seed) triples
        self.batch_size = batch_size * accumulate  # examples per optimiser step
        self.shard_slice = shard_slice(self.batch_size, shard)
        self.streams = [
            TaskStream(plan.tasks[task_index], size, seed) for task_index, size in zip(plan.local_tasks, train_sizes)
        ]

    def __len__(self) -> int:
        return self.plan.local_steps * self.accumulate

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for step in range(self.start_step, self.plan.local_steps):
            position = self.plan.position(step)
            examples = self.streams[position.slot].batch(position.task_step, self.batch_size)
            pairs = [(position.slot, example) for example in examples[self.shard_slice]]
            if self.draws:
                stream = self.streams[position.slot]
                positions = range(self.batch_size)[self.shard_slice]
                pairs = with_draws(pairs, self.seed, stream.task, position.task_step, positions)
            yield from micro_batches(pairs, self.accumulate)


class JointBatchSampler(Sampler[list[tuple[int, int]]]):
    """The joint multi-task baseline's batches: every step holds one batch of every task, in task
    order. Task t's part at step s is exactly the batch MIMA gives task t at its own step s, so both
    modes see the same examples in the same order over the same S steps."""

    def __init__(
        self,
        tasks: Sequence[str],
        train_sizes: Sequence[int],
        total_steps: int,
        batch_size: int,
        seed: int,
        start_step: int = 0,
        shard: tuple[int, int] = (0, 1),
        accumulate: int = 1,
        draws: bool = False,
    ) -> None:
        if len(train_sizes) != len(tasks):
            raise ValueError("one training-set size per task is needed")
        self.total_steps, self.start_step, self.accumulate = total_steps, start_step, accumulate
        self.seed, self.draws = seed, draws  # draws: yield (slot, example, draw seed) triples
        self.batch_size = batch_size * accumulate  # examples of each task per optimiser step
        self.shard_slice = shard_slice(self.batch_size, shard)
        self.streams = [TaskStream(task, size, seed) for task, size in zip(tasks, train_sizes)]

    def __len__(self) -> int:
        return self.total_steps * self.accumulate

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for step in range(self.start_step, self.total_steps):
            # micro-batch m holds the m-th part of every task's batch, so each holds every task
            parts = [micro_batches(self._pairs(slot, stream, step), self.accumulate) for slot, stream in enumerate(self.streams)]
            for micro in range(self.accumulate):
                yield [pair for task_parts in parts for pair in task_parts[micro]]

    def _pairs(self, slot: int, stream: TaskStream, step: int) -> list:
        pairs = [(slot, example) for example in stream.batch(step, self.batch_size)[self.shard_slice]]
        if self.draws:
            pairs = with_draws(pairs, self.seed, stream.task, step, range(self.batch_size)[self.shard_slice])
        return pairs
