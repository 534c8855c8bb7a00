"""Top-1 accuracy of an image encoder on tasks, each against its own frozen zero-shot head.

What is counted is the number of correct predictions and the number of examples of a (task, split):
integers, so that results computed by several processes, or over several sessions, add up exactly.
The accuracy is derived from them as torchmetrics' MulticlassAccuracy (micro) computes it: the two
counts as float32, divided in float32 (`accuracy_of`; tests/evaluation/test_evaluate.py checks the equality).

The evaluation loop records which images it classified correctly (`correct_images`, in the
dataset's order: the per-image records that mima.evaluation.statistics compares models on), keeps
them on the device and reads them once per task: no host synchronisation per batch. It runs in
the precision given (`EvalSettings.precision`): "32-true" (float32; TF32 matmuls are allowed on
CUDA) or "bf16-mixed"/"16-mixed" (autocast over the encoder; the head's product stays in float32),
and stops between two batches when `should_stop` says so (a SIGTERM or SIGUSR1 seen by `mima evaluate`).

An evaluator's passes share one set of `num_workers` loader workers with every other evaluator of
its LoaderPool (mima.evaluation.loader_pool; a TaskPool's evaluators share the pool's): a process
has at most `num_workers` of them alive, however many tasks and splits it evaluates. Each worker
prepares at most `prefetch_factor` batches ahead, so at most num_workers x prefetch_factor batches
are in flight (pinned, on a GPU) at any time.

With the decoded-image cache (`EvalSettings.cache`, `mima evaluate --cache`: mima.evaluation.cache_use)
a cached split is read in whole uint8 batches and normalised on the device
(mima.evaluation.cached_batches), several models are evaluated on each batch read
(`TaskEvaluator.records_of_models`), and on CUDA the encoder is compiled for inference
(`inference_forward`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from mima.core.errors import MimaError
from mima.core.names import EVAL_BATCH_SIZE
from mima.evaluation.cache_use import CacheUse
from mima.evaluation.cached_batches import CachedBatches, cached_rows
from mima.evaluation.loader_pool import LoaderPool
from mima.models.classifier import classify

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
Counts = tuple[int, int]  # (correct, total)


class EvaluationStopped(Exception):
    """Raised between two batches when a stop was requested; what was finished before is kept."""


@dataclass(frozen=True)
class EvalSettings:
    """How the evaluation loop runs (none of it changes a float32 result).

    precision: "32-true", "bf16-mixed" or "16-mixed" (autocast on the encoder's device).
    batch_size: images per forward pass.
    num_workers: DataLoader worker processes, shared by every pass of a LoaderPool (0: load in this process).
    pin_memory: page-locked host batches, copied to the device without blocking (CUDA only).
    prefetch_factor: batches each worker prepares ahead (bounds the batches in flight).
    cache: whether cached splits are read in whole batches made on the device, with several models
        per batch and (CUDA) a compiled encoder (mima.evaluation.cache_use; OFF: item by item).
    """

    precision: str = "32-true"
    batch_size: int = EVAL_BATCH_SIZE
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int = 2
    cache: CacheUse = CacheUse.OFF

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise MimaError(f"--precision: '{self.precision}' is none of {', '.join(PRECISIONS)}")
        if self.batch_size < 1 or self.num_workers < 0 or self.prefetch_factor < 1:
            raise MimaError(f"evaluation batch size {self.batch_size} / workers {self.num_workers} / prefetch "
                            f"{self.prefetch_factor}: expected >= 1 / >= 0 / >= 1")

    def loader(self, dataset: Dataset) -> DataLoader:
        """A DataLoader of `dataset` alone; its workers (not persistent) end when a pass does."""
        return DataLoader(dataset, batch_size=self.batch_size, num_workers=self.num_workers, pin_memory=self.pin_memory,
                          prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None)


def default_precision(device: torch.device) -> str:
    """bf16-mixed on a GPU (the evaluation is bound by the forward passes), float32 on the CPU."""
    return "bf16-mixed" if device.type == "cuda" else "32-true"


def accuracy_of(correct: int, total: int) -> float:
    """correct / total as torchmetrics' micro accuracy computes it (float32 counts, float32 division)."""
    if total <= 0:
        return 0.0
    return float(torch.tensor(correct, dtype=torch.float32) / torch.tensor(total, dtype=torch.float32))


def correct_images(encoder: nn.Module, head: torch.Tensor, loader: Iterable, precision: str = "32-true",
                   should_stop: Callable[[], bool] | None = None) -> np.ndarray:
    """Which images of `loader`'s (images, labels) batches the encoder with `head` classifies
    correctly, in the loader's order (a boolean array, one entry per image); the per-batch results
    stay on the device until the end (one host synchronisation per call)."""
    return models_correct_images(encoder, head, loader, None, precision, should_stop)[0]


@torch.no_grad()
def models_correct_images(encoder: nn.Module, head: torch.Tensor, loader: Iterable,
                          models: Sequence[Mapping[str, torch.Tensor]] | None, precision: str = "32-true",
                          should_stop: Callable[[], bool] | None = None,
                          forward: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[np.ndarray]:
    """`correct_images` of each state dict of `models` (None: the encoder's weights as they are),
    each batch of `loader` read once and every model evaluated on it: a single model is loaded once;
    with several, each one's tensors are copied into the encoder's before its forward pass on the
    batch (the encoder ends holding the last one's). `forward` (default: the encoder) is what runs
    the encoder's weights, e.g. its compiled form (`inference_forward`)."""
    device = next(encoder.parameters()).device
    head = head.to(device)
    forward = forward if forward is not None else encoder
    targets, sources = _weight_copies(encoder, models, device)
    found: list[list[torch.Tensor]] = [[] for _ in range(1 if models is None else len(models))]
    was_training = encoder.training
    encoder.eval()
    autocast = (torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision]) if precision in AUTOCAST_DTYPES
                else contextlib.nullcontext())
    batches = iter(loader)
    try:
        for images, labels in batches:
            if should_stop is not None and should_stop():
                raise EvaluationStopped()
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            for index, record in enumerate(found):
                if sources is not None:
                    for target, source in zip(targets, sources[index]):
                        target.copy_(source)
                with autocast:
                    features = forward(images)
                # the encoder in the chosen precision, the zero-shot head in float32: class logits of a
                # CLIP head lie close together, and a bfloat16 product (8-bit mantissa) flips near-ties
                logits = classify(nn.Identity(), head, features.float())
                record.append(logits.argmax(dim=1) == labels)
    finally:
        encoder.train(was_training)
        # dropped now, not when a traceback holding this frame is collected: a loader's own workers
        # (not persistent) end with their iterator, and a LoaderPool's next pass may start others
        del batches
    return [torch.cat(record).cpu().numpy() if record else np.zeros(0, dtype=bool) for record in found]


