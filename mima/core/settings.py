"""Settings dataclasses as constructor signatures.

A component whose options are a typed dataclass (mima.config.model.ModelSettings,
mima.data.settings.DataSettings) takes them as keyword arguments, so that LightningCLI and
jsonargparse, which read constructor signatures, offer exactly the dataclass's fields with its
types, defaults and documentation. The dataclass stays the one place where an option and its
default are written; `mima fit` and every command that reads a run config see the same.

Each field is declared with `option(default, ...)`, which keeps the option's other facts (its range,
what a resume may do with it, its value for runs written before it) in the field's metadata, so that
the checks, the resume rule and the documentation's table of options are read from the field.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import typing
from collections.abc import Callable, Mapping
from typing import Literal, TypeVar

from mima.core.errors import MimaError

Component = TypeVar("Component", bound=type)
Value = TypeVar("Value")


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


# ------------------------------------------------------------------ an option's facts, declared with it
# Every option of a run (a field of ModelSettings, DataSettings or mima.config.fit_options.FitOptions; the
# Lightning options mima sets or checks in mima.config.fit_options) is declared once with its facts: its
# default, the range of a number, whether a resume may change it and the value that runs written before
# it existed behave as. The checks (ModelSettings and DataSettings when they are built; `mima fit`'s
# command line before Lightning loads), the resume rule (mima.config.config_changes) and the table of
# options in docs/configuration.md (mima.config.options) are all read from these declarations.
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

# What a resume (`mima fit --ckpt_path last`) may do with an option whose value differs from the run's:
#   "fixed"          the option can change the weights: the resume is refused (the default)
#   "may change"     it cannot: the resume goes on and the run folder records the change
#   "same processes" the process layout: it may change where the layout check passes (the same number
#                    of processes, for now)
#   "not compared"   how the command was called, not what it computes (the run folder is the same by
#                    construction, whatever --out template named it)
ResumeRule = Literal["fixed", "may change", "same processes", "not compared"]
FACTS = "mima.option"  # the key of an option's facts in its dataclass field's metadata


def cores() -> int:
    return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class PerCore:
    """An upper bound that grows with the machine: `factor` times its cores."""

    factor: int

    def __call__(self) -> int:
        return self.factor * cores()

    def __str__(self) -> str:
        return f"{self.factor} x the cores"


@dataclasses.dataclass(frozen=True)
class ValueRange:
    """A number's type (int or float) and its range low .. high (inclusive; `above_low`: low excluded);
    `listed`: a list of such values (one per task) is taken too."""

    kind: type
    low: float
    high: float | PerCore
    above_low: bool = False
    listed: bool = False

    def upper(self) -> float:
        return self.high() if isinstance(self.high, PerCore) else self.high

    def expected(self) -> str:
        """The range in an error line (a per-core bound as this machine's number)."""
        return self.words(self.upper())

    def words(self, high: float | PerCore) -> str:
        if self.kind is int:
            return f"an integer in {self.low} .. {high}"
        if self.above_low:
            return f"a finite number > {self.low:g} and <= {high:g}"
        return f"a finite number in {self.low:g} .. {high:g}"

    def check(self, name: str, value: object) -> None:
        """Refuse, in one line naming `name`, a value of the wrong type or out of the range; None (not
        set) passes, and a string passes when it spells a number in range (YAML reads `1e-3` as a
        string, which the config parser converts). A list, where the range takes one value per task,
        is checked item by item."""
        if value is None:
            return
        if isinstance(value, list | tuple) and self.listed:
            for item in value:
                self.check(name, item)
            return
        number = _number(value, self.kind)
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
        if number is None or (isinstance(number, float) and not math.isfinite(number)):
            raise MimaError(f"{name}: {shown} is not {self.expected()}")
        too_low = number <= self.low if self.above_low else number < self.low
        if too_low or number > self.upper():
            raise MimaError(f"{name}: {shown} is out of range; expected {self.expected()}")


@dataclasses.dataclass(frozen=True)
class OptionFacts:
    """What an option's declaration says besides its type and default.

    bounds: the range of a number (None: not a number, or any value).
    entries: where the option may be a map: the range of every entry, or of each named entry (an
        entry not named is not a number mima checks); an entry is named KEY.ENTRY in an error line.
    resume: what a resume may do with a changed value (ResumeRule).
    older_runs: the value that does what the runs written before the option existed did (a stored
        config without the option equals one with this value); None: the option is as old as the runs.
    help: the command-line help of an option that no docstring documents (fit's own options).
    """

    bounds: ValueRange | None = None
    entries: ValueRange | Mapping[str, ValueRange] | None = None
    resume: ResumeRule = "fixed"
    older_runs: object = None
    help: str = ""

    def check(self, name: str, value: object) -> None:
        """Refuse, in one line, a value out of the option's range (a map's entries each against theirs)."""
        if isinstance(value, Mapping) and self.entries is not None:
            for entry, item in value.items():
                bounds = self.entries if isinstance(self.entries, ValueRange) else self.entries.get(entry)
                if bounds is not None:
                    bounds.check(f"{name}.{entry}", item)
        elif self.bounds is not None:
            self.bounds.check(name, value)


def option(default: Value, *, bounds: ValueRange | None = None,
           entries: ValueRange | Mapping[str, ValueRange] | None = None, resume: ResumeRule = "fixed",
           older_runs: object = None, help: str = "") -> Value:
    """A settings dataclass field: its default, and its facts (OptionFacts) in the field's metadata."""
    facts = OptionFacts(bounds, entries, resume, older_runs, help)
    return dataclasses.field(default=default, metadata={FACTS: facts})


def declared_options(settings: type, prefix: str = "") -> dict[str, OptionFacts]:
    """The facts of every field of a settings dataclass, by the key a run config gives it (`prefix` + name)."""
    return {f"{prefix}{field.name}": field.metadata.get(FACTS, OptionFacts()) for field in dataclasses.fields(settings)}


def check_fields(section: str, settings: object) -> None:
    """Every field of a settings dataclass instance against its declared range, in field order, each
    named `section.field`."""
    for field in dataclasses.fields(settings):  # type: ignore[arg-type]
        facts = field.metadata.get(FACTS)
        if facts is not None:
            facts.check(f"{section}.{field.name}", getattr(settings, field.name))


def check_section(options: Mapping[str, OptionFacts], section: str, values: Mapping[str, object]) -> None:
    """The values of one section of a config (`section`: "trainer"; "" for the top level) against the
    ranges of `options` (keyed as a config gives them); keys without declared facts pass."""
    prefix = f"{section}." if section else ""
    for name, value in values.items():
        facts = options.get(f"{prefix}{name}")
        if facts is not None:
            facts.check(f"{prefix}{name}", value)


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
