"""Task vectors as gradients: how much each fine-tuning epoch contributes, and whether merging
one-epoch fine-tunes is as good as merging converged ones.

Paper 004, "On Task Vectors and Gradients" (Zhou et al.), section 2.1:

- Fig. 3a: the share of epoch k in the total gradient norm, ||g_k|| / sum_k' ||g_k'||, where
  g_k (the paper's nabla^(k) L) is the sum over epoch k's optimiser steps of the minibatch gradients;
- Fig. 3b: the cosine of each epoch's gradient with the first epoch's, cos(g_k, g_1);
- Fig. 2: task arithmetic (theta_0 + lam * sum_t tau_t) of task vectors taken after one epoch and
  after all E epochs, with lam chosen on validation data for each, judged on test data.

Theorem 1 (eq. 1) is why plain SGD is the default: with a constant step size and no momentum or
weight decay, theta_end_of_epoch_k - theta_start_of_epoch_k = -lr * g_k exactly, so the one-epoch
task vector is -lr * g_1 (the paper states it for one full-batch step; with minibatches it is the
sum of the minibatch gradients, each taken at the weights of its own step). With --optimizer adamw,
g_k is still the sum of the raw minibatch gradients, not of the updates AdamW applies.

Each task is fine-tuned from theta_0 with the trainer's loss (mima.training.module): cross-entropy of
the normalised image features against the task's frozen head (mima.models.classifier.classify), all
encoder parameters trained, BatchNorm layers kept in eval mode (the trainer's `batchnorm: frozen`).
The loop is deliberately plain (no Lightning): an analysis needs the gradients, not a resumable run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from mima.analysis.gradients.options import DEFAULT_LR, NAME
from mima.core.errors import MimaError
from mima.core.names import ZERO_SHOT
from mima.core.subsets import fixed_subset
from mima.models.batchnorm import train_with_frozen_batchnorm
from mima.models.classifier import classify

StateDict = dict[str, torch.Tensor]
Optimizer = Literal["sgd", "adamw"]


# ------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class GradientSettings:
    epochs: int = 5
    optimizer: Optimizer = "sgd"
    lr: float = DEFAULT_LR["sgd"]
    weight_decay: float = 0.0  # adamw only; SGD stays plain so that the update is -lr * g exactly
    batch_size: int = 64
    train_examples: int | None = None  # None: the whole training split
    seed: int = 0

    def check(self) -> None:
        """Reject values the command line would otherwise fail on deep inside training."""
        if self.epochs < 1:
            raise MimaError(f"--epochs must be a positive whole number, got {self.epochs}")
        if self.optimizer not in DEFAULT_LR:
            raise MimaError(f"--optimizer must be one of {', '.join(DEFAULT_LR)}, got {self.optimizer!r}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise MimaError(f"--lr must be a positive number, got {self.lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise MimaError(f"--weight-decay must be a non-negative number, got {self.weight_decay}")
        if self.optimizer == "sgd" and self.weight_decay != 0:
            raise MimaError("--weight-decay applies to --optimizer adamw only (SGD stays plain: update = -lr * g)")
        if self.batch_size < 1:
            raise MimaError(f"--batch-size must be a positive whole number, got {self.batch_size}")
        if self.train_examples is not None and self.train_examples < 1:
            raise MimaError(f"--train-examples must be a positive whole number, got {self.train_examples}")


# ------------------------------------------------------------------------------ results
@dataclass
class EpochGradientStats:
    """Fig. 3 for one task: per-epoch gradient norms, their shares, and cosines with epoch 1."""

    norms: list[float]
    shares: list[float]
    cos_first: list[float]


@dataclass
class TaskTrajectory:
    """One task fine-tuned from theta_0 for E epochs."""

    task: str
    stats: EpochGradientStats
    train_loss: list[float]  # mean minibatch loss of each epoch
    steps_per_epoch: int
    one_epoch: StateDict = field(repr=False)
    converged: StateDict = field(repr=False)


@dataclass
class MergeResult:
    lam: float
    val_mean: float
    test: dict[str, float]

    @property
    def test_mean(self) -> float:
        return sum(self.test.values()) / len(self.test)


@dataclass
class EpochResult:
    gradient: StateDict  # sum of the epoch's minibatch gradients (at least float32), by parameter name
    mean_loss: float
    steps: int


# ------------------------------------------------------------------------ the computation
def trainable_parameters(encoder: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in encoder.named_parameters() if p.requires_grad}


def task_loss(encoder: nn.Module, head: torch.Tensor, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The trainer's loss (MimaModule.training_step): mean cross-entropy against the frozen head."""
    return F.cross_entropy(classify(encoder, head, images), labels)


