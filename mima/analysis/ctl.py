"""Cross-task linearity (CTL): is the model of interpolated weights the interpolation of the models?

Paper 003 ("Cross-Task Linearity Emerges in the Pretraining-Finetuning Paradigm"), section 4.1 with
Figures 2 and 3 (weight interpolation), and section 4.3, Equation 2 with Figures 7 and 8 (task
addition). Our reading of the paper's measurements:

* data: every test example x of the two tasks' data sets, D_i ∪ D_j. Here: `--examples` test images,
  half from each task's test split (a fixed random subset of each);
* features f_l(theta; x): the output of layer (block) l for one example, as one flat vector (a ViT
  block's [tokens, width] output is flattened, every token counts);
* for theta_alpha = alpha theta_A + (1 - alpha) theta_B, per example:
    cosine_alpha(x) = cos[f_l(theta_alpha; x), alpha f_l(theta_A; x) + (1 - alpha) f_l(theta_B; x)]
    coef_alpha(x)   = |f_l(theta_alpha; x)| cosine_alpha(x) / |alpha f_l(theta_A; x) + (1 - alpha) f_l(theta_B; x)|
  (coef, the "length ratio", is the length of the projection of the interpolated model's feature on
  the interpolated feature, relative to that feature's length; CTL holds when both are about 1);
* the baseline cosine_AB(x) = cos[f_l(theta_A; x), f_l(theta_B; x)]: CTL is only informative where the
  two models' features differ, i.e. where this is clearly below 1;
* the paper plots E_D[1 - cosine] with the lower and upper quartiles across examples as error bars
  (alpha in {0.25, 0.5, 0.75}), and the distribution of coef. We keep the mean, quartiles, median
  and extremes of each per-example quantity;
* task addition (Eq. 2) is the same test at alpha = 1/2 between theta_0 + 2 lambda tau_A and
  theta_0 + 2 lambda tau_B, whose weight midpoint is theta_0 + lambda (tau_A + tau_B); lambda = 0.4 in
  the paper. It is run when theta_0 is known (a run folder or --base).

Features are caught with forward hooks on named submodules, and the weights are swapped in with
torch.func.functional_call, so the computation works on any nn.Module; `tower_layers` finds the
blocks of an open_clip image tower (the `visual` module, whose state-dict keys have no prefix).
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.data import ConcatDataset, DataLoader

from mima.analysis.common import (
    add_model_arguments,
    add_output_arguments,
    fixed_subset,
    output_dir,
    save_figure,
    write_json,
)
from mima.errors import MimaError
from mima.merging.engine import expand_models
from mima.safetensors_io import load_state_dict
from mima.state_dicts import check_compatible, is_mergeable

NAME = "ctl"
OUTPUT = "output"  # layer name standing for the whole model's output (the tower's embedding)
DEFAULT_ALPHAS = (0.25, 0.5, 0.75)
PAPER_LAMBDA = 0.4
StateDict = dict[str, torch.Tensor]

# Where the blocks of the towers open_clip builds live: its own ViT, then timm trunks (ViT, MobileNet,
# EfficientNet use `blocks`; ConvNeXt and Swin use `stages` / `layers`).
_BLOCK_LISTS = ("transformer.resblocks", "trunk.blocks", "trunk.stages", "trunk.layers")
_RESNET_STAGES = ("trunk.layer1", "trunk.layer2", "trunk.layer3", "trunk.layer4")


# ------------------------------------------------------------------------------------- numbers
@dataclass
class Spread:
    """How a per-example quantity is spread over the examples."""

    mean: float
    lower_quartile: float
    median: float
    upper_quartile: float
    minimum: float
    maximum: float

    @classmethod
    def of(cls, values: torch.Tensor) -> Spread:
        values = values.double().flatten()
        q = torch.quantile(values, torch.tensor([0.25, 0.5, 0.75], dtype=values.dtype))
        return cls(float(values.mean()), float(q[0]), float(q[1]), float(q[2]), float(values.min()), float(values.max()))


@dataclass
class LayerLinearity:
    layer: str
    baseline_cosine: Spread  # cos(f(theta_A), f(theta_B))
    cosine: dict[float, Spread]  # alpha -> cos(f(theta_alpha), alpha f(theta_A) + (1 - alpha) f(theta_B))
    length_ratio: dict[float, Spread]  # alpha -> coef_alpha


@dataclass
class LinearityResult:
    alphas: list[float]
    examples: int
    layers: list[LayerLinearity]

    def to_json(self) -> dict:
        return {
            "alphas": self.alphas,
            "examples": self.examples,
            "layers": [
                {
                    "layer": layer.layer,
                    "baseline_cosine": asdict(layer.baseline_cosine),
                    "cosine": {str(a): asdict(s) for a, s in layer.cosine.items()},
                    "length_ratio": {str(a): asdict(s) for a, s in layer.length_ratio.items()},
                }
                for layer in self.layers
            ],
        }


def feature_cosine(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-row cosine of two [examples, features] matrices (0 where a row is zero)."""
    x, y = x.double(), y.double()
    return (x * y).sum(1) / (x.norm(dim=1) * y.norm(dim=1)).clamp_min(torch.finfo(torch.float64).tiny)


