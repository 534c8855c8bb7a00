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

import argparse
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from mima.analysis.common import fixed_subset, output_dir, save_figure, write_json
from mima.errors import MimaError
from mima.models.classifier import classify

NAME = "gradients"
JSON_FILE = f"{NAME}.json"
FIGURE_FILE = f"{NAME}.png"
StateDict = dict[str, torch.Tensor]
Optimizer = Literal["sgd", "adamw"]
DEFAULT_LR: dict[str, float] = {"sgd": 0.01, "adamw": 1e-3}


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


def set_train_mode(encoder: nn.Module) -> None:
    """Train mode, except BatchNorm: running statistics stay theta_0's (the trainer's default)."""
    encoder.train()
    for layer in encoder.modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            layer.eval()


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


def _snapshot(encoder: nn.Module) -> StateDict:
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
    set_train_mode(encoder)
    optimizer = make_optimizer(trainable_parameters(encoder).values(), settings)
    # One generator for the whole run: each epoch gets a new, reproducible order.
    loader = DataLoader(
        train_set, batch_size=settings.batch_size, shuffle=True, generator=torch.Generator().manual_seed(settings.seed)
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
            one_epoch = _snapshot(encoder)
        norms.append(math.sqrt(_dot(result.gradient, result.gradient)))
        dots.append(_dot(result.gradient, first))
        losses.append(result.mean_loss)
        steps = result.steps
    encoder.eval()
    encoder.requires_grad_(False)
    return TaskTrajectory(task, epoch_gradient_stats(norms, dots), losses, steps, one_epoch, _snapshot(encoder))


def task_vector_cosine(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> float:
    """cos(a - base, b - base) over the floating tensors."""
    keys = [k for k, v in base.items() if v.is_floating_point()]
    ta = {k: a[k].double() - base[k].double() for k in keys}
    tb = {k: b[k].double() - base[k].double() for k in keys}
    norm = math.sqrt(_dot(ta, ta) * _dot(tb, tb))
    return _dot(ta, tb) / norm if norm > 0 else 0.0


def merge_and_evaluate(context, tasks: Sequence[str], models: Sequence[StateDict], theta_0: StateDict) -> MergeResult:
    """Task arithmetic with lam from the method's grid, chosen on mean validation accuracy; test accuracy."""
    from mima.merging import get_method
    from mima.merging.selection import select_on_validation

    validation = context.evaluator("val")

    def score(merged: dict[str, torch.Tensor]) -> float:
        values = validation.accuracy(merged, tasks=list(tasks))
        return sum(values.values()) / len(values)

    selection = select_on_validation(get_method("task_arithmetic"), models, theta_0, score)
    test = context.evaluator("test").accuracy(selection.merged, tasks=list(tasks))
    return MergeResult(float(selection.hparams["lam"]), float(selection.score), test)


def own_accuracy(context, task: str, state: StateDict, split: str = "test") -> float:
    return context.evaluator(split).accuracy(state, tasks=[task])[task]


def analyse_gradients(context, tasks: Sequence[str], theta_0: StateDict, settings: GradientSettings, log=print) -> dict:
    """Everything the command reports, as plain numbers (the JSON)."""
    settings.check()
    device = next(context.encoder.parameters()).device
    per_task: dict[str, dict] = {}
    one_epoch_models, converged_models = [], []
    for task in tasks:
        started = time.perf_counter()
        train_set = fixed_subset(context.splits[task].train, settings.train_examples, settings.seed)
        run = fine_tune_task(task, context.encoder, context.heads[task].to(device), train_set, theta_0, settings)
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
                "zero_shot": own_accuracy(context, task, theta_0),
                "one_epoch": own_accuracy(context, task, run.one_epoch),
                "converged": own_accuracy(context, task, run.converged),
            },
        }
        log(f"  {task}: {settings.epochs} epochs x {run.steps_per_epoch} steps in {time.perf_counter() - started:.1f} s")
    merged = {
        "one_epoch": merge_and_evaluate(context, tasks, one_epoch_models, theta_0),
        "converged": merge_and_evaluate(context, tasks, converged_models, theta_0),
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


# ------------------------------------------------------------------------------- figure
def plot_gradients(results: Mapping, path: Path) -> None:
    """(a) share of the total gradient norm per epoch, (b) cos(g_k, g_1), (c) merged test accuracy."""
    import matplotlib.pyplot as plt

    tasks = list(results["tasks"])
    per_task = results["per_task"]
    epochs = len(per_task[tasks[0]]["share"])
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    width = 0.8 / len(tasks)
    xs = range(1, epochs + 1)
    for index, task in enumerate(tasks):
        offset = (index - (len(tasks) - 1) / 2) * width
        axes[0].bar([x + offset for x in xs], per_task[task]["share"], width=width, label=task)
        axes[1].plot(list(xs), per_task[task]["cos_first"], marker="o", label=task)
    axes[0].axhline(1 / epochs, color="grey", linestyle=":", linewidth=1, label="equal share (1/E)")
    axes[0].set(xlabel="epoch k", ylabel="||g_k|| / sum_k' ||g_k'||  (fraction)", title="(a) share of the total gradient norm")
    axes[1].set(xlabel="epoch k", ylabel="cos(g_k, g_1)", title="(b) alignment with the first epoch's gradient")
    axes[1].set_ylim(min(0.0, min(min(per_task[t]["cos_first"]) for t in tasks)) - 0.05, 1.05)
    for axis in axes[:2]:
        axis.set_xticks(list(xs))
        axis.legend(fontsize=8)
        axis.grid(axis="y", alpha=0.3)

    merged = results["merged"]
    groups = tasks + ["mean"]
    for index, (name, label) in enumerate((("one_epoch", "1 epoch"), ("converged", f"{epochs} epochs"))):
        values = [100 * merged[name]["test"][t] for t in tasks] + [100 * merged[name]["test_mean"]]
        offset = (index - 0.5) * 0.38
        bars = axes[2].bar([g + offset for g in range(len(groups))], values, width=0.38,
                           label=f"{label} (lam={merged[name]['lam']:g})")
        axes[2].bar_label(bars, fmt="%.0f", fontsize=7)
    zero_shot = [100 * per_task[t]["test_accuracy"]["zero_shot"] for t in tasks]
    zero_shot.append(sum(zero_shot) / len(zero_shot))
    axes[2].scatter(range(len(groups)), zero_shot, marker="_", s=900, color="black", linewidths=2, zorder=3,
                    label="zero-shot (theta_0)")
    axes[2].set_xticks(range(len(groups)), groups, rotation=20)
    axes[2].set(ylabel="test accuracy (%)", ylim=(0, 105), title="(c) task arithmetic merge: 1 epoch vs converged")
    axes[2].legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.17), ncol=3, markerscale=0.4)
    axes[2].grid(axis="y", alpha=0.3)
    settings = results["settings"]
    figure.suptitle(f"Task vectors vs per-epoch gradients (paper 004): {settings['optimizer']}, lr={settings['lr']:g}, "
                    f"batch {settings['batch_size']}, {epochs} epochs per task")
    save_figure(figure, path)


