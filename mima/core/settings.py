"""Settings dataclasses as constructor signatures.

A component whose options are a typed dataclass (mima.config.model.ModelSettings,
mima.data.settings.DataSettings) takes them as keyword arguments, so that LightningCLI and
jsonargparse, which read constructor signatures, offer exactly the dataclass's fields with its
types, defaults and documentation. The dataclass stays the one place where an option and its
default are written; `mima fit` and every command that reads a run config see the same.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import typing
from collections.abc import Callable, Mapping
from typing import TypeVar

from mima.core.errors import MimaError

Component = TypeVar("Component", bound=type)


def keyword_signature(settings: type) -> inspect.Signature:
    """`(self, *, field: type = default, ...)` for the fields of a settings dataclass, with the
    annotations resolved (a string annotation could not be resolved in the component's module)."""
    hints = typing.get_type_hints(settings)
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for field in dataclasses.fields(settings):
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = inspect.Parameter.empty
        parameters.append(
            inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hints[field.name])
        )
    return inspect.Signature(parameters)


def takes_settings(settings: type) -> Callable[[Component], Component]:
    """Class decorator: the class's `__init__(self, **options)` is declared to take exactly the
    fields of `settings`, and the fields' documentation (the dataclass's "Args:" section) is
    appended to the class's docstring, where jsonargparse reads each option's help."""

    def adopt(component: Component) -> Component:
        component.__init__.__signature__ = keyword_signature(settings)
        args = (settings.__doc__ or "").split("Args:", 1)
        if len(args) == 2:
            component.__doc__ = f"{(component.__doc__ or '').rstrip()}\n\n    Args:{args[1]}"
        return component

    return adopt


# ------------------------------------------------------------------ the ranges of a run's numbers
# Every number a run config (or `mima fit`'s command line) gives, with its type and the values that make
# sense, written once: ModelSettings and DataSettings check their fields against it when they are built
# (so `mima fit`, `mima plan` and every command that loads a run config refuse the same values with the
# same line), and mima.config.limits checks the trainer: keys, seed_everything and fit's own options.
# A value outside its range is refused in one line naming the key, the value and the range: unbounded
# values only fail later (an OverflowError, a plan of 1e28 TB, a loss of NaN from step one, a hung job).

SEED_MAX = 2**63 - 1  # the data seeds key numpy / torch generators (int64)
LIGHTNING_SEED_MAX = 2**32 - 1  # seed_everything: numpy's legacy seed range, which Lightning enforces
STEPS_MAX = 10**9  # a billion optimiser steps per task: far beyond any run, small enough for exact float sums
BATCH_MAX = 2**20
# |lambda| of a sync merge's task vectors (lam, mask_lam): the published grids stay within 0 .. 3; the
# sync restarts every phase from the merge, so a large lambda compounds phase after phase
SYNC_LAMBDA_MAX = 10.0
# DiLoCo's outer step (model.sync_merge: outer_nesterov) scales the phase's averaged update by outer_lr
# (the paper: 0.7); past 2 the outer step overshoots the average by more than the update itself
OUTER_LR_MAX = 10.0
# its momentum (the paper: 0.9) below 1: at 1 the buffer never forgets and the steps grow without bound
OUTER_MOMENTUM_MAX = 0.999
# FedProx's mu (model.proximal_mu; the paper's grid: 0.001 .. 1): the pull towards the phase's start point
PROXIMAL_MU_MAX = 100.0
THREADS_PER_CORE_MAX = 4  # --threads_per_process: more threads than 4 per core only oversubscribe
COLLECTIVE_TIMEOUT_MAX_S = 7 * 24 * 3600  # a week (datetime.timedelta and NCCL take far more; nothing waits longer)


def cores() -> int:
    return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class ValueRange:
    """A key's type (int or float) and its range low .. high (inclusive; `above_low`: low excluded);
    `listed`: a list of such values (one per task) is taken too."""

    key: str
    kind: type
    low: float
    high: float | Callable[[], float]
    above_low: bool = False
    listed: bool = False

    def upper(self) -> float:
        return self.high() if callable(self.high) else self.high

    def expected(self) -> str:
        if self.kind is int:
            return f"an integer in {self.low} .. {self.upper()}"
        if self.above_low:
            return f"a finite number > {self.low:g} and <= {self.upper():g}"
        return f"a finite number in {self.low:g} .. {self.upper():g}"


