"""One set of loader worker processes per evaluation process, reused by every pass over every split.

An evaluation makes many short passes: every model (theta_0, each task model, each merge at each
grid point) over every task's validation or test split. A DataLoader per task and split with
persistent workers keeps 2 x T x num_workers processes alive (1,280 per node for 20 tasks, 8
workers and 8 GPU processes), each with batches in flight; a fresh DataLoader per pass starts and
ends its workers every pass (about 0.1 s on the CPU, as long as a whole pass over a small split).
Here one DataLoader with persistent workers serves every dataset the process evaluates: its dataset
holds them all (forked into the workers once), and its batch sampler yields the batches of the pass
under way, as (dataset number, index) pairs. A dataset met for the first time ends the workers and
starts new ones that know it, so at most `num_workers` are alive at any time; an evaluator
announces all its datasets when it is made (`know`), so that happens once per evaluator, not per task.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from torch.utils.data import DataLoader, Dataset, Sampler

if TYPE_CHECKING:
    from mima.evaluation.accuracy import EvalSettings

Item = tuple[int, int]  # (dataset number, index in that dataset)


class Datasets(Dataset):
    """Every dataset the workers serve, by number; item (number, index) is datasets[number][index]."""

    def __init__(self, datasets: Sequence[Dataset]) -> None:
        self.datasets = list(datasets)

    def __getitem__(self, item: Item):
        number, index = item
        return self.datasets[number][index]

    def __len__(self) -> int:
        return sum(len(dataset) for dataset in self.datasets)


class PassBatches(Sampler[list[Item]]):
    """The batch sampler: the batches of the pass under way (set before each pass, read when it starts)."""

    def __init__(self) -> None:
        self.batches: list[list[Item]] = []

    def __iter__(self) -> Iterator[list[Item]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def batches_of(number: int, size: int, batch_size: int) -> list[list[Item]]:
    """Dataset `number`'s items in order, in batches of `batch_size` (the last one shorter)."""
    return [[(number, index) for index in range(start, min(start + batch_size, size))]
            for start in range(0, size, batch_size)]


class LoaderPool:
    """At most one DataLoader (and its workers) alive; see the module docstring."""

    def __init__(self) -> None:
        self.datasets: list[Dataset] = []
        self.loader: DataLoader | None = None
        self.options: tuple | None = None  # the settings the running loader was made with
        self.sampler = PassBatches()

    def number(self, dataset: Dataset) -> int | None:
        return next((number for number, known in enumerate(self.datasets) if known is dataset), None)

    def know(self, datasets: Iterable[Dataset]) -> None:
        """Add datasets the workers must serve; a new one ends the running workers (the next pass starts others)."""
        new = [dataset for dataset in datasets if self.number(dataset) is None]
        if new:
            self.close()
            self.datasets.extend(new)

    def close(self) -> None:
        """End the workers now: the loader held the last reference to its iterator, whose finaliser
        stops and joins them (no pass may be under way)."""
        self.loader = None
        self.options = None

    def one_pass(self, dataset: Dataset, settings: EvalSettings) -> Iterator:
        """The batches of `dataset` in order, as a DataLoader with `settings` would give them; to be
        iterated once (stopping early is fine: the next pass starts clean)."""
        if settings.num_workers == 0:  # loaded in this process: nothing to keep
            yield from settings.loader(dataset)
            return
        self.know([dataset])
        options = (settings.batch_size, settings.num_workers, settings.pin_memory, settings.prefetch_factor)
        if self.options != options:
            self.close()  # the old workers end before new ones start
            self.loader = DataLoader(Datasets(self.datasets), batch_sampler=self.sampler, num_workers=settings.num_workers,
                                     pin_memory=settings.pin_memory, prefetch_factor=settings.prefetch_factor,
                                     persistent_workers=True)
            self.options = options
        self.sampler.batches = batches_of(self.number(dataset), len(dataset), settings.batch_size)
        yield from self.loader
