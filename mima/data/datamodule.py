"""The LightningDataModule: a task suite's splits and the MIMA training schedule."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
from torch.utils.data import DataLoader

from mima.data.registry import resolve_tasks
from mima.data.sampler import MultiTaskDataset, PhaseBatchSampler
from mima.data.tasks import LoadOptions, TaskData, TaskSpec
from mima.errors import MimaError


class TaskSuiteDataModule(L.LightningDataModule):
    """Tasks of one suite. Training batches follow the LightningModule's PhasePlan (one task per batch).

    Args:
        suite: task suite name (see `mima.data.registry.SUITES`).
        tasks: task names in run order; None takes the suite's default list.
        root: data root for suites read from disk (unused by the embedded `digits` suite).
        batch_size: training batch size per task (split evenly over a task's replicas).
        eval_batch_size: batch size for validation/test evaluation.
        num_workers: DataLoader worker processes.
        seed: data-order seed (each task's stream of permutations is keyed on it).
        split_seed: seed of the train/validation split.
        download: let torchvision download datasets missing under `root` (where it can; never
            needed for the bundled suites).
    """

    def __init__(
        self,
        suite: str = "digits",
        tasks: list[str] | None = None,
        root: str | None = None,
        batch_size: int = 128,
        eval_batch_size: int = 256,
        num_workers: int = 0,
        seed: int = 0,
        split_seed: int = 0,
        download: bool = False,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise MimaError(f"data.batch_size must be positive, got {batch_size}")
        self.save_hyperparameters()
        self.task_specs: list[TaskSpec] = resolve_tasks(suite, tasks)
        self._loaded: dict[str, TaskData] = {}

    @property
    def task_names(self) -> list[str]:
        return [spec.name for spec in self.task_specs]

    def task_data(self, name: str, image_size: int, preprocess: Callable | None = None) -> TaskData:
        """The splits of task `name`, loaded once. `preprocess` is the model's image transform (for
        datasets of PIL images); tensor datasets are sized by `image_size`."""
        if name not in self._loaded:
            spec = next(spec for spec in self.task_specs if spec.name == name)
            options = LoadOptions(
                root=self.hparams.root,
                image_size=image_size,
                split_seed=self.hparams.split_seed,
                preprocess=preprocess,
                download=self.hparams.download,
            )
            self._loaded[name] = spec.load(options)
        return self._loaded[name]

    def train_dataloader(self) -> DataLoader:
        module = self.trainer.lightning_module
        plan = module.plan
        local = [self.task_data(plan.tasks[i], module.image_size, module.preprocess).train for i in plan.local_tasks]
        sampler = PhaseBatchSampler(
            plan,
            train_sizes=[len(dataset) for dataset in local],
            batch_size=self.hparams.batch_size,
            seed=self.hparams.seed,
            start_step=self.trainer.global_step,  # restored before this is called: resume where it stopped
            shard=module.replica,
        )
        return DataLoader(
            MultiTaskDataset(local),
            batch_sampler=sampler,
            num_workers=self.hparams.num_workers,
            persistent_workers=self.hparams.num_workers > 0,
        )