def make_optimizer(parameters: Iterable[nn.Parameter], settings: GradientSettings) -> torch.optim.Optimizer:
    params = list(parameters)
    if settings.optimizer == "sgd":
        return torch.optim.SGD(params, lr=settings.lr, momentum=0.0, weight_decay=0.0)
    return torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)


def run_epoch(
    encoder: nn.Module,
    head: torch.Tensor,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
) -> EpochResult:
    """One pass over `batches`, one optimiser step per batch; returns g = sum of the step gradients."""
    params = trainable_parameters(encoder)
    device = next(iter(params.values())).device
    # At least float32, so that a sum of many small low-precision gradients keeps its mass.
    total = {
        name: torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32), device=device)
        for name, p in params.items()
    }
    loss_sum, steps = 0.0, 0
    for images, labels in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = task_loss(encoder, head, images.to(device), labels.to(device))
        loss.backward()
        for name, p in params.items():
            if p.grad is not None:  # a parameter the loss does not reach contributes zero
                total[name] += p.grad
        optimizer.step()
        loss_sum += float(loss.detach())
        steps += 1
    if steps == 0:
        raise MimaError("an epoch had no batches (empty training split?)")
    return EpochResult(total, loss_sum / steps, steps)


def epoch_gradient_stats(norms: Sequence[float], dots_with_first: Sequence[float]) -> EpochGradientStats:
    """Shares of the summed norm and cosines with g_1, from ||g_k|| and <g_k, g_1>."""
    total = sum(norms)
    shares = [n / total if total > 0 else 0.0 for n in norms]
    first = norms[0]
    cosines = [d / (n * first) if n > 0 and first > 0 else 0.0 for n, d in zip(norms, dots_with_first)]
    return EpochGradientStats(list(map(float, norms)), shares, cosines)


