"""The registry of merge strategies: name -> function, paper, hyperparameters and grids.

Every strategy works on mappings from key to tensor (which may be lazy, file-backed readers) and
touches one key of each input at a time, so merging streams: see mima.merging.engine. A strategy
is one of three kinds:

  stream_fn(models, base, **hp)  -> iterator of (key, merged tensor)
  scaled_fn(models, base, **hp)  -> iterator of (key, anchor, direction or None); the merge is
                                    anchor + lam * direction, so a lambda grid needs one direction
                                    per structural setting (selection sweeps lam cheaply)
  data_fn(models, base, context, **hp) -> state dict; strategies that need calibration or
                                    unlabelled data and forward passes (they hold all T task vectors)
  index_fn(models, base, **hp) -> index, with reconstruct_fn(index, task) -> that task's model;
                                    per-task compressions (CART-Indexing, TALL masks) that keep
                                    one shared model plus a small per-task part
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from mima.errors import MimaError
from mima.state_dicts import is_mergeable

TensorMap = Mapping[str, torch.Tensor]
StateDict = dict[str, torch.Tensor]
Item = tuple[str, torch.Tensor]
ScaledItem = tuple[str, torch.Tensor, "torch.Tensor | None"]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# Every hyperparameter any strategy takes: (check, what it must be). One table, so the CLI and the
# functions reject the same values with the same words.
HYPERPARAMETERS: dict[str, tuple[Callable[[object], bool], str]] = {
    "lam": (_finite, "a finite number"),
    "k": (lambda v: _finite(v) and 0 < v <= 100, "a percentage of entries kept, in (0, 100]"),
    "rank_ratio": (lambda v: _finite(v) and 0 <= v <= 1, "a fraction of the rank, in [0, 1]"),
    "drop": (lambda v: _finite(v) and 0 <= v < 1, "a drop probability, in [0, 1)"),
    "density": (lambda v: _finite(v) and 0 < v <= 1, "a fraction of entries kept, in (0, 1]"),
    "gamma": (lambda v: _finite(v) and 0 <= v < 1, "a fraction of the largest entries removed, in [0, 1)"),
    "seed": (lambda v: isinstance(v, int), "an integer"),
    "trim": (lambda v: v in ("global", "per-tensor"), "'global' or 'per-tensor'"),
    "matrix_keys": (lambda v: isinstance(v, str), "a regular expression"),
    "mask_lam": (
        lambda v: (_finite(v) and v >= 0) or (isinstance(v, (list, tuple)) and all(_finite(x) and x >= 0 for x in v)),
        "a non-negative number (or one per task)",
    ),
    "min_tasks": (lambda v: isinstance(v, int) and v >= 1, "a whole number of tasks, at least 1"),
    "alpha": (lambda v: _finite(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "steps": (lambda v: isinstance(v, int) and v >= 1, "a positive whole number of steps"),
    "lr": (lambda v: _finite(v) and v > 0, "a positive number"),
    "granularity": (lambda v: v in ("task", "layer"), "'task' or 'layer'"),
    "iterations": (lambda v: isinstance(v, int) and v >= 1, "a positive whole number"),
    "mode": (lambda v: v in ("hard", "soft"), "'hard' or 'soft'"),
    "prior": (_finite, "a finite number"),
    "examples": (lambda v: isinstance(v, int) and v >= 1, "a positive whole number of examples"),
    "adapt_on": (lambda v: v in ("test", "val", "train"), "'test', 'val' or 'train'"),
    "start": (lambda v: v in ("pretrained", "task_arithmetic", "adamerging"), "'pretrained', 'task_arithmetic' or 'adamerging'"),
    "step_size": (lambda v: _finite(v) and v > 0, "a positive number"),
    "ada_steps": (lambda v: isinstance(v, int) and v >= 1, "a positive whole number of steps"),
}


@dataclass(frozen=True)
class MergeMethod:
    name: str
    paper: str
    summary: str
    needs_base: bool
    defaults: dict[str, object] = field(default_factory=dict)  # used without validation data
    grid: dict[str, tuple] = field(default_factory=dict)  # searched on validation data
    stream_fn: Callable[..., Iterator[Item]] | None = None
    scaled_fn: Callable[..., Iterator[ScaledItem]] | None = None
    data_fn: Callable[..., StateDict] | None = None
    index_fn: Callable[..., StateDict] | None = None
    reconstruct_fn: Callable[[Mapping[str, torch.Tensor], int], StateDict] | None = None
    sweep_fn: Callable[..., Iterator[tuple[dict, StateDict, StateDict]]] | None = None

    @property
    def needs_data(self) -> bool:
        return self.data_fn is not None

    @property
    def per_task(self) -> bool:
        return self.index_fn is not None

    def hyperparameters(self, given: Mapping[str, object]) -> dict[str, object]:
        """The defaults updated with `given`, each checked; unknown names are errors."""
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            raise MimaError(
                f"merge method '{self.name}' takes no hyperparameter '{unknown[0]}' "
                f"(it takes: {', '.join(self.defaults) or 'none'})"
            )
        values = {**self.defaults, **given}
        for name, value in values.items():
            check, meaning = HYPERPARAMETERS[name]
            if not check(value):
                raise MimaError(f"merge method '{self.name}': {name} must be {meaning}, got {value!r}")
        return values

    def _check_inputs(self, models: Sequence[TensorMap], base: TensorMap | None) -> None:
        if self.needs_base and base is None:
            raise MimaError(f"merge method '{self.name}' needs the pretrained model (--base)")
        if not models:
            raise MimaError(f"merge method '{self.name}' needs at least one fine-tuned model")

    def stream(self, models: Sequence[TensorMap], base: TensorMap | None = None, **given) -> Iterator[Item]:
        """The merged model, one (key, tensor) at a time (data-free strategies)."""
        if self.per_task:
            raise MimaError(f"merge method '{self.name}' keeps one model per task; use its index and reconstruct")
        if self.needs_data:
            raise MimaError(f"merge method '{self.name}' needs task data (a config with model and data sections)")
        self._check_inputs(models, base)
        values = self.hyperparameters(given)
        if self.stream_fn is not None:
            return self.stream_fn(models, base, **values)
        lam = values.pop("lam")
        return (
            (key, combine_tensor(anchor, direction, lam))
            for key, anchor, direction in self.scaled_fn(models, base, **values)
        )

    def __call__(self, models: Sequence[TensorMap], base: TensorMap | None = None, context=None, **given) -> StateDict:
        """The merged model as a state dict (for per-task methods: their index)."""
        if self.per_task:
            self._check_inputs(models, base)
            return self.index_fn(models, base, **self.hyperparameters(given))
        if self.needs_data:
            if context is None:
                raise MimaError(f"merge method '{self.name}' needs task data (a config with model and data sections)")
            self._check_inputs(models, base)
            return self.data_fn(models, base, context, **self.hyperparameters(given))
        return dict(self.stream(models, base, **given))

    def sweep(self, models, base, settings: Mapping[str, Sequence]) -> Iterator[tuple[dict, StateDict, StateDict]]:
        """(setting, anchor, direction) for every combination of structural values, for selection."""
        fixed = {k: v for k, v in self.defaults.items() if k != "lam" and k not in settings}
        if self.sweep_fn is not None:
            yield from self.sweep_fn(models, base, **fixed, **settings)
            return
        for values in itertools.product(*settings.values()):
            setting = {**fixed, **dict(zip(settings, values))}
            self.hyperparameters({**setting, "lam": self.defaults["lam"]})
            anchor, direction = {}, {}
            for key, anchor_tensor, direction_tensor in self.scaled_fn(models, base, **setting):
                anchor[key] = anchor_tensor
                if direction_tensor is not None:
                    direction[key] = direction_tensor
            yield dict(zip(settings, values)), anchor, direction


def combine_tensor(anchor: torch.Tensor, direction: torch.Tensor | None, lam: float) -> torch.Tensor:
    """anchor + lam * direction in the anchor's dtype (computed in float32 or wider)."""
    if direction is None:
        return anchor.clone()
    return (anchor.to(direction.dtype) + lam * direction).to(anchor.dtype)


