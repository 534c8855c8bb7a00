"""The registry of merge strategies: name -> function, paper, hyperparameters and grids.

Every strategy works on mappings from key to tensor (which may be lazy, file-backed readers) and
touches one key of each input at a time, so merging streams: see mima.merging.engine. A strategy
is one of four kinds, each a subclass of MergeMethod holding the functions of its kind:

  StreamingMerge(stream_fn)   stream_fn(models, base, **hp) -> iterator of (key, merged tensor)
  ScaledMerge(scaled_fn)      scaled_fn(models, base, **hp) -> iterator of (key, anchor, direction or
                              None); the merge is anchor + lam * direction, so a lambda grid needs one
                              direction per structural setting (`sweep`; selection sweeps lam cheaply)
  DataMerge(data_fn)          data_fn(models, base, pool, **hp) -> MergeOutput(state, notes); strategies
                              that need calibration or unlabelled data and forward passes (they hold all
                              T task vectors). `pool` is a task pool (mima.merging.pool.Pool: tasks,
                              heads, encoder, examples, loader, logits); the notes say what the strategy
                              learnt (coefficients, chosen vertices, ...)
  PerTaskMerge(index_fn, reconstruct_fn)  index_fn(models, base, **hp) -> index, with `reconstruct(index,
                              task)` -> that task's model; per-task compressions (CART-Indexing, TALL
                              masks) that keep one shared model plus a small per-task part

The first two are DataFreeMerge: they stream (`stream`, and the file engine). Every kind has `merge`
(per-task: the index; data: needs the pool), `grid_points` (the validation grid in selection order:
the one walk of it, which `mima merge --select-on val` and `mima evaluate`'s grid search both follow,
so that both break ties alike) and `grid_merges` (the merge at each of those points, what selection
scores).

Every entry point (MergeMethod.stream, merge, sweep, and `mima merge` through the engine) first runs
the method's `check`: theta_0 when needed, enough task models, `min_tasks` and `matrix_keys` that fit
the inputs, NaN/Inf refused unless allowed; Python and the command line refuse alike, in one line.

Every entry point also takes a `device` (a torch.device; default: the method's own, set by
`on(device)`, else none): the inputs are then read onto that device one tensor at a time (the file
engine's groups of one key, or the in-memory dicts'), the strategy computes there, and the merged
tensors come back to the CPU. On the CPU this is the same code on the same tensors, so the result is
bit for bit the one without a device; on a GPU it equals the CPU's within float32 rounding (matmuls
in full precision, random masks drawn on the CPU, SVD signs fixed where U or V is stored alone:
mima.core.linalg).
Data-dependent strategies ignore it: their work is forward passes on the task pool's device.

Strategies and hyperparameters are declared once, in mima.merging.catalogue (which the command line
and the docs' tables read without importing torch): each hyperparameter's check, meaning and
command-line type in HYPERPARAMETERS, and each strategy's kind, paper, summary, need of theta_0,
defaults and paper grid in STRATEGIES, which the method reads (`paper`, `summary`, `needs_base`,
`defaults`, `grid`); a strategy's module holds only its functions (and registers them as its declared
kind: `register` checks the type against KIND_TYPES). A
strategy whose hyperparameters depend on a setting (FW-Merging's mode) says which it uses for given
values (`used`); a value given for a hyperparameter the setting does not use is an error, never
silently ignored.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import itertools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Self

import torch

from mima.core.errors import MimaError
from mima.core.state_dicts import is_mergeable
from mima.merging.catalogue import (  # noqa: F401  (Hyperparameter: re-exported)
    HYPERPARAMETERS,
    STRATEGIES,
    Hyperparameter,
    Paper,
    Strategy,
    check_method_name,
)
from mima.merging.common import (
    check_matrix_keys,
    ieee_matmuls,
    linalg_errors_as_refusals,
    on_device,
    on_host,
    refusing_linalg_errors,
    refusing_non_finite,
)

TensorMap = Mapping[str, torch.Tensor]
StateDict = dict[str, torch.Tensor]
Item = tuple[str, torch.Tensor]
ScaledItem = tuple[str, torch.Tensor, "torch.Tensor | None"]
GridPoint = tuple[dict[str, object], "float | None"]  # (structural setting, lam or None): one point of a grid


@dataclass
class MergeOutput:
    """What a data-dependent strategy returns: the merged state dict and notes on how it was found
    (learnt coefficients, entropies, chosen vertices; JSON-serialisable)."""

    state: StateDict
    notes: dict[str, object] = field(default_factory=dict)


def _spell(name: str) -> str:
    return name


@dataclass(frozen=True)
class CheckedInputs:
    """What `MergeMethod.check` hands the strategy: the inputs (each refusing NaN or Inf as it is
    read, unless allowed) and the full setting of the hyperparameters it uses."""

    models: list[TensorMap]
    base: TensorMap | None
    values: dict[str, object]


def input_name(model: TensorMap, fallback: str) -> str:
    """How an error names an input: its file when it is file-backed (the engine's views and
    SafetensorsReader carry `path`), else its place in the call (`models[1]`, `base`)."""
    path = getattr(model, "path", None)
    return str(path) if path is not None else fallback


@dataclass(frozen=True, kw_only=True)
class MergeMethod(abc.ABC):
    """A registered merge strategy, one of four kinds (the subclasses below: StreamingMerge, ScaledMerge,
    PerTaskMerge, DataMerge), each holding the functions of its kind. What every kind shares: its name,
    and what its declaration in mima.merging.catalogue.STRATEGIES says (`paper`, `summary`, `needs_base`,
    `defaults`, `grid`), the checks every entry point runs, and the device it computes on."""

    name: str  # as declared in mima.merging.catalogue.STRATEGIES
    # Fewer task models is an error, never a quiet merge: a merge of one model is that model.
    min_models: int = 2
    # Entry by entry: no matrix product, decomposition or float reduction whose rounding follows torch's
    # thread count, so the result is the same bytes on any number of threads (a test checks each); the
    # file engine then computes on one core fewer and leaves that core to its reader.
    entrywise: bool = False
    # Where the entry points compute when they are given no device (see `on`); None: where the inputs are.
    device: torch.device | None = None

    needs_data: ClassVar[bool] = False  # DataMerge: merge() needs a task pool
    per_task: ClassVar[bool] = False  # PerTaskMerge: merge() gives an index, one model per task

    @property
    def declaration(self) -> Strategy:
        return STRATEGIES[self.name]

    @property
    def paper(self) -> Paper:
        """The paper it follows (its declaration's)."""
        return self.declaration.paper

    @property
    def summary(self) -> str:
        """What it does, in one line (its declaration's)."""
        return self.declaration.summary

    @property
    def needs_base(self) -> bool:
        """It needs theta_0 (its declaration's)."""
        return self.declaration.needs_base

    @property
    def defaults(self) -> dict[str, object]:
        """Every hyperparameter it takes, with its default (its declaration's)."""
        return dict(self.declaration.defaults)

    @property
    def grid(self) -> dict[str, tuple]:
        """The values searched on validation data (its declaration's)."""
        return dict(self.declaration.grid)

    def on(self, device: torch.device | str | None) -> Self:
        """This method computing on `device` wherever it is not given one: in merge, sweep, stream and
        the file engine, and so in code that is handed the method (selection, evaluation)."""
        return dataclasses.replace(self, device=None if device is None else torch.device(device))

    def target(self, device: torch.device | str | None) -> torch.device | None:
        """The device an entry point computes on: the one it was given, else the method's own."""
        return torch.device(device) if device is not None else self.device

    def used(self, values: Mapping[str, object]) -> Collection[str]:
        """The hyperparameters that the full setting `values` actually uses (all of them, unless a kind
        whose setting decides, like FW-Merging's mode, says otherwise). Only those are passed to the
        strategy; giving another is an error."""
        return values.keys()

    def validate(self, values: Mapping[str, object], spell: Callable[[str], str]) -> None:
        """Refuse, in one line, a full setting whose values are each valid but not together or not against
        the registry (SVC: its inner merge and that merge's own setting); nothing to refuse by default."""

    def hyperparameters(self, given: Mapping[str, object], spell: Callable[[str], str] = _spell) -> dict[str, object]:
        """The defaults updated with `given`, each checked, restricted to those the setting uses.

        Unknown names, invalid values and values given for a hyperparameter that the setting does
        not use (FW-Merging's lam in soft mode) are errors naming the option; `spell` writes an
        option's name (the command line passes '--lam' for 'lam').
        """
        defaults = self.defaults
        unknown = sorted(set(given) - set(defaults))
        if unknown:
            raise MimaError(
                f"merge method '{self.name}' takes no hyperparameter '{unknown[0]}' "
                f"(it takes: {', '.join(defaults) or 'none'})"
            )
        values = {**defaults, **given}
        for name in (*given, *defaults):  # the given ones first: a user's mistake is named first
            spec = HYPERPARAMETERS[name]
            if not spec.accepts(values[name]):
                raise MimaError(f"merge method '{self.name}': {spell(name)} must be {spec.meaning}, got {values[name]!r}")
        self.validate(values, spell)
        used = set(self.used(values))
        unused = [name for name in given if name not in used]
        if unused:
            deciding = [n for n in defaults if n in used and HYPERPARAMETERS[n].choices is not None]
            setting = ", ".join(f"{spell(n)}={values[n]}" for n in deciding)
            raise MimaError(
                f"merge method '{self.name}': {spell(unused[0])} is not used with {setting} "
                f"(used there: {', '.join(spell(n) for n in defaults if n in used)})"
            )
        return {name: value for name, value in values.items() if name in used}

    def check(self, models: Sequence[TensorMap], base: TensorMap | None = None, allow_non_finite: bool = False,
              device: torch.device | None = None, **given) -> CheckedInputs:
        """Refuse, before any work, the inputs and hyperparameters this method cannot merge; every
        entry point (stream, merge, sweep, `mima merge`) runs it, so Python and the command line
        refuse the same inputs with the same one-line message.

        The rules: the hyperparameters' values (see `hyperparameters`); theta_0 when the method needs
        it; at least `min_models` task models, and no more `min_tasks` than models; a `matrix_keys`
        pattern given that selects no 2-D floating tensor (read from the headers of lazy inputs),
        which would quietly make a low-rank merge an average. NaN or Inf weights are refused as
        each tensor is read, naming the input and key, unless `allow_non_finite` (never for a
        data-dependent merge, whose forward passes would spread them: docs/merging.md, "Degenerate
        inputs"). With a `device`, the inputs handed on are read onto it (the check of each tensor
        then runs there).
        """
        values = self.hyperparameters(given)
        if self.needs_base and base is None:
            raise MimaError(f"merge method '{self.name}' needs the pretrained model: pass base (--base)")
        count = len(models)
        if count < self.min_models:
            raise MimaError(f"merge method '{self.name}': models (--models) must be at least {self.min_models} task models, "
                            f"got {count}")
        if values.get("min_tasks", 0) > count:  # consensus would keep nothing but theta_0
            raise MimaError(f"merge method '{self.name}': min_tasks (--min-tasks) must be at most the {count} models given, "
                            f"got {values['min_tasks']} (each entry can be chosen by at most {count} tasks)")
        if "matrix_keys" in given:
            check_matrix_keys(self.name, models[0], given["matrix_keys"])

        def handed_on(model: TensorMap | None, name: str) -> TensorMap | None:
            if model is None:
                return None
            moved = on_device(model, device)
            if allow_non_finite and not self.needs_data:
                return moved
            return refusing_non_finite(moved, input_name(model, name), self.name if self.needs_data else None)

        return CheckedInputs([handed_on(model, f"models[{index}]") for index, model in enumerate(models)],
                             handed_on(base, "base"), values)

    def refusals(self):
        """Around a merge: a decomposition or solve that cannot run (on NaN/Inf, or on a finite matrix
        every fallback failed on) is one line naming the method and the tensor."""
        return linalg_errors_as_refusals(self.name)

    def stream(self, models: Sequence[TensorMap], base: TensorMap | None = None, allow_non_finite: bool = False,
               device: torch.device | str | None = None, **given) -> Iterator[Item]:
        """The merged model, one (key, tensor) at a time: only the data-free kinds (DataFreeMerge) stream."""
        if self.per_task:
            raise MimaError(f"merge method '{self.name}' keeps one model per task; use its index and reconstruct")
        raise MimaError(f"merge method '{self.name}' needs task data (a config with model and data sections)")

    @abc.abstractmethod
    def merge(self, models: Sequence[TensorMap], base: TensorMap | None = None, pool=None, allow_non_finite: bool = False,
              device: torch.device | str | None = None, **given) -> MergeOutput:
        """The merged model (for per-task methods: their index) with the strategy's notes; checked first.

        `pool` (a task pool, see mima.merging.pool.Pool) is required by data-dependent strategies
        and ignored by the others, whose notes are empty. `device` (or the method's own): where a
        data-free or per-task strategy computes, the result coming back on the CPU; data-dependent
        strategies compute where their inputs and the pool are.
        """

    def __call__(self, models: Sequence[TensorMap], base: TensorMap | None = None, pool=None,
                 allow_non_finite: bool = False, device: torch.device | str | None = None, **given) -> StateDict:
        """The merged model as a state dict (for per-task methods: their index); see `merge` for the notes."""
        return self.merge(models, base, pool, allow_non_finite, device, **given).state

    def grid_points(self) -> list[GridPoint]:
        """The validation grid in selection order, the one walk of it: every combination of the grid's
        values, the last hyperparameter varying fastest, each value in its declared order (so the first
        best point, BestPoint's pick, is the same wherever the grid is searched); none without a grid."""
        if not self.grid:
            return []
        return [(dict(zip(self.grid, values)), None) for values in itertools.product(*self.grid.values())]

    def grid_merges(self, models: Sequence[TensorMap], base: TensorMap | None, pool=None,
                    allow_non_finite: bool = False) -> Iterator[tuple[dict[str, object], MergeOutput]]:
        """(point, merge at that point) for every point of `grid_points`, in its order (the other
        hyperparameters at their defaults): what selection scores. A ScaledMerge shares the work of
        the points that differ only in lam."""
        for setting, _ in self.grid_points():
            yield setting, self.merge(models, base, pool, allow_non_finite, **setting)


@dataclass(frozen=True, kw_only=True)
class DataFreeMerge(MergeMethod):
    """A merge computed key by key from the inputs alone, so it streams (the file engine writes each
    merged tensor as it comes): StreamingMerge and ScaledMerge."""

    @abc.abstractmethod
    def run(self, models: Sequence[TensorMap], base: TensorMap | None, values: Mapping[str, object]) -> Iterator[Item]:
        """The merge, one (key, tensor) at a time, of inputs and a full setting that `check` already
        passed; `stream` is the checked entry point, SVC runs its inner merge so."""

    def stream(self, models: Sequence[TensorMap], base: TensorMap | None = None, allow_non_finite: bool = False,
               device: torch.device | str | None = None, **given) -> Iterator[Item]:
        """The merged model, one (key, tensor) at a time; checked first. With a device (or the method's
        own), computed there and each tensor handed back on the CPU."""
        target = self.target(device)
        checked = self.check(models, base, allow_non_finite, target, **given)
        with self.refusals():  # a strategy may compute before its first item (LiNeS's 'auto' alpha)
            items = self.run(checked.models, checked.base, checked.values)
        if target is not None:
            items = ((key, tensor.to("cpu")) for key, tensor in computed_on(target, items))
        return refusing_linalg_errors(self.name, items)

    def merge(self, models: Sequence[TensorMap], base: TensorMap | None = None, pool=None, allow_non_finite: bool = False,
              device: torch.device | str | None = None, **given) -> MergeOutput:
        return MergeOutput(dict(self.stream(models, base, allow_non_finite, device, **given)))


@dataclass(frozen=True, kw_only=True)
class StreamingMerge(DataFreeMerge):
    """stream_fn(models, base, **hp) -> iterator of (key, merged tensor)."""

    stream_fn: Callable[..., Iterator[Item]]

    def run(self, models: Sequence[TensorMap], base: TensorMap | None, values: Mapping[str, object]) -> Iterator[Item]:
        return self.stream_fn(models, base, **values)


@dataclass(frozen=True, kw_only=True)
class ScaledMerge(DataFreeMerge):
    """scaled_fn(models, base, **hp without lam) -> iterator of (key, anchor, direction or None): the merge
    is anchor + lam * direction, so a lam grid needs one direction per structural setting (`sweep`).
    It takes `lam` (register checks)."""

    scaled_fn: Callable[..., Iterator[ScaledItem]]
    # sweep_fn(models, base, **fixed hp, **{name: values}) -> (setting, anchor, direction) per combination,
    # for a strategy that shares work between settings (CART: one SVD per matrix for every rank ratio);
    # None: scaled_fn once per setting.
    sweep_fn: Callable[..., Iterator[tuple[dict, StateDict, StateDict]]] | None = None

    def run(self, models: Sequence[TensorMap], base: TensorMap | None, values: Mapping[str, object]) -> Iterator[Item]:
        values = dict(values)
        lam = values.pop("lam")
        return (
            (key, combine_tensor(anchor, direction, lam))
            for key, anchor, direction in self.scaled_fn(models, base, **values)
        )

    def sweep(self, models, base, settings: Mapping[str, Sequence], allow_non_finite: bool = False,
              device: torch.device | str | None = None) -> Iterator[tuple[dict, StateDict, StateDict]]:
        """(setting, anchor, direction) for every combination of structural values, for selection;
        computed on `device` (or the method's own) and handed back on the CPU."""
        target = self.target(device)
        checked = self.check(models, base, allow_non_finite, target)
        with self.refusals():
            swept = self._swept(checked.models, checked.base, settings)
            if target is None:
                yield from swept
                return
            for setting, anchor, direction in computed_on(target, swept):
                yield setting, on_host(anchor), on_host(direction)

    def _swept(self, models, base, settings: Mapping[str, Sequence]) -> Iterator[tuple[dict, StateDict, StateDict]]:
        fixed = {k: v for k, v in self.defaults.items() if k != "lam" and k not in settings}
        if self.sweep_fn is not None:
            yield from self.sweep_fn(models, base, **fixed, **settings)
            return
        for values in itertools.product(*settings.values()):
            setting = {**fixed, **dict(zip(settings, values))}
            self.hyperparameters({**setting, "lam": self.defaults["lam"]})
            anchor, direction = {}, {}  # kept in host memory, whatever device computes them
            for key, anchor_tensor, direction_tensor in self.scaled_fn(models, base, **setting):
                anchor[key] = anchor_tensor.to("cpu")
                if direction_tensor is not None:
                    direction[key] = direction_tensor.to("cpu")
            yield dict(zip(settings, values)), anchor, direction

    def grid_points(self) -> list[GridPoint]:
        """The walk of MergeMethod.grid_points with lam apart: every lam of one structural setting (one
        direction, `sweep`) before the next setting; the default lam where the grid lists none."""
        if not self.grid:
            return []
        structural = {name: values for name, values in self.grid.items() if name != "lam"}
        lams = self.grid.get("lam", (self.defaults["lam"],))
        settings = [dict(zip(structural, values)) for values in itertools.product(*structural.values())]
        return [(setting, lam) for setting in settings for lam in lams]

    def grid_merges(self, models: Sequence[TensorMap], base: TensorMap | None, pool=None,
                    allow_non_finite: bool = False) -> Iterator[tuple[dict[str, object], MergeOutput]]:
        walk = self.grid_points()
        if not walk:
            return
        lams: dict[tuple, list] = {}  # each structural setting's lams, in the walk's order
        for setting, lam in walk:
            lams.setdefault(tuple(setting.items()), []).append(lam)
        structural = {name: tuple(dict.fromkeys(setting[name] for setting, _ in walk)) for name in walk[0][0]}
        settings = iter(lams)
        for setting, anchor, direction in self.sweep(models, base, structural, allow_non_finite):
            if tuple(setting.items()) != next(settings):  # the sweep must keep the walk's order (ties)
                raise RuntimeError(f"{self.name}: the sweep gave {setting} out of the grid's order")
            for lam in lams[tuple(setting.items())]:
                yield {**setting, "lam": lam}, MergeOutput(combine(anchor, direction, lam))


@dataclass(frozen=True, kw_only=True)
class PerTaskMerge(MergeMethod):
    """index_fn(models, base, **hp) -> index, with reconstruct_fn(index, task) -> that task's model:
    per-task compressions (CART-Indexing, TALL masks, EMR) that keep one shared model plus a small
    per-task part. merge() gives the index."""

    index_fn: Callable[..., StateDict]
    reconstruct_fn: Callable[[Mapping[str, torch.Tensor], int], StateDict]

    per_task: ClassVar[bool] = True

    def merge(self, models: Sequence[TensorMap], base: TensorMap | None = None, pool=None, allow_non_finite: bool = False,
              device: torch.device | str | None = None, **given) -> MergeOutput:
        target = self.target(device)
        checked = self.check(models, base, allow_non_finite, target, **given)
        with self.refusals(), ieee_matmuls(target):
            index = self.index_fn(checked.models, checked.base, **checked.values)
        return MergeOutput(index if target is None else on_host(index))

    def reconstruct(self, index: Mapping[str, torch.Tensor], task: int) -> StateDict:
        """Task `task`'s model (its place in the models merged) from the index merge() gave."""
        return self.reconstruct_fn(index, task)


@dataclass(frozen=True, kw_only=True)
class DataMerge(MergeMethod):
    """data_fn(models, base, pool, **hp) -> MergeOutput(state, notes): strategies that need calibration
    or unlabelled data and forward passes (they hold all T task vectors). They compute where their
    inputs and the pool are, whatever the device."""

    data_fn: Callable[..., MergeOutput]

    needs_data: ClassVar[bool] = True

    def merge(self, models: Sequence[TensorMap], base: TensorMap | None = None, pool=None, allow_non_finite: bool = False,
              device: torch.device | str | None = None, **given) -> MergeOutput:
        checked = self.check(models, base, allow_non_finite, None, **given)
        if pool is None:
            raise MimaError(f"merge method '{self.name}' needs task data (a config with model and data sections)")
        with self.refusals(), ieee_matmuls(None):
            output = self.data_fn(checked.models, checked.base, pool, **checked.values)
        if not isinstance(output, MergeOutput):
            raise TypeError(f"merge method '{self.name}': data_fn must return a MergeOutput, got {type(output).__name__}")
        return output


def computed_on(device: torch.device, items: Iterator) -> Iterator:
    """A merge's items, each computed with full-precision matmuls on `device` (and only while it is
    computed: the caller's own work between items keeps its settings)."""
    iterator = iter(items)
    while True:
        with ieee_matmuls(device):
            item = next(iterator, None)
        if item is None:
            return
        yield item


def combine_tensor(anchor: torch.Tensor, direction: torch.Tensor | None, lam: float) -> torch.Tensor:
    """anchor + lam * direction in the anchor's dtype (computed in float32 or wider)."""
    if direction is None:
        return anchor.clone()
    # lam * direction + anchor, added in place into the product (one allocation, the same rounding)
    return (lam * direction).add_(anchor.to(direction.dtype)).to(anchor.dtype)


def combine(anchor: TensorMap, direction: TensorMap, lam: float) -> StateDict:
    return {key: combine_tensor(value, direction.get(key), lam) for key, value in anchor.items()}


MERGE_METHODS: dict[str, MergeMethod] = {}
# the type of each kind a declaration names (mima.merging.catalogue.KINDS)
KIND_TYPES: dict[str, type[MergeMethod]] = {"streaming": StreamingMerge, "scaled": ScaledMerge,
                                            "per-task": PerTaskMerge, "data": DataMerge}


def register(method: MergeMethod) -> MergeMethod:
    """Add a strategy; its declaration (mima.merging.catalogue.STRATEGIES) is checked here, so a
    mistake fails at import, not mid-merge."""
    if method.name in MERGE_METHODS:
        raise ValueError(f"merge method {method.name} registered twice")
    if method.name not in STRATEGIES:
        raise ValueError(f"merge method {method.name}: mima.merging.catalogue.STRATEGIES must list it "
                         "(its module, kind, paper, hyperparameters and grid)")
    kind = STRATEGIES[method.name].kind
    if not isinstance(method, KIND_TYPES[kind]):
        raise ValueError(f"merge method {method.name} is declared a {kind} strategy, so it must be a "
                         f"{KIND_TYPES[kind].__name__}, not a {type(method).__name__}")
    check_declaration(method.name, STRATEGIES[method.name])
    if isinstance(method, ScaledMerge) and "lam" not in method.defaults:
        raise ValueError(f"merge method {method.name}: a ScaledMerge takes lam")
    if not set(method.used(method.defaults)) <= set(method.defaults):
        raise ValueError(f"merge method {method.name}: used() names hyperparameters it does not take")
    MERGE_METHODS[method.name] = method
    return method


def check_declaration(name: str, strategy: Strategy) -> None:
    """Refuse a declaration whose defaults or grid values its hyperparameters do not accept."""
    undeclared = sorted(set(strategy.defaults) - set(HYPERPARAMETERS))
    if undeclared:
        raise ValueError(f"merge method {name}: hyperparameter {undeclared[0]} is not declared in HYPERPARAMETERS")
    for hyperparameter, value in strategy.defaults.items():
        spec = HYPERPARAMETERS[hyperparameter]
        if not spec.accepts(value):
            raise ValueError(f"merge method {name}: default {hyperparameter}={value!r} is not {spec.meaning}")
    for hyperparameter, values in strategy.grid.items():
        if hyperparameter not in strategy.defaults or not all(HYPERPARAMETERS[hyperparameter].accepts(v) for v in values):
            raise ValueError(f"merge method {name}: grid of {hyperparameter} is not a list of its valid values")


_load_state = {"loaded": False, "loading": False}


def load_strategies() -> None:
    """Import the module of every strategy in the catalogue (each registers its strategies here), then
    check that each name in the catalogue was registered. The package's names (`from mima.merging
    import get_method`) and `get_method` call it; importing one strategy's module loads only that one."""
    if _load_state["loaded"] or _load_state["loading"]:  # a strategy's module may look another up as it loads
        return
    _load_state["loading"] = True
    try:
        for module in dict.fromkeys(strategy.module for strategy in STRATEGIES.values()):
            importlib.import_module(f"mima.merging.{module}")
    finally:
        _load_state["loading"] = False
    missing = sorted(set(STRATEGIES) - set(MERGE_METHODS))
    if missing:
        raise ValueError(f"mima.merging.catalogue.STRATEGIES lists {missing[0]}, which its module "
                         f"mima.merging.{STRATEGIES[missing[0]].module} does not register")
    _load_state["loaded"] = True


def get_method(name: str) -> MergeMethod:
    check_method_name(name)
    load_strategies()
    return MERGE_METHODS[name]


def floating_keys(state_dict: TensorMap) -> list[str]:
    """Keys of floating tensors; works on lazy readers through their headers when they have one."""
    infos = getattr(state_dict, "infos", None)
    if infos is not None:
        return [key for key, info in infos.items() if info.dtype.is_floating_point]
    return [key for key, value in state_dict.items() if is_mergeable(value)]