def _weight_copies(encoder: nn.Module, models: Sequence[Mapping[str, torch.Tensor]] | None,
                   device: torch.device) -> tuple[list[torch.Tensor], list[list[torch.Tensor]] | None]:
    """The encoder's tensors and, when several models take turns on each batch, each model's
    tensors in the same order, on the device (copied there once, not once per batch). Every model is
    loaded strictly once first: one that does not fit the encoder exactly fails here, before any batch."""
    for model in models or ():
        encoder.load_state_dict(model, strict=True)
    if models is None or len(models) < 2:
        return [], None
    targets = encoder.state_dict(keep_vars=True)
    return list(targets.values()), [[model[name].to(device) for name in targets] for model in models]


class PaddedForward:
    """The encoder compiled for inference (torch.compile, one static shape): every batch is padded to
    `batch_size` rows, so that a pass's shorter last batch reuses the compiled graph instead of
    compiling another, and only the real rows' features are returned."""

    def __init__(self, encoder: nn.Module, batch_size: int) -> None:
        self.compiled = torch.compile(encoder, dynamic=False)
        self.batch_size = batch_size

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        count = images.shape[0]
        if count >= self.batch_size:
            return self.compiled(images)
        padding = images.new_zeros((self.batch_size - count, *images.shape[1:]))
        return self.compiled(torch.cat([images, padding]))[:count]


def inference_forward(encoder: nn.Module, settings: EvalSettings) -> Callable[[torch.Tensor], torch.Tensor]:
    """What runs the encoder in an evaluation: compiled where the cache path runs on a CUDA device (the
    forward passes are then the evaluation's pace), the module itself elsewhere (never compiled on the
    CPU: compiling there takes longer than a whole CPU evaluation)."""
    on_cuda = next(encoder.parameters()).device.type == "cuda"
    return PaddedForward(encoder, settings.batch_size) if on_cuda and settings.cache != CacheUse.OFF else encoder


def counts_of(correct: np.ndarray) -> Counts:
    """(correct, total) of a per-image record."""
    return int(np.count_nonzero(correct)), int(correct.shape[0])


def count_correct(encoder: nn.Module, head: torch.Tensor, loader: Iterable, precision: str = "32-true",
                  should_stop: Callable[[], bool] | None = None) -> Counts:
    """(correct, total) of the encoder with `head` over the (images, labels) batches of `loader`."""
    return counts_of(correct_images(encoder, head, loader, precision, should_stop))