def linearity_per_example(
    feat_a: torch.Tensor, feat_b: torch.Tensor, feat_mixed: torch.Tensor, alpha: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cosine_alpha, coef_alpha) of each example, from [examples, features] matrices."""
    target = alpha * feat_a.double() + (1.0 - alpha) * feat_b.double()
    mixed = feat_mixed.double()
    dot = (mixed * target).sum(1)
    cosine = dot / (mixed.norm(dim=1) * target.norm(dim=1)).clamp_min(torch.finfo(torch.float64).tiny)
    # |f(theta_alpha)| cos / |target| simplifies to <f(theta_alpha), target> / |target|^2
    ratio = dot / target.pow(2).sum(1).clamp_min(torch.finfo(torch.float64).tiny)
    return cosine, ratio


def interpolate(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], alpha: float) -> StateDict:
    """alpha a + (1 - alpha) b on floating tensors; integer ones (counters) are taken from a."""
    return {key: _lerp(a[key], b[key], alpha) if is_mergeable(a[key]) else a[key] for key in a}


def _lerp(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    wide = torch.promote_types(x.dtype, torch.float32)
    return (alpha * x.to(wide) + (1.0 - alpha) * y.to(wide)).to(x.dtype)


def scaled_task_model(base: Mapping[str, torch.Tensor], model: Mapping[str, torch.Tensor], scale: float) -> StateDict:
    """theta_0 + scale (theta - theta_0): the model's task vector applied `scale` times."""
    return {key: _lerp(model[key], base[key], scale) if is_mergeable(base[key]) else base[key] for key in base}


# ------------------------------------------------------------------------------------- hooks
def resolve_layers(model: nn.Module, layers: Sequence[str]) -> dict[str, nn.Module]:
    """Layer names -> submodules; OUTPUT (unless a submodule has that name) is the model itself."""
    modules = dict(model.named_modules())
    resolved = {}
    for name in layers:
        if name in modules and name:
            resolved[name] = modules[name]
        elif name in (OUTPUT, ""):
            resolved[name] = model
        else:
            raise MimaError(f"--layers: the model has no module '{name}'")
    return resolved