def combine(anchor: TensorMap, direction: TensorMap, lam: float) -> StateDict:
    return {key: combine_tensor(value, direction.get(key), lam) for key, value in anchor.items()}


MERGE_METHODS: dict[str, MergeMethod] = {}


def register(method: MergeMethod) -> MergeMethod:
    if method.name in MERGE_METHODS:
        raise ValueError(f"merge method {method.name} registered twice")
    kinds = [f for f in (method.stream_fn, method.scaled_fn, method.data_fn, method.index_fn) if f is not None]
    if len(kinds) != 1:
        raise ValueError(f"merge method {method.name} needs exactly one of stream_fn, scaled_fn, data_fn, index_fn")
    if (method.index_fn is None) != (method.reconstruct_fn is None):
        raise ValueError(f"merge method {method.name}: index_fn and reconstruct_fn come together")
    MERGE_METHODS[method.name] = method
    return method


def get_method(name: str) -> MergeMethod:
    if name not in MERGE_METHODS:
        raise MimaError(f"unknown merge method '{name}' (known: {', '.join(sorted(MERGE_METHODS))})")
    return MERGE_METHODS[name]


def floating_keys(state_dict: TensorMap) -> list[str]:
    """Keys of floating tensors; works on lazy readers through their headers when they have one."""
    infos = getattr(state_dict, "infos", None)
    if infos is not None:
        return [key for key, info in infos.items() if info.dtype.is_floating_point]
    return [key for key, value in state_dict.items() if is_mergeable(value)]
