"""The `data:` section of a run: which tasks, where their files are, how batches are made.

This dataclass is the one place where these options are written, each with its default and its other
facts (range, resume rule: mima.core.settings.option). TaskSuiteDataModule takes exactly
its fields as keyword arguments (mima.core.settings.takes_settings), so `mima fit` (LightningCLI)
and every command that reads a run config (mima.config.run_config, which imports no Lightning)
parse the same options with the same defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from mima.core.errors import MimaError
from mima.core.settings import BATCH_MAX, SEED_MAX, ValueRange, check_fields, option
from mima.data.image_folder import FolderTask

BATCH_SIZE = ValueRange(int, 1, BATCH_MAX)
SEED = ValueRange(int, 0, SEED_MAX)


@dataclass(frozen=True)
class DataSettings:
    """Tasks of one suite. Training batches follow the LightningModule's PhasePlan (one task per batch).

    Args:
        suite: task suite name (see `mima.data.registry.SUITES`); `custom` or null for a run of
            custom tasks only.
        tasks: task names in run order, from the suite and the custom tasks; None takes the
            suite's default list (or `benchmark`'s) followed by every custom task.
        benchmark: with suite `clip`, a benchmark's task list instead of `tasks`: "8" (Cars, DTD,
            EuroSAT, GTSRB, MNIST, RESISC45, SUN397, SVHN), "14" (+ STL10, OxfordIIITPet,
            Flowers102, CIFAR100, PCAM, FER2013) or "20" (+ CIFAR10, Food101, FashionMNIST,
            RenderedSST2, EMNIST, KMNIST); null: `tasks` decides.
        root: data root for suites read from disk (unused by the embedded `digits` suite).
        batch_size: training batch size per task (split evenly over a task's replicas); with
            `trainer.accumulate_grad_batches: a` it is the micro-batch, and each optimiser step sees
            a x batch_size examples of its task (exactly the batch of a run with a x batch_size).
        eval_batch_size: batch size for validation/test evaluation.
        num_workers: DataLoader worker processes.
        seed: data-order seed (each task's stream of permutations is keyed on it).
        split_seed: seed of the train/validation split (task_vectors' random_split generator seed;
            the default 0 gives task_vectors' own splits, `mima data splits` writes them).
        download: let torchvision download datasets missing under `root` (where it can; never
            needed for the bundled suites).
        custom_tasks: tasks read from folders of class folders (`mima.data.image_folder`), each
            with a name (not a suite task's), a path and optionally a class-names file and templates.
        cache: read every split from the decoded-image cache (`mima.data.cache_store`, built on first use
            or by `mima data cache`): images decoded, resized and centre-cropped once, stored as
            uint8; training batches are read by index, augmented (where the task is) and normalised
            on the device. Evaluation gives open_clip's tensors; the training crop is taken from the
            cached centre crop (see mima.data.cache_augment for every difference). Not for tensor suites
            (`digits`, `synthetic`). Default false: the per-image transform path.
        cache_dir: where the cache is written (default $MIMA_CACHE_DIR/data or ~/.cache/mima/data).
    """

    suite: str | None = option("digits")
    tasks: list[str] | None = option(None)
    benchmark: str | int | None = option(None)
    root: str | None = option(None)
    batch_size: int = option(128, bounds=BATCH_SIZE)
    eval_batch_size: int = option(256, bounds=BATCH_SIZE, resume="may change")  # evaluation only
    # the machine that plans a run need not be the one that runs it: no bound from this machine's cores
    num_workers: int = option(0, bounds=ValueRange(int, 0, 1024), resume="may change")
    seed: int = option(0, bounds=SEED)
    split_seed: int = option(0, bounds=SEED)
    download: bool = option(False, resume="may change")  # the same files, fetched or found
    custom_tasks: list[FolderTask] | None = option(None)
    cache: bool = option(False)
    cache_dir: str | None = option(None, resume="may change")  # the same images wherever the cache is

    def __post_init__(self) -> None:
        check_fields("data", self)
        if self.benchmark is not None:
            object.__setattr__(self, "benchmark", str(self.benchmark))  # `benchmark: 8` in YAML is an int
            benchmark_tasks(self.suite, self.tasks, self.benchmark)  # its mistakes, now

    def task_list(self) -> list[str] | None:
        """The run's task names (`tasks`, or `benchmark`'s list; None: the suite's default list)."""
        return benchmark_tasks(self.suite, self.tasks, self.benchmark)


def benchmark_tasks(suite: str | None, tasks: list[str] | None, benchmark: str | int | None) -> list[str] | None:
    """`tasks`, or the task list of `benchmark` (data.benchmark) where it is set."""
    from mima.data.clip_tasks import BENCHMARKS

    if benchmark is None:
        return tasks
    benchmark = str(benchmark)
    if suite != "clip":
        raise MimaError(f"data.benchmark: {benchmark} names a task list of suite clip, not of suite {suite!r}; set data.suite: clip or leave data.benchmark null")
    if benchmark not in BENCHMARKS:
        raise MimaError(f"data.benchmark: unknown benchmark {benchmark!r} (known: {', '.join(BENCHMARKS)})")
    if tasks is not None:
        raise MimaError(f"data.benchmark: set either data.tasks or data.benchmark ({benchmark}), not both")
    return list(BENCHMARKS[benchmark])