VALUE_RANGES: dict[str, ValueRange] = {bound.key: bound for bound in (
    ValueRange("seed_everything", int, 0, LIGHTNING_SEED_MAX),
    ValueRange("model.steps", int, 1, STEPS_MAX),
    ValueRange("model.iterations", int, 1, STEPS_MAX),
    ValueRange("model.lr", float, 0, 10.0, above_low=True),
    ValueRange("model.weight_decay", float, 0, 100.0),
    ValueRange("model.warmup_steps", int, 0, STEPS_MAX),
    ValueRange("model.segment_warmup_steps", int, 0, STEPS_MAX),
    ValueRange("model.probe_shots", int, 1, STEPS_MAX),
    ValueRange("model.phase_ratio", float, 0.01, 100.0),
    ValueRange("model.sync_merge_args.lam", float, -SYNC_LAMBDA_MAX, SYNC_LAMBDA_MAX),
    ValueRange("model.sync_merge_args.mask_lam", float, -SYNC_LAMBDA_MAX, SYNC_LAMBDA_MAX, listed=True),
    ValueRange("model.sync_merge_args.outer_lr", float, 0, OUTER_LR_MAX, above_low=True),
    ValueRange("model.sync_merge_args.outer_momentum", float, 0, OUTER_MOMENTUM_MAX),
    ValueRange("model.proximal_mu", float, 0, PROXIMAL_MU_MAX),
    ValueRange("data.batch_size", int, 1, BATCH_MAX),
    ValueRange("data.eval_batch_size", int, 1, BATCH_MAX),
    ValueRange("data.num_workers", int, 0, 1024),  # the machine that plans a run need not be the one that runs it
    ValueRange("data.seed", int, 0, SEED_MAX),
    ValueRange("data.split_seed", int, 0, SEED_MAX),
    ValueRange("trainer.devices", int, 1, 2**16),
    ValueRange("trainer.num_nodes", int, 1, 2**16),
    ValueRange("trainer.accumulate_grad_batches", int, 1, BATCH_MAX),
    ValueRange("collective_timeout", int, 1, COLLECTIVE_TIMEOUT_MAX_S),
    ValueRange("threads_per_process", int, 1, lambda: THREADS_PER_CORE_MAX * cores()),
)}


def check_value(key: str, value: object, name: str | None = None) -> None:
    """Refuse, in one line, a value of `key` (VALUE_RANGES) of the wrong type or out of its range; None
    (not set) passes, and a string passes when it spells a number in range (YAML reads `1e-3` as a
    string, which the config parser converts). A list, where the key takes one value per task, is
    checked item by item.
    `name`: the key as the message names it (a per-task budget: model.steps.TASK)."""
    bound = VALUE_RANGES[key]
    name = name or key
    if value is None:
        return
    if isinstance(value, list | tuple) and bound.listed:
        for item in value:
            check_value(key, item, name)
        return
    number = _number(value, bound.kind)
    shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
    if number is None or (isinstance(number, float) and not math.isfinite(number)):
        raise MimaError(f"{name}: {shown} is not {bound.expected()}")
    too_low = number <= bound.low if bound.above_low else number < bound.low
    if too_low or number > bound.upper():
        raise MimaError(f"{name}: {shown} is out of range; expected {bound.expected()}")


def check_section(section: str, values: Mapping[str, object]) -> None:
    """Every key of VALUE_RANGES under `section` ("model", "trainer"; "" for the top level) in `values`."""
    prefix = f"{section}." if section else ""
    for key in VALUE_RANGES:
        rest = key[len(prefix):] if key.startswith(prefix) else None
        if rest and "." not in rest and rest in values:
            check_value(key, values[rest])


def _number(value: object, kind: type) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = kind(value.strip())
        except ValueError:
            return None
    if kind is int:
        return value if isinstance(value, int) else None
    if not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer beyond every float
        return math.inf