def capture_features(
    model: nn.Module,
    layers: Sequence[str],
    inputs: torch.Tensor,
    weights: Mapping[str, torch.Tensor] | None = None,
    batch_dims: Mapping[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Each layer's output for `inputs` as [examples, features], with the model's weights replaced by `weights`."""
    modules = resolve_layers(model, layers)
    captured: dict[str, torch.Tensor] = {}

    def hook_for(name: str):
        def hook(module, args, output):
            tensor = _first_tensor(output)
            if tensor is not None:  # a module run twice keeps its last output
                captured[name] = tensor.detach().movedim((batch_dims or {}).get(name, 0), 0).flatten(1)

        return hook

    handles = [module.register_forward_hook(hook_for(name)) for name, module in modules.items()]
    try:
        with torch.no_grad():
            if weights is None:
                model(inputs)
            else:
                functional_call(model, dict(weights), (inputs,), strict=False)
    finally:
        for handle in handles:
            handle.remove()
    silent = [name for name in layers if name not in captured]
    if silent:
        raise MimaError(f"--layers: module '{silent[0]}' gave no tensor output in the forward pass")
    return captured


def _first_tensor(output) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((item for item in output if isinstance(item, torch.Tensor)), None)
    return None


def cross_task_linearity(
    model: nn.Module,
    layers: Sequence[str],
    weights_a: Mapping[str, torch.Tensor],
    weights_b: Mapping[str, torch.Tensor],
    batches: Iterable[torch.Tensor],
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    batch_dims: Mapping[str, int] | None = None,
) -> LinearityResult:
    """CTL of two weight sets of `model` at `layers` over the input batches (paper 003, section 4.1)."""
    alphas = list(dict.fromkeys(float(a) for a in alphas))
    baseline: dict[str, list[torch.Tensor]] = {name: [] for name in layers}
    cosines = {(name, a): [] for name in layers for a in alphas}
    ratios = {(name, a): [] for name in layers for a in alphas}
    was_training = model.training
    model.eval()  # dropout off, BatchNorm on its (interpolated) running statistics
    count = 0
    try:
        for inputs in batches:
            feat_a = capture_features(model, layers, inputs, weights_a, batch_dims)
            feat_b = capture_features(model, layers, inputs, weights_b, batch_dims)
            for name in layers:
                baseline[name].append(feature_cosine(feat_a[name], feat_b[name]).cpu())
            # the interpolated weights are rebuilt per batch so memory stays at one extra model
            for alpha in alphas:
                feat_mixed = capture_features(model, layers, inputs, interpolate(weights_a, weights_b, alpha), batch_dims)
                for name in layers:
                    cosine, ratio = linearity_per_example(feat_a[name], feat_b[name], feat_mixed[name], alpha)
                    cosines[name, alpha].append(cosine.cpu())
                    ratios[name, alpha].append(ratio.cpu())
            count += len(next(iter(feat_a.values())))
    finally:
        model.train(was_training)
    if count == 0:
        raise MimaError("--examples: no input examples to measure on")
    return LinearityResult(
        alphas=alphas,
        examples=count,
        layers=[
            LayerLinearity(
                layer=name,
                baseline_cosine=Spread.of(torch.cat(baseline[name])),
                cosine={a: Spread.of(torch.cat(cosines[name, a])) for a in alphas},
                length_ratio={a: Spread.of(torch.cat(ratios[name, a])) for a in alphas},
            )
            for name in layers
        ],
    )


def task_arithmetic_linearity(
    model: nn.Module,
    layers: Sequence[str],
    base: Mapping[str, torch.Tensor],
    weights_a: Mapping[str, torch.Tensor],
    weights_b: Mapping[str, torch.Tensor],
    batches: Iterable[torch.Tensor],
    lam: float = PAPER_LAMBDA,
    batch_dims: Mapping[str, int] | None = None,
) -> LinearityResult:
    """Eq. 2 of paper 003: f(theta_0 + lam (tau_A + tau_B)) against the mean of f(theta_0 + 2 lam tau_A)
    and f(theta_0 + 2 lam tau_B), i.e. CTL at alpha = 1/2 between those two models."""
    end_a = scaled_task_model(base, weights_a, 2.0 * lam)
    end_b = scaled_task_model(base, weights_b, 2.0 * lam)
    return cross_task_linearity(model, layers, end_a, end_b, batches, [0.5], batch_dims)


# ------------------------------------------------------------------------ open_clip image towers
def tower_layers(encoder: nn.Module) -> list[str]:
    """The blocks of an open_clip image tower (own ViT or timm trunk), in order, then OUTPUT."""
    modules = dict(encoder.named_modules())
    for container in _BLOCK_LISTS:
        blocks = modules.get(container)
        if isinstance(blocks, (nn.ModuleList, nn.Sequential)) and len(blocks) > 0:
            return [f"{container}.{child}" for child, _ in blocks.named_children()] + [OUTPUT]
    stages = [name for name in _RESNET_STAGES if name in modules]
    if stages:
        return stages + [OUTPUT]
    raise MimaError("--layers: no known block list in this image tower; give --layers REGEX naming its modules")


def select_layers(encoder: nn.Module, pattern: str | None) -> list[str]:
    """The tower's blocks by default, else every module name (and OUTPUT) fully matching `pattern`."""
    if pattern is None:
        return tower_layers(encoder)
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise MimaError(f"--layers {pattern!r}: not a regular expression ({exc})") from None
    names = [name for name, _ in encoder.named_modules() if name] + [OUTPUT]
    chosen = [name for name in names if regex.fullmatch(name)]
    if not chosen:
        examples = ", ".join(tower_layers(encoder)[:3]) if _has_known_blocks(encoder) else ", ".join(names[:3])
        raise MimaError(f"--layers {pattern!r}: matches no module name of the image encoder (e.g. {examples})")
    return chosen


def _has_known_blocks(encoder: nn.Module) -> bool:
    try:
        tower_layers(encoder)
    except MimaError:
        return False
    return True


def layer_batch_dims(encoder: nn.Module, layers: Sequence[str]) -> dict[str, int]:
    """Older open_clip ViTs run their blocks sequence-first ([tokens, batch, width])."""
    transformer = getattr(encoder, "transformer", None)
    if transformer is not None and getattr(transformer, "batch_first", True) is False:
        return {name: 1 for name in layers if name.startswith("transformer.resblocks.")}
    return {}


# ------------------------------------------------------------------------------------- figure
_INTERPOLATION_TEXT = (
    "1 − cos(f(θ_α), α f(θ_A) + (1−α) f(θ_B)),  θ_α = α θ_A + (1−α) θ_B",
    "|f(θ_α)| cos / |α f(θ_A) + (1−α) f(θ_B)|",
    "baseline: 1 − cos(f(θ_A), f(θ_B))",
    "α = {alpha:g}",
)
_ARITHMETIC_TEXT = (
    "1 − cos(f(θ_0 + λ(τ_A + τ_B)), ½ f(θ_0 + 2λτ_A) + ½ f(θ_0 + 2λτ_B))",
    "|f(θ_0 + λ(τ_A + τ_B))| cos / |½ f(θ_0 + 2λτ_A) + ½ f(θ_0 + 2λτ_B)|",
    "baseline: 1 − cos(f(θ_0 + 2λτ_A), f(θ_0 + 2λτ_B))",
    "merged θ_0 + λ(τ_A + τ_B)",
)


def plot_linearity(result: LinearityResult, title: str, text: tuple[str, str, str, str] = _INTERPOLATION_TEXT):
    """Two panels per layer: 1 - cosine (each alpha and the baseline) and the length ratio.

    `text` holds the formulas: left and right panel titles, the baseline's legend entry and a format
    string for each alpha's entry.
    """
    left_title, right_title, baseline_label, series = text
    import matplotlib.pyplot as plt

    names = [layer.layer for layer in result.layers]
    labels, prefix = _tick_labels(names)
    x = list(range(len(names)))
    figure = plt.figure(figsize=(max(10.0, 1.5 * len(names)), 5.0))
    grid = figure.add_gridspec(2, 2, height_ratios=[6, 1])
    left, right, key = figure.add_subplot(grid[0, 0]), figure.add_subplot(grid[0, 1]), figure.add_subplot(grid[1, :])
    offsets = _offsets(len(result.alphas) + 1)

    base = [_one_minus(layer.baseline_cosine) for layer in result.layers]
    _errorbar(left, [i + offsets[-1] for i in x], base, "k", "s", baseline_label, dashed=True)
    for index, alpha in enumerate(result.alphas):
        colour = plt.cm.viridis(0.1 + 0.75 * index / max(1, len(result.alphas) - 1))
        shifted = [i + offsets[index] for i in x]
        label = series.format(alpha=alpha)
        _errorbar(left, shifted, [_one_minus(layer.cosine[alpha]) for layer in result.layers], colour, "o", label)
        _errorbar(right, shifted, [layer.length_ratio[alpha] for layer in result.layers], colour, "o", label)
    right.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
    # log-like scale: CTL's 1 - cosine sits orders of magnitude below the baseline's
    left.set_yscale("symlog", linthresh=_linthresh(result))
    left.set_ylabel("1 − cosine (0 = same direction)")
    left.set_title(left_title, fontsize=8)
    right.set_ylabel("length ratio (1 = same length)")
    right.set_title(right_title, fontsize=8)
    long = max(map(len, labels)) > 6
    for axis in (left, right):
        axis.set_xticks(x)
        axis.set_xticklabels(labels, rotation=30 if long else 0, ha="right" if long else "center", fontsize=8)
        axis.set_xlabel(f"layer ({prefix}<i>, then the tower output)" if prefix else "layer")
        axis.grid(alpha=0.3)
    handles, names_ = left.get_legend_handles_labels()
    key.axis("off")
    # alphas first, the baseline last
    key.legend(handles[1:] + handles[:1], names_[1:] + names_[:1], loc="center", ncol=len(handles), fontsize=8,
               frameon=False)
    figure.suptitle(f"{title}\npoints: mean over {result.examples} test images; bars: lower to upper quartile", fontsize=10)
    return figure


def _one_minus(spread: Spread) -> Spread:
    # 1 - x reverses order: the upper quartile of the cosine is the lower one of 1 - cosine
    s = spread
    return Spread(1 - s.mean, 1 - s.upper_quartile, 1 - s.median, 1 - s.lower_quartile, 1 - s.maximum, 1 - s.minimum)


def _linthresh(result: LinearityResult) -> float:
    """Linear range of the symlog axis: just under the smallest positive 1 - cosine shown."""
    values = [1 - layer.baseline_cosine.mean for layer in result.layers]
    values += [1 - s.mean for layer in result.layers for s in layer.cosine.values()]
    positive = [v for v in values if v > 0]
    return max(1e-9, min(positive) / 2) if positive else 1e-6


def _errorbar(axis, x, spreads: Sequence[Spread], colour, marker: str, label: str, dashed: bool = False) -> None:
    """Means joined by a line; the bar spans the quartiles (a skewed spread may leave the mean outside it)."""
    lower = [s.lower_quartile for s in spreads]
    upper = [s.upper_quartile for s in spreads]
    axis.errorbar(x, [(a + b) / 2 for a, b in zip(lower, upper)], yerr=[(b - a) / 2 for a, b in zip(lower, upper)],
                  fmt="none", ecolor=colour, elinewidth=1, capsize=3)
    axis.plot(x, [s.mean for s in spreads], color=colour, marker=marker, markersize=4,
              linestyle="--" if dashed else "-", linewidth=1, label=label)


def _offsets(count: int) -> list[float]:
    """Small horizontal shifts so the error bars of several series at one layer do not overlap."""
    width = 0.3
    return [(-width / 2 + width * i / max(1, count - 1)) if count > 1 else 0.0 for i in range(count)]


def _tick_labels(names: Sequence[str]) -> tuple[list[str], str]:
    """Drop the dotted prefix the blocks share (`transformer.resblocks.`) so ticks stay short."""
    blocks = [name for name in names if name != OUTPUT]
    if len(blocks) < 2:
        return list(names), ""
    parts = [name.split(".") for name in blocks]
    common = 0
    while all(len(p) > common + 1 for p in parts) and len({p[common] for p in parts}) == 1:
        common += 1
    prefix = ".".join(parts[0][:common]) + "." if common else ""
    return [name[len(prefix):] if name != OUTPUT else name for name in names], prefix


# ------------------------------------------------------------------------------------ command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--tasks", nargs=2, metavar=("A", "B"),
                        help="the two tasks: of the run folder (default: its first two), or of MODEL_A MODEL_B "
                             "(default: the file names) whose test images are used")
    parser.add_argument("--alphas", type=float, nargs="+", default=list(DEFAULT_ALPHAS),
                        help="interpolation weights alpha of theta_A, in [0, 1] (default: 0.25 0.5 0.75)")
    parser.add_argument("--examples", type=int, default=200, help="test images, half from each task (default: 200)")
    parser.add_argument("--layers", metavar="REGEX",
                        help="module names of the image encoder to measure, full match (default: every block and "
                             f"'{OUTPUT}', the tower output)")
    parser.add_argument("--lam", type=float, default=PAPER_LAMBDA,
                        help="task-arithmetic scale lambda for the Eq. 2 check (default: 0.4, the paper's)")
    parser.add_argument("--no-arithmetic", action="store_true", help="skip the task-arithmetic (Eq. 2) check")
    parser.add_argument("--batch-size", type=int, default=100, help="images per forward pass (default: 100)")
    parser.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    add_output_arguments(parser, NAME)


@dataclass
class _Inputs:
    tasks: list[str]  # the two tasks, in model order
    paths: list[Path]
    base_path: Path | None
    config: Path
    run_dir: Path | None


def _resolve_inputs(options: argparse.Namespace) -> _Inputs:
    """Pick the two model files (without loading every task model of a run)."""
    paths = list(options.models)
    if len(paths) == 1 and paths[0].is_dir():
        files, tasks, run_base = expand_models(paths)
        if len(tasks) < 2:
            raise MimaError(f"{paths[0]}: the run has one task ({tasks[0]}); CTL needs two task models")
        chosen = list(options.tasks) if options.tasks else tasks[:2]
        for task in chosen:
            if task not in tasks:
                raise MimaError(f"--tasks {task}: not a task of {paths[0]} (tasks: {', '.join(tasks)})")
        if chosen[0] == chosen[1]:
            raise MimaError(f"--tasks: give two different tasks (got {chosen[0]} twice)")
        picked = [files[tasks.index(task)] for task in chosen]
        base = options.base if options.base is not None else run_base
        return _Inputs(chosen, picked, base, options.config or paths[0], paths[0])
    if len(paths) != 2 or any(path.is_dir() for path in paths):
        raise MimaError(
            f"MODELS: give one `mima fit` run folder, or two .safetensors files MODEL_A MODEL_B (got {len(paths)} paths)"
        )
    if options.config is None:
        raise MimaError("--config: needed with two model files: the `mima fit` config or run folder defining their tasks")
    tasks = list(options.tasks) if options.tasks else [path.stem for path in paths]
    return _Inputs(tasks, paths, options.base, options.config, None)


def _check_options(options: argparse.Namespace) -> None:
    bad = [a for a in options.alphas if not 0.0 <= a <= 1.0]
    if bad:
        raise MimaError(f"--alphas {bad[0]:g}: each alpha must lie in [0, 1]")
    if options.examples < 2:
        raise MimaError(f"--examples {options.examples}: need at least 2 (one image of each task)")
    if options.batch_size < 1:
        raise MimaError(f"--batch-size {options.batch_size}: must be at least 1")


def _load(path: Path, option: str) -> StateDict:
    if not path.is_file():
        raise MimaError(f"{option} {path}: no such model file")
    return load_state_dict(path)


def main(options: argparse.Namespace) -> dict:
    started = time.perf_counter()
    _check_options(options)
    inputs = _resolve_inputs(options)
    files = ["ctl.json", "ctl.png", "ctl_arithmetic.png"]
    folder = output_dir(options.out, inputs.run_dir, NAME, files, options.overwrite)
    weights_a, weights_b, base = _load_models(inputs, with_base=not options.no_arithmetic)
    encoder, subsets = _encoder_and_images(inputs, options.examples, weights_a)
    layers = select_layers(encoder, options.layers)
    batch_dims = layer_batch_dims(encoder, layers)

    device = _device(options.device)
    encoder.to(device)
    weights_a, weights_b = _to(weights_a, device), _to(weights_b, device)
    batches = _Images(DataLoader(ConcatDataset(subsets), batch_size=options.batch_size), device)
    result = cross_task_linearity(encoder, layers, weights_a, weights_b, batches, options.alphas, batch_dims)
    arithmetic = None
    if base is not None:
        arithmetic = task_arithmetic_linearity(
            encoder, layers, _to(base, device), weights_a, weights_b, batches, options.lam, batch_dims
        )
    seconds = time.perf_counter() - started

    pair = f"{inputs.tasks[0]} (A) vs {inputs.tasks[1]} (B)"
    report = {
        "tasks": inputs.tasks,
        "models": [str(p) for p in inputs.paths],
        "base": str(inputs.base_path) if base is not None else None,
        "config": str(inputs.config),
        "examples_per_task": {task: len(s) for task, s in zip(inputs.tasks, subsets)},
        "interpolation": result.to_json(),
        "task_arithmetic": None if arithmetic is None else {"lambda": options.lam, **arithmetic.to_json()},
        "seconds": seconds,
    }
    write_json(folder / "ctl.json", report)
    save_figure(plot_linearity(result, f"Cross-task linearity of weight interpolation, {pair}"), folder / "ctl.png")
    written = files[:2]
    if arithmetic is not None:
        title = f"Task addition (Eq. 2, λ = {options.lam:g}): θ_0 + λ(τ_A + τ_B), {pair}"
        save_figure(plot_linearity(arithmetic, title, _ARITHMETIC_TEXT), folder / files[2])
        written.append(files[2])
    elif (folder / files[2]).exists():
        (folder / files[2]).unlink()  # an older run's figure would contradict ctl.json
    skipped = "--no-arithmetic" if options.no_arithmetic else "needs theta_0: a run folder or --base"
    print(summary(result, arithmetic, pair, options.lam, skipped))
    print(f"wrote {', '.join(str(folder / f) for f in written)} in {seconds:.1f} s")
    return report


def _load_models(inputs: _Inputs, with_base: bool) -> tuple[StateDict, StateDict, StateDict | None]:
    weights_a, weights_b = (_load(path, "MODELS") for path in inputs.paths)
    base = _load(Path(inputs.base_path), "--base") if with_base and inputs.base_path is not None else None
    named = {str(inputs.paths[0]): weights_a, str(inputs.paths[1]): weights_b}
    if base is not None:
        named[str(inputs.base_path)] = base
    check_compatible(named)
    return weights_a, weights_b, base


def _encoder_and_images(inputs: _Inputs, examples: int, weights: StateDict) -> tuple[nn.Module, list]:
    """The config's image encoder, and the test images: half from task A, the rest from task B."""
    from mima.merging.context import context_from_config

    context = context_from_config(inputs.config)
    for task in inputs.tasks:
        if task not in context.tasks:
            raise MimaError(f"--tasks {task}: not a task of --config {inputs.config} (tasks: {', '.join(context.tasks)}); "
                            "name the tasks of MODEL_A and MODEL_B")
    expected = set(context.encoder.state_dict())
    if set(weights) != expected:
        odd = sorted(set(weights) ^ expected)[0]
        raise MimaError(f"{inputs.paths[0]}: key '{odd}' does not match the image encoder of --config {inputs.config}")
    half = examples // 2
    subsets = [fixed_subset(context.splits[task].test, count, seed=context.seed)
               for task, count in zip(inputs.tasks, (half, examples - half))]
    return context.encoder, subsets


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise MimaError(f"--device {name}: not a torch device (e.g. cpu, cuda, cuda:1)") from None


class _Images:
    """The loader's images only, on the device; iterable more than once."""

    def __init__(self, loader: DataLoader, device: torch.device) -> None:
        self.loader, self.device = loader, device

    def __iter__(self):
        for images, _labels in self.loader:
            yield images.to(self.device)


def _to(weights: Mapping[str, torch.Tensor], device: torch.device) -> StateDict:
    return {key: value.to(device) for key, value in weights.items()}


def summary(result: LinearityResult, arithmetic: LinearityResult | None, pair: str, lam: float, skipped: str = "") -> str:
    """A table of means over the images: baseline cosine, then cosine and length ratio per alpha."""
    width = max(len("layer"), *(len(layer.layer) for layer in result.layers))
    columns = [f"cos a={a:g}" for a in result.alphas] + [f"ratio a={a:g}" for a in result.alphas]
    lines = [
        f"cross-task linearity, {pair}, {result.examples} test images (means over images)",
        f"{'layer':<{width}}  {'base cos':>10}" + "".join(f"  {c:>12}" for c in columns),
    ]
    for layer in result.layers:
        values = [layer.cosine[a].mean for a in result.alphas] + [layer.length_ratio[a].mean for a in result.alphas]
        row = f"{layer.layer:<{width}}  {layer.baseline_cosine.mean:>10.4f}"
        lines.append(row + "".join(f"  {v:>12.4f}" for v in values))
    if arithmetic is not None:
        lines.append(f"task addition: theta_0 + {lam:g} (tau_A + tau_B) vs the mean of theta_0 + {2 * lam:g} tau_A and "
                     f"theta_0 + {2 * lam:g} tau_B")
        lines.append(f"{'layer':<{width}}  {'base cos':>10}  {'cos':>11}  {'ratio':>11}")
        for layer in arithmetic.layers:
            lines.append(f"{layer.layer:<{width}}  {layer.baseline_cosine.mean:>10.4f}  {layer.cosine[0.5].mean:>11.4f}"
                         f"  {layer.length_ratio[0.5].mean:>11.4f}")
    else:
        lines.append(f"task addition: skipped ({skipped})")
    return "\n".join(lines)
