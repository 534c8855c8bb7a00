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

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.func import functional_call

from mima.analysis.ctl.options import DEFAULT_ALPHAS, OUTPUT, PAPER_LAMBDA
from mima.core.errors import MimaError
from mima.core.state_dicts import is_mergeable

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