def _dot(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    return float(sum((a[k].double() * b[k].double()).sum() for k in a))


def snapshot(encoder: nn.Module) -> StateDict:
    return {key: value.detach().to("cpu", copy=True) for key, value in encoder.state_dict().items()}


def fine_tune_task(
    task: str,
    encoder: nn.Module,
    head: torch.Tensor,
    train_set: Dataset,
    theta_0: Mapping[str, torch.Tensor],
    settings: GradientSettings,
) -> TaskTrajectory:
    """Fine-tune `encoder` from theta_0 for E epochs; only g_1 and the current g_k are kept in memory."""
    encoder.load_state_dict(dict(theta_0), strict=True)
    encoder.requires_grad_(True)
    train_with_frozen_batchnorm(encoder)  # BatchNorm statistics stay theta_0's (the trainer's default)
    optimizer = make_optimizer(trainable_parameters(encoder).values(), settings)
    # One generator for the whole run: each epoch gets a new, reproducible order.
    loader = DataLoader(
        train_set, batch_size=settings.batch_size, shuffle=True, generator=torch.Generator().manual_seed(settings.seed),
        pin_memory=next(encoder.parameters()).device.type == "cuda",
    )
    norms: list[float] = []
    dots: list[float] = []
    losses: list[float] = []
    first: StateDict | None = None
    one_epoch: StateDict = {}
    steps = 0
    for epoch in range(settings.epochs):
        result = run_epoch(encoder, head, loader, optimizer)
        if first is None:
            first = result.gradient
            one_epoch = snapshot(encoder)
        norms.append(math.sqrt(_dot(result.gradient, result.gradient)))
        dots.append(_dot(result.gradient, first))
        losses.append(result.mean_loss)
        steps = result.steps
    encoder.eval()
    encoder.requires_grad_(False)
    return TaskTrajectory(task, epoch_gradient_stats(norms, dots), losses, steps, one_epoch, snapshot(encoder))


def task_vector_cosine(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> float:
    """cos(a - base, b - base) over the floating tensors."""
    keys = [k for k, v in base.items() if v.is_floating_point()]
    ta = {k: a[k].double() - base[k].double() for k in keys}
    tb = {k: b[k].double() - base[k].double() for k in keys}
    norm = math.sqrt(_dot(ta, ta) * _dot(tb, tb))
    return _dot(ta, tb) / norm if norm > 0 else 0.0


def merge_and_evaluate(pool, tasks: Sequence[str], models: Sequence[StateDict], theta_0: StateDict) -> MergeResult:
    """Task arithmetic with lam from the method's grid, chosen on mean validation accuracy; test accuracy."""
    from mima.merging import get_method
    from mima.merging.selection import select_on_validation

    validation = pool.evaluator("val")

    def score(merged: dict[str, torch.Tensor]) -> float:
        values = validation.accuracy(merged, tasks=list(tasks))
        return sum(values.values()) / len(values)

    selection = select_on_validation(get_method("task_arithmetic"), models, theta_0, score)
    test = pool.evaluator("test").accuracy(selection.merged, tasks=list(tasks))
    return MergeResult(float(selection.hparams["lam"]), float(selection.score), test)


def own_accuracy(pool, task: str, state: StateDict, split: str = "test") -> float:
    return pool.evaluator(split).accuracy(state, tasks=[task])[task]


def analyse_gradients(pool, tasks: Sequence[str], theta_0: StateDict, settings: GradientSettings,
                      log: Callable[[str], None] | None = None) -> dict:
    """Everything the command reports, as plain numbers (the JSON)."""
    settings.check()
    device = next(pool.encoder.parameters()).device
    per_task: dict[str, dict] = {}
    one_epoch_models, converged_models = [], []
    for task in tasks:
        started = time.perf_counter()
        train_set = fixed_subset(pool.splits[task].train, settings.train_examples, settings.seed)
        run = fine_tune_task(task, pool.encoder, pool.heads[task].to(device), train_set, theta_0, settings)
        one_epoch_models.append(run.one_epoch)
        converged_models.append(run.converged)
        per_task[task] = {
            "gradient_norm": run.stats.norms,
            "share": run.stats.shares,
            "cos_first": run.stats.cos_first,
            "train_loss": run.train_loss,
            "steps_per_epoch": run.steps_per_epoch,
            "train_examples": len(train_set),
            "cos_tau_one_epoch_converged": task_vector_cosine(run.one_epoch, run.converged, theta_0),
            "test_accuracy": {
                ZERO_SHOT: own_accuracy(pool, task, theta_0),
                "one_epoch": own_accuracy(pool, task, run.one_epoch),
                "converged": own_accuracy(pool, task, run.converged),
            },
        }
        if log is not None:
            log(f"  {task}: {settings.epochs} epochs x {run.steps_per_epoch} steps in {time.perf_counter() - started:.1f} s")
    merged = {
        "one_epoch": merge_and_evaluate(pool, tasks, one_epoch_models, theta_0),
        "converged": merge_and_evaluate(pool, tasks, converged_models, theta_0),
    }
    return {
        "analysis": NAME,
        "paper": "004 On Task Vectors and Gradients, section 2.1, Fig. 2 and 3",
        "tasks": list(tasks),
        "settings": asdict(settings),
        "per_task": per_task,
        "merged": {
            name: {**asdict(result), "test_mean": result.test_mean, "method": "task_arithmetic", "selected_on": "val"}
            for name, result in merged.items()
        },
    }