@torch.no_grad()
def task_accuracy(encoder: nn.Module, head: torch.Tensor, loader: DataLoader, precision: str = "32-true") -> float:
    return accuracy_of(*count_correct(encoder, head, loader, precision))


class TaskEvaluator:
    """Holds one working encoder, the tasks' heads and datasets; evaluates any encoder state dict,
    one task at a time, through `loaders` (shared with other evaluators, or its own), or, with the
    cache path on (`settings.cache`), a cached split's whole batches made on the device."""

    def __init__(
        self,
        encoder: nn.Module,
        heads: Mapping[str, torch.Tensor],
        datasets: Mapping[str, Dataset],
        batch_size: int = EVAL_BATCH_SIZE,
        settings: EvalSettings | None = None,
        loaders: LoaderPool | None = None,
    ) -> None:
        self.encoder = encoder
        self.heads = dict(heads)
        self.settings = settings if settings is not None else EvalSettings(batch_size=batch_size)
        self.datasets = dict(datasets)
        self.loaders = loaders if loaders is not None else LoaderPool()
        self._forward: Callable[[torch.Tensor], torch.Tensor] | None = None  # made at the first pass
        if self.settings.num_workers > 0:
            # the workers start once for all of them (the cached splits the cache path reads need none)
            self.loaders.know([dataset for name, dataset in self.datasets.items() if self._cached(name) is None])

    def _cached(self, name: str):
        """Task `name`'s cached split and indices, where the cache path reads it; else None."""
        return cached_rows(self.datasets[name]) if self.settings.cache != CacheUse.OFF else None

    def loader(self, name: str) -> Iterable:
        """One pass over task `name`'s batches: made on the device from the cache (see `_cached`), or
        from the loader pool, pinned when the settings say so or the encoder is on a CUDA device."""
        device = next(self.encoder.parameters()).device
        cached = self._cached(name)
        if cached is not None:
            return CachedBatches(*cached, self.settings.batch_size, device)
        pin = self.settings.pin_memory or device.type == "cuda"
        return self.loaders.one_pass(self.datasets[name], replace(self.settings, pin_memory=pin))

    def forward(self) -> Callable[[torch.Tensor], torch.Tensor]:
        if self._forward is None:
            self._forward = inference_forward(self.encoder, self.settings)
        return self._forward

    def load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load weights strictly: a merged state dict must fit the encoder exactly."""
        self.encoder.load_state_dict(state_dict, strict=True)

    def records(self, state_dict: Mapping[str, torch.Tensor], tasks: list[str] | None = None,
                on_task: Callable[[str, np.ndarray], None] | None = None,
                should_stop: Callable[[], bool] | None = None) -> dict[str, np.ndarray]:
        """Per task, which of its images (in the dataset's order) are classified correctly; `on_task`
        hears each task's record as soon as it is known."""
        hear = None if on_task is None else (lambda _, name, correct: on_task(name, correct))
        return {name: correct[0] for name, correct in
                self.records_of_models([state_dict], tasks, hear, should_stop).items()}

    def records_of_models(self, state_dicts: Sequence[Mapping[str, torch.Tensor]], tasks: list[str] | None = None,
                          on_record: Callable[[int, str, np.ndarray], None] | None = None,
                          should_stop: Callable[[], bool] | None = None) -> dict[str, list[np.ndarray]]:
        """Per task, each state dict's record (as `records`), every model evaluated on each batch read
        (one pass over a task's split for all of them); `on_record(model index, task, record)` hears
        each as soon as its task's pass ends."""
        found = {}
        for name in tasks if tasks is not None else list(self.datasets):
            found[name] = models_correct_images(self.encoder, self.heads[name], self.loader(name), state_dicts,
                                                self.settings.precision, should_stop, self.forward())
            for index, correct in enumerate(found[name]):
                if on_record is not None:
                    on_record(index, name, correct)
        return found

    def counts(self, state_dict: Mapping[str, torch.Tensor], tasks: list[str] | None = None,
               on_task: Callable[[str, Counts], None] | None = None,
               should_stop: Callable[[], bool] | None = None) -> dict[str, Counts]:
        """(correct, total) per task; `on_task` hears each task's counts as soon as they are known."""
        hear = None if on_task is None else (lambda name, correct: on_task(name, counts_of(correct)))
        return {name: counts_of(correct) for name, correct in self.records(state_dict, tasks, hear, should_stop).items()}

    def accuracy(self, state_dict: Mapping[str, torch.Tensor], tasks: list[str] | None = None) -> dict[str, float]:
        return {name: accuracy_of(*counts) for name, counts in self.counts(state_dict, tasks).items()}

    def mean_accuracy(self, state_dict: Mapping[str, torch.Tensor]) -> float:
        scores = self.accuracy(state_dict)
        return sum(scores.values()) / len(scores)