# --------------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run", type=Path, metavar="RUN",
        help="a `mima fit` run folder (theta_0 = its pretrained.safetensors) or a fit config file (theta_0 = its model); "
        "only theta_0, the tasks and their data are used",
    )
    parser.add_argument("--tasks", nargs="+", help="tasks to fine-tune (default: all the run's tasks)")
    parser.add_argument("--epochs", type=int, default=5, help="E, epochs of fine-tuning per task (default: 5)")
    parser.add_argument("--optimizer", choices=tuple(DEFAULT_LR), default="sgd",
                        help="sgd (plain: the epoch's update is exactly -lr * g_k; default) or adamw")
    parser.add_argument("--lr", type=float, help=f"learning rate (default: {DEFAULT_LR['sgd']} for sgd, {DEFAULT_LR['adamw']} for adamw)")
    parser.add_argument("--weight-decay", type=float, default=None, help="AdamW weight decay (default: 0.1; not allowed with sgd)")
    parser.add_argument("--batch-size", type=int, default=64, help="minibatch size (default: 64)")
    parser.add_argument("--train-examples", type=int, help="use at most this many training images per task (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the training subset and the shuffling (default: 0)")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--out", type=Path, help=f"output folder (default: RUN/analysis/{NAME} for a run folder, else analysis/{NAME})")
    parser.add_argument("--overwrite", action="store_true", help="replace outputs already in --out")


