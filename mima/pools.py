"""Model pool and task pool: what data-dependent merges, validation selection and the analyses
are given (FusionBench's separation of merge method, model pool and task pool).

- ModelPool: the fine-tuned state dicts (in task order), theta_0 when known, and where their tasks
  are defined (a run folder or a `mima fit` config). Built from one run folder or from files.
- TaskPool: the tasks a merge is judged on: the run's image encoder (for forward passes with other
  weights), each task's frozen head and data splits. Built from the run's configuration
  (mima.config.run_config), so it uses exactly the model, pretrained weights, heads and tasks
  `mima fit` used.

Merge strategies only see a TaskPool through the methods they call on it (tasks, examples, logits,
loader, evaluator); they never import this module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader, Dataset, Subset

from mima.core.errors import MimaError
from mima.core.run_folder import RunFolder
from mima.core.safetensors_io import load_state_dict
from mima.core.subsets import first_examples
from mima.data.listing import listing_changes
from mima.data.tasks import TaskData
from mima.evaluation.accuracy import EvalSettings, TaskEvaluator
from mima.evaluation.cache_use import CacheUse
from mima.evaluation.cached_batches import cached_eval_splits
from mima.evaluation.loader_pool import LoaderPool
from mima.merging.engine import expand_models
from mima.models.classifier import classify
from mima.core.cache_dir import cache_dir_or_default
from mima.models.clip import load_clip
from mima.models.heads import task_heads
from mima.config.run_config import RunConfig, load_run_config

StateDict = dict[str, torch.Tensor]


# ------------------------------------------------------------------------------ tasks
@dataclass
class TaskPool:
    encoder: nn.Module
    tasks: list[str]
    heads: dict[str, torch.Tensor]
    splits: dict[str, TaskData]
    seed: int = 0
    config: RunConfig | None = None
    _evaluators: dict[tuple, TaskEvaluator] = field(default_factory=dict)
    loaders: LoaderPool = field(default_factory=LoaderPool)  # the evaluators' one set of loader workers

    def loader(self, task: str, split: str, batch_size: int, shuffle: bool = False, seed: int | None = None) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed if seed is None else seed)
        dataset = getattr(self.splits[task], split)
        pin = next(self.encoder.parameters()).device.type == "cuda"
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator if shuffle else None,
                          pin_memory=pin)

    def examples(self, task: str, split: str, count: int, batch_size: int = 32, seed: int | None = None):
        """Batches (images, labels) of `count` examples drawn in a fixed random order."""
        return first_examples(self.loader(task, split, batch_size, shuffle=True, seed=seed), count)

    def logits(self, weights: Mapping[str, torch.Tensor], task: str, images: torch.Tensor) -> torch.Tensor:
        """The task's logits with the encoder's weights replaced by `weights` (differentiable)."""
        features = functional_call(self.encoder, dict(weights), (images,))
        return classify(nn.Identity(), self.heads[task], features)

    def evaluator(self, split: str, settings: EvalSettings | None = None, examples: int | None = None) -> TaskEvaluator:
        """An evaluator of every task's `split`; with `examples`, of a fixed random subset of that many
        examples per task (`fixed_subset`; the whole split where it is smaller). Every evaluator of
        this pool loads through `self.loaders`: one set of loader workers per pool, whatever the
        tasks and splits (mima.evaluation.loader_pool)."""
        key = (split, settings, examples)
        if key not in self._evaluators:
            datasets = {task: getattr(self.splits[task], split) for task in self.tasks}
            if examples is not None:
                datasets = {task: fixed_subset(dataset, examples) for task, dataset in datasets.items()}
            self._evaluators[key] = TaskEvaluator(self.encoder, self.heads, datasets, settings=settings, loaders=self.loaders)
        return self._evaluators[key]


SUBSET_SEED = 0  # --val-examples: the same examples in every run, process and session


def fixed_subset(dataset: Dataset, examples: int) -> Dataset:
    """`examples` examples of `dataset` drawn with a fixed seed (in index order), or all of it if smaller."""
    if examples >= len(dataset):
        return dataset
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SUBSET_SEED))
    return Subset(dataset, sorted(order[:examples].tolist()))


def task_pool(source: str | os.PathLike | Mapping | RunConfig | RunFolder,
              eval_cache: CacheUse = CacheUse.OFF) -> TaskPool:
    """The TaskPool of a run: a `mima fit` config file, a run folder, a config dict or a RunConfig;
    with `eval_cache` (`mima evaluate --cache`), its validation and test splits from the decoded-image
    cache (mima.evaluation.cached_batches.cached_eval_splits)."""
    config = source if isinstance(source, RunConfig) else load_run_config(source)
    model = config.model
    cache = cache_dir_or_default(model.cache_dir)
    loaded = load_clip(model.clip, model.pretrained, cache_dir=cache, quick_gelu=model.quick_gelu)
    data = config.datamodule()
    refuse_changed_listing(config, data.data_listing())
    splits = {name: data.task_data(name, loaded.image_size, loaded.preprocess) for name in data.task_names}
    train_sets = {name: split.train for name, split in splits.items()}
    heads = task_heads(loaded, model.heads, data.task_specs, train_sets, cache, data.data_key, model.probe_shots)
    splits = cached_eval_splits(data, splits, loaded.image_size, loaded.preprocess, eval_cache)
    loaded.encoder.eval()
    return TaskPool(loaded.encoder, list(data.task_names), heads, splits, seed=int(config.data.seed), config=config)


def refuse_changed_listing(config: RunConfig, listing: Mapping[str, Mapping]) -> None:
    """A run's tasks read from folders are evaluated on the listing the run recorded when it started
    (mima.data.listing): a folder changed since would score other images than the run's splits hold
    out. One line naming the run folder and the change."""
    source = Path(str(config.source).removeprefix("--config "))
    if source.name != "config.yaml" or not source.is_file():
        return  # a config file, not a run folder: nothing recorded to compare with
    run = RunFolder(source.parent)
    changes = listing_changes(run.data_listing() or {}, listing)
    if changes:
        raise MimaError(f"{run.path}: {'; '.join(changes)} since the run was trained; its test and validation splits "
                        "would hold other images: restore the folder (the run's data_listing.json records it)")


# ----------------------------------------------------------------------------- models
@dataclass
class ModelPool:
    """Fine-tuned task models (in task order), theta_0 if known, and where their tasks are defined."""

    tasks: list[str]
    models: list[StateDict]
    base: StateDict | None
    config: Path | None  # a `mima fit` config file or run folder: the tasks' model, heads and data
    run: RunFolder | None  # set when the models came from one run folder

    def require_base(self, option: str = "--base") -> StateDict:
        if self.base is None:
            raise MimaError(f"{option}: this analysis needs theta_0 (the pretrained state dict); give --base or a run folder")
        return self.base

    def run_config(self, option: str = "--config") -> RunConfig:
        if self.config is None:
            raise MimaError(f"{option}: needs the tasks' model and data; give a `mima fit` config or run folder")
        return load_run_config(self.config)

    def task_pool(self, option: str = "--config") -> TaskPool:
        """The TaskPool of the models' tasks (its task count must match the models)."""
        pool = task_pool(self.run_config(option))
        if len(pool.tasks) != len(self.models):
            raise MimaError(f"{option} {self.config}: {len(pool.tasks)} tasks but {len(self.models)} models were given")
        return pool

    def iterations(self) -> int | None:
        """N of the run the models come from, when known."""
        if self.run is not None and self.run.is_finished():
            return self.run.iterations()
        if self.config is None:
            return None
        try:
            return int(load_run_config(self.config).model.iterations)
        except MimaError:
            return None


def model_pool(paths: Sequence[Path], base: Path | None = None, config: Path | None = None) -> ModelPool:
    """One `mima fit` run folder, or safetensors files (task names = file stems) with --base/--config."""
    files, tasks, run_base = expand_models(list(paths))
    for file in files:
        if not file.is_file():
            raise MimaError(f"{file}: no such model file")
    base_path = base if base is not None else run_base
    if base_path is not None and not Path(base_path).is_file():
        raise MimaError(f"--base {base_path}: no such file")
    run = RunFolder(Path(paths[0])) if tasks is not None else None
    return ModelPool(
        tasks=tasks if tasks is not None else [file.stem for file in files],
        models=[load_state_dict(file) for file in files],
        base=load_state_dict(base_path) if base_path is not None else None,
        config=config if config is not None else (run.path if run else None),
        run=run,
    )
