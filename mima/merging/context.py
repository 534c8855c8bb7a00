"""The tasks a merge is judged on: the model, each task's frozen head, each task's data splits.

Data-dependent strategies (AdaMerging, FW-Merging, Fisher, RegMean) run forward passes through it,
and validation selection scores merges with it. Built from a `mima fit` config (its `model:` and
`data:` sections) or a run folder, so a merge of a run is judged on that run's tasks; the models
given to a merge are taken to be in the config's task order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from torch import nn
from torch.func import functional_call
from torch.utils.data import DataLoader

from mima.data.datamodule import TaskSuiteDataModule
from mima.data.tasks import TaskData
from mima.errors import MimaError
from mima.evaluation.accuracy import TaskEvaluator
from mima.models.classifier import classify
from mima.models.clip import default_cache_dir, load_clip
from mima.models.heads import HeadKind, task_heads


@dataclass
class TaskContext:
    encoder: nn.Module
    tasks: list[str]
    heads: dict[str, torch.Tensor]
    splits: dict[str, TaskData]
    seed: int = 0
    notes: dict[str, object] = field(default_factory=dict)  # what data-dependent merges learnt, for reports
    _evaluators: dict[str, TaskEvaluator] = field(default_factory=dict)

    def loader(self, task: str, split: str, batch_size: int, shuffle: bool = False, seed: int | None = None) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed if seed is None else seed)
        dataset = getattr(self.splits[task], split)
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator if shuffle else None)

    def examples(self, task: str, split: str, count: int, batch_size: int = 32, seed: int | None = None):
        """Batches (images, labels) of `count` examples drawn in a fixed random order."""
        taken = 0
        for images, labels in self.loader(task, split, batch_size, shuffle=True, seed=seed):
            if taken >= count:
                return
            keep = min(len(labels), count - taken)
            taken += keep
            yield images[:keep], labels[:keep]

    def logits(self, weights: Mapping[str, torch.Tensor], task: str, images: torch.Tensor) -> torch.Tensor:
        """The task's logits with the encoder's weights replaced by `weights` (differentiable)."""
        features = functional_call(self.encoder, dict(weights), (images,))
        return classify(nn.Identity(), self.heads[task], features)

    def evaluator(self, split: str) -> TaskEvaluator:
        if split not in self._evaluators:
            datasets = {task: getattr(self.splits[task], split) for task in self.tasks}
            self._evaluators[split] = TaskEvaluator(self.encoder, self.heads, datasets)
        return self._evaluators[split]


def build_context(
    clip: str,
    pretrained: str | None,
    suite: str | None,
    tasks: list[str] | None,
    root: str | None = None,
    split_seed: int = 0,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    head_kind: HeadKind = "zero_shot",
    custom_tasks: list | None = None,
) -> TaskContext:
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    loaded = load_clip(clip, pretrained, cache_dir=cache)
    data = TaskSuiteDataModule(suite=suite, tasks=tasks, root=root, split_seed=split_seed, custom_tasks=custom_tasks)
    splits = {name: data.task_data(name, loaded.image_size, loaded.preprocess) for name in data.task_names}
    train_sets = {name: split.train for name, split in splits.items()}
    heads = task_heads(loaded, head_kind, data.task_specs, train_sets, cache, data.data_key)
    loaded.encoder.eval()
    return TaskContext(loaded.encoder, list(data.task_names), heads, splits, seed=seed)


def context_from_config(path: str | Path | dict) -> TaskContext:
    """The tasks of a `mima fit` config: a file, a run folder's config.yaml, or the parsed dict."""
    if isinstance(path, dict):
        return _context_from_dict(path, "config")
    path = Path(path)
    if path.is_dir():
        path = path / "config.yaml"
    if not path.is_file():
        raise MimaError(f"--config {path}: no such file")
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise MimaError(f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    return _context_from_dict(config, f"--config {path}")


def _context_from_dict(config: dict, source: str) -> TaskContext:
    model, data = config.get("model") or {}, config.get("data") or {}
    if "clip" not in model:
        raise MimaError(f"{source}: needs model.clip (the open_clip model the tasks' heads come from)")
    return build_context(
        model["clip"],
        model.get("pretrained"),
        data.get("suite", "digits"),
        data.get("tasks"),
        data.get("root"),
        data.get("split_seed", 0),
        data.get("seed", 0),
        model.get("cache_dir"),
        model.get("heads", "zero_shot"),
        custom_tasks=data.get("custom_tasks"),  # folder tasks (mima.data.image_folder), as dicts
    )
