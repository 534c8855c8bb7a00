"""The registry of merge strategies: name -> function, paper, hyperparameters and grids.

A strategy is a pure function `fn(models, base=None, **hparams) -> state dict` over mappings of
tensors; it reads one key of each input at a time. Strategies of the form
`anchor + lam * direction` also register `direction_fn(models, base, **structural) -> (anchor,
direction)`, so a lambda grid costs one direction per structural setting (e.g. per CART rank).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from mima.errors import MimaError
from mima.state_dicts import is_mergeable

TensorMap = Mapping[str, torch.Tensor]
StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class MergeMethod:
    name: str
    fn: Callable[..., StateDict]
    paper: str
    summary: str
    needs_base: bool
    defaults: dict[str, object] = field(default_factory=dict)  # used without validation data
    grid: dict[str, tuple[float, ...]] = field(default_factory=dict)  # searched on validation data
    direction_fn: Callable[..., tuple[StateDict, StateDict]] | None = None

    @property
    def hyperparameters(self) -> list[str]:
        return list(self.defaults)

    def __call__(self, models: Sequence[TensorMap], base: TensorMap | None = None, **hparams) -> StateDict:
        unknown = sorted(set(hparams) - set(self.defaults))
        if unknown:
            raise MimaError(
                f"merge method '{self.name}' takes no hyperparameter '{unknown[0]}' "
                f"(it takes: {', '.join(self.defaults) or 'none'})"
            )
        if self.needs_base and base is None:
            raise MimaError(f"merge method '{self.name}' needs the pretrained model (--base)")
        if not models:
            raise MimaError(f"merge method '{self.name}' needs at least one fine-tuned model")
        return self.fn(models, base, **{**self.defaults, **hparams})


MERGE_METHODS: dict[str, MergeMethod] = {}


def register(method: MergeMethod) -> MergeMethod:
    if method.name in MERGE_METHODS:
        raise ValueError(f"merge method {method.name} registered twice")
    MERGE_METHODS[method.name] = method
    return method


def get_method(name: str) -> MergeMethod:
    if name not in MERGE_METHODS:
        raise MimaError(f"unknown merge method '{name}' (known: {', '.join(sorted(MERGE_METHODS))})")
    return MERGE_METHODS[name]


def combine(anchor: TensorMap, direction: TensorMap, lam: float) -> StateDict:
    """anchor + lam * direction on the keys of `direction`; other keys are copied from `anchor`."""
    merged: StateDict = {}
    for key, value in anchor.items():
        if key in direction:
            merged[key] = (value.to(direction[key].dtype) + lam * direction[key]).to(value.dtype)
        else:
            merged[key] = value.clone()
    return merged


def floating_keys(state_dict: TensorMap) -> list[str]:
    return [key for key, value in state_dict.items() if is_mergeable(value)]