def settings_from_options(options: argparse.Namespace) -> GradientSettings:
    weight_decay = options.weight_decay
    if weight_decay is None:
        weight_decay = 0.1 if options.optimizer == "adamw" else 0.0
    settings = GradientSettings(
        epochs=options.epochs,
        optimizer=options.optimizer,
        lr=options.lr if options.lr is not None else DEFAULT_LR[options.optimizer],
        weight_decay=weight_decay,
        batch_size=options.batch_size,
        train_examples=options.train_examples,
        seed=options.seed,
    )
    settings.check()
    return settings


def _source(run: Path) -> tuple[Path | None, Path | None]:
    """(run folder or None, pretrained.safetensors if the run folder has one)."""
    if run.is_dir():
        if not (run / "config.yaml").is_file():
            raise MimaError(f"RUN {run}: no config.yaml (give a `mima fit` run folder or a fit config file)")
        pretrained = run / "pretrained.safetensors"
        return run, pretrained if pretrained.is_file() else None
    if not run.is_file():
        raise MimaError(f"RUN {run}: no such run folder or config file")
    return None, None


def _choose_tasks(available: Sequence[str], wanted: Sequence[str] | None) -> list[str]:
    if not wanted:
        return list(available)
    unknown = [task for task in wanted if task not in available]
    if unknown:
        raise MimaError(f"--tasks: unknown task '{unknown[0]}' (the run's tasks: {', '.join(available)})")
    if len(set(wanted)) != len(wanted):
        raise MimaError("--tasks: a task is given twice")
    return list(wanted)


def _theta_0(context, pretrained: Path | None) -> StateDict:
    if pretrained is None:
        return _snapshot(context.encoder)
    from mima.safetensors_io import load_state_dict

    theta_0 = load_state_dict(pretrained)
    expected = set(context.encoder.state_dict())
    if set(theta_0) != expected:
        missing = sorted(expected - set(theta_0)) or sorted(set(theta_0) - expected)
        raise MimaError(f"{pretrained}: does not fit the config's model (key '{missing[0]}' differs)")
    return theta_0


def _summary(results: Mapping) -> list[str]:
    lines = [f"per-epoch gradients ({results['settings']['optimizer']}, lr={results['settings']['lr']:g}, "
             f"{results['settings']['epochs']} epochs):"]
    for task, row in results["per_task"].items():
        shares = " ".join(f"{v:.2f}" for v in row["share"])
        cosines = " ".join(f"{v:.2f}" for v in row["cos_first"])
        acc = row["test_accuracy"]
        lines.append(f"  {task:<10} share [{shares}]  cos(g_k,g_1) [{cosines}]  "
                     f"own test acc: 0-shot {100 * acc['zero_shot']:.1f}%, 1 epoch {100 * acc['one_epoch']:.1f}%, "
                     f"converged {100 * acc['converged']:.1f}%")
    for name, label in (("one_epoch", "1-epoch"), ("converged", "converged")):
        merged = results["merged"][name]
        lines.append(f"task arithmetic of {label} task vectors: lam={merged['lam']:g}, mean test acc "
                     f"{100 * merged['test_mean']:.1f}% (val {100 * merged['val_mean']:.1f}%)")
    return lines


def main(options: argparse.Namespace) -> None:
    started = time.perf_counter()
    settings = settings_from_options(options)
    run_dir, pretrained = _source(options.run)
    from mima.merging.context import context_from_config

    context = context_from_config(options.run)
    tasks = _choose_tasks(context.tasks, options.tasks)
    theta_0 = _theta_0(context, pretrained)
    # After every check that can fail on the inputs, so that a mistake leaves no empty folder behind.
    folder = output_dir(options.out, run_dir, NAME, [JSON_FILE, FIGURE_FILE], options.overwrite)
    try:
        device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise MimaError(f"--device {options.device!r}: not a torch device (e.g. cpu, cuda, cuda:1)") from None
    context.encoder.to(device)
    results = analyse_gradients(context, tasks, theta_0, settings)
    results["source"] = str(options.run)
    results["seconds"] = time.perf_counter() - started
    write_json(folder / JSON_FILE, results)
    plot_gradients(results, folder / FIGURE_FILE)
    print("\n".join(_summary(results)))
    print(f"wrote {folder / JSON_FILE} and {folder / FIGURE_FILE} in {results['seconds']:.1f} s")
