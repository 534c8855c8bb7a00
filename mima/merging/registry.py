"""The registry of merge strategies: name -> function, paper, hyperparameters and grids.

Every strategy works on mappings from key to tensor (which may be lazy, file-backed readers) and
touches one key of each input at a time, so merging streams: see mima.merging.engine. A strategy
is one of four kinds:

  stream_fn(models, base, **hp)  -> iterator of (key, merged tensor)
  scaled_fn(models, base, **hp)  -> iterator of (key, anchor, direction or None); the merge is
                                    anchor + lam * direction, so a lambda grid needs one direction
                                    per structural setting (selection sweeps lam cheaply)
  data_fn(models, base, pool, **hp) -> MergeOutput(state, notes); strategies that need calibration
                                    or unlabelled data and forward passes (they hold all T task
                                    vectors). `pool` is a task pool (mima.merging.pool.Pool: tasks,
                                    heads, encoder, examples, loader, logits); the notes say what
                                    the strategy learnt (coefficients, chosen vertices, ...)
  index_fn(models, base, **hp) -> index, with reconstruct_fn(index, task) -> that task's model;
                                    per-task compressions (CART-Indexing, TALL masks) that keep
                                    one shared model plus a small per-task part

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

Hyperparameters are declared once, in HYPERPARAMETERS (name, check, meaning, command-line type; in
mima.merging.catalogue, which the command line reads without importing torch), and a strategy lists
the ones it takes with their defaults (the catalogue lists their names too; `register` checks both agree). A strategy whose hyperparameters depend
on a setting (FW-Merging's mode) says which it uses for given values (`uses`); a value given for a
hyperparameter the setting does not use is an error, never silently ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import itertools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from mima.core.errors import MimaError
from mima.core.state_dicts import is_mergeable
from mima.merging.catalogue import HYPERPARAMETERS, STRATEGIES, Hyperparameter, check_method_name  # noqa: F401  (Hyperparameter: re-exported)
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


@dataclass(frozen=True)
class MergeMethod:
    name: str
    paper: str
    summary: str
    needs_base: bool
    defaults: dict[str, object] = field(default_factory=dict)  # every hyperparameter it takes, with its default
    grid: dict[str, tuple] = field(default_factory=dict)  # searched on validation data
    stream_fn: Callable[..., Iterator[Item]] | None = None
    scaled_fn: Callable[..., Iterator[ScaledItem]] | None = None
    data_fn: Callable[..., MergeOutput] | None = None
    index_fn: Callable[..., StateDict] | None = None
    reconstruct_fn: Callable[[Mapping[str, torch.Tensor], int], StateDict] | None = None
    sweep_fn: Callable[..., Iterator[tuple[dict, StateDict, StateDict]]] | None = None
    # uses(values) -> the hyperparameters that a full setting actually uses (None: all of them).
    # Only those are passed to the strategy; giving another is an error.
    uses: Callable[[Mapping[str, object]], Collection[str]] | None = None
    # validate(values, spell) refuses, in one line, a full setting whose values are each valid but not
    # together or not against the registry (SVC: its inner merge and that merge's own setting)
    validate: Callable[[Mapping[str, object], Callable[[str], str]], None] | None = None
    # Fewer task models is an error, never a quiet merge: a merge of one model is that model.
    min_models: int = 2
    # Entry by entry: no matrix product, decomposition or float reduction whose rounding follows torch's
    # thread count, so the result is the same bytes on any number of threads (a test checks each); the
    # file engine then computes on one core fewer and leaves that core to its reader.
    entrywise: bool = False
    # Where the entry points compute when they are given no device (see `on`); None: where the inputs are.
    device: torch.device | None = None

    def on(self, device: torch.device | str | None) -> MergeMethod:
        """This method computing on `device` wherever it is not given one: in merge, sweep, stream and
        the file engine, and so in code that is handed the method (selection, evaluation)."""
        return dataclasses.replace(self, device=None if device is None else torch.device(device))

    def target(self, device: torch.device | str | None) -> torch.device | None:
        """The device an entry point computes on: the one it was given, else the method's own."""
        return torch.device(device) if device is not None else self.device

    @property
    def needs_data(self) -> bool:
        return self.data_fn is not None

    @property
    def per_task(self) -> bool:
        return self.index_fn is not None

    def hyperparameters(self, given: Mapping[str, object], spell: Callable[[str], str] = _spell) -> dict[str, object]:
        """The defaults updated with `given`, each checked, restricted to those the setting uses.

        Unknown names, invalid values and values given for a hyperparameter that the setting does
        not use (FW-Merging's lam in soft mode) are errors naming the option; `spell` writes an
        option's name (the command line passes '--lam' for 'lam').
        """
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            raise MimaError(
                f"merge method '{self.name}' takes no hyperparameter '{unknown[0]}' "
                f"(it takes: {', '.join(self.defaults) or 'none'})"
            )
        values = {**self.defaults, **given}
        for name in (*given, *self.defaults):  # the given ones first: a user's mistake is named first
            spec = HYPERPARAMETERS[name]
            if not spec.accepts(values[name]):
                raise MimaError(f"merge method '{self.name}': {spell(name)} must be {spec.meaning}, got {values[name]!r}")
        if self.validate is not None:
            self.validate(values, spell)
        if self.uses is None:
            return values
        used = set(self.uses(values))
        unused = [name for name in given if name not in used]
        if unused:
            deciding = [n for n in self.defaults if n in used and HYPERPARAMETERS[n].choices is not None]
            setting = ", ".join(f"{spell(n)}={values[n]}" for n in deciding)
            raise MimaError(
                f"merge method '{self.name}': {spell(unused[0])} is not used with {setting} "
                f"(used there: {', '.join(spell(n) for n in self.defaults if n in used)})"
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
        each tensor is read, naming the input and key, unless `allow_non_finite`. With a `device`, the
        inputs handed on are read onto it (the check of each tensor then runs there).
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
            return moved if allow_non_finite else refusing_non_finite(moved, input_name(model, name))

        return CheckedInputs([handed_on(model, f"models[{index}]") for index, model in enumerate(models)],
                             handed_on(base, "base"), values)

    def refusals(self, allow_non_finite: bool):
        """Around a merge: with `allow_non_finite`, a decomposition failing on NaN/Inf is one line."""
        return linalg_errors_as_refusals(self.name) if allow_non_finite else contextlib.nullcontext()

    def stream(self, models: Sequence[TensorMap], base: TensorMap | None = None, allow_non_finite: bool = False,
               device: torch.device | str | None = None, **given) -> Iterator[Item]:
        """The merged model, one (key, tensor) at a time (data-free strategies); checked first. With a
        device (or the method's own), computed there and each tensor handed back on the CPU."""
        if self.per_task:
            raise MimaError(f"merge method '{self.name}' keeps one model per task; use its index and reconstruct")
        if self.needs_data:
            raise MimaError(f"merge method '{self.name}' needs task data (a config with model and data sections)")
        target = self.target(device)
        checked = self.check(models, base, allow_non_finite, target, **given)
        items = self.run(checked.models, checked.base, checked.values)
        if target is not None:
            items = ((key, tensor.to("cpu")) for key, tensor in computed_on(target, items))
        return refusing_linalg_errors(self.name, items) if allow_non_finite else items

    def run(self, models: Sequence[TensorMap], base: TensorMap | None, values: Mapping[str, object]) -> Iterator[Item]:
        """The merge, one (key, tensor) at a time, of inputs and a full setting that `check` already
        passed (a data-free strategy); `stream` is the checked entry point, SVC runs its inner merge so."""
        values = dict(values)
        if self.stream_fn is not None:
            return self.stream_fn(models, base, **values)
        lam = values.pop("lam")
        return (
            (key, combine_tensor(anchor, direction, lam))
            for key, anchor, direction in self.scaled_fn(models, base, **values)
        )

    def merge(self, models: Sequence[TensorMap], base: TensorMap | None = None, pool=None, allow_non_finite: bool = False,
              device: torch.device | str | None = None, **given) -> MergeOutput:
        """The merged model (for per-task methods: their index) with the strategy's notes; checked first.

        `pool` (a task pool, see mima.merging.pool.Pool) is required by data-dependent strategies
        and ignored by the others, whose notes are empty. `device` (or the method's own): where a
        data-free or per-task strategy computes, the result coming back on the CPU; data-dependent
        strategies compute where their inputs and the pool are.
        """
        if not self.per_task and not self.needs_data:
            return MergeOutput(dict(self.stream(models, base, allow_non_finite, device, **given)))
        target = self.target(device) if self.per_task else None
        checked = self.check(models, base, allow_non_finite, target, **given)
        if self.needs_data and pool is None:
            raise MimaError(f"merge method '{self.name}' needs task data (a config with model and data sections)")
        with self.refusals(allow_non_finite), ieee_matmuls(target):
            if self.per_task:
                index = self.index_fn(checked.models, checked.base, **checked.values)
                return MergeOutput(index if target is None else on_host(index))
            output = self.data_fn(checked.models, checked.base, pool, **checked.values)
        if not isinstance(output, MergeOutput):
            raise TypeError(f"merge method '{self.name}': data_fn must return a MergeOutput, got {type(output).__name__}")
        return output

    def __call__(self, models: Sequence[TensorMap], base: TensorMap | None = None, pool=None,
                 allow_non_finite: bool = False, device: torch.device | str | None = None, **given) -> StateDict:
        """The merged model as a state dict (for per-task methods: their index); see `merge` for the notes."""
        return self.merge(models, base, pool, allow_non_finite, device, **given).state

    def sweep(self, models, base, settings: Mapping[str, Sequence], allow_non_finite: bool = False,
              device: torch.device | str | None = None) -> Iterator[tuple[dict, StateDict, StateDict]]:
        """(setting, anchor, direction) for every combination of structural values, for selection;
        computed on `device` (or the method's own) and handed back on the CPU."""
        target = self.target(device)
        checked = self.check(models, base, allow_non_finite, target)
        with self.refusals(allow_non_finite):
            swept = self._sweep(checked.models, checked.base, settings)
            if target is None:
                yield from swept
                return
            for setting, anchor, direction in computed_on(target, swept):
                yield setting, on_host(anchor), on_host(direction)

    def _sweep(self, models, base, settings: Mapping[str, Sequence]) -> Iterator[tuple[dict, StateDict, StateDict]]:
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


def register(method: MergeMethod) -> MergeMethod:
    """Add a strategy; its declaration is checked here, so a mistake fails at import, not mid-merge."""
    if method.name in MERGE_METHODS:
        raise ValueError(f"merge method {method.name} registered twice")
    kinds = [f for f in (method.stream_fn, method.scaled_fn, method.data_fn, method.index_fn) if f is not None]
    if len(kinds) != 1:
        raise ValueError(f"merge method {method.name} needs exactly one of stream_fn, scaled_fn, data_fn, index_fn")
    if (method.index_fn is None) != (method.reconstruct_fn is None):
        raise ValueError(f"merge method {method.name}: index_fn and reconstruct_fn come together")
    undeclared = sorted(set(method.defaults) - set(HYPERPARAMETERS))
    if undeclared:
        raise ValueError(f"merge method {method.name}: hyperparameter {undeclared[0]} is not declared in HYPERPARAMETERS")
    if method.scaled_fn is not None and "lam" not in method.defaults:
        raise ValueError(f"merge method {method.name}: a scaled_fn strategy takes lam")
    for name, value in method.defaults.items():
        if not HYPERPARAMETERS[name].accepts(value):
            raise ValueError(f"merge method {method.name}: default {name}={value!r} is not {HYPERPARAMETERS[name].meaning}")
    for name, values in method.grid.items():
        if name not in method.defaults or not all(HYPERPARAMETERS[name].accepts(v) for v in values):
            raise ValueError(f"merge method {method.name}: grid of {name} is not a list of its valid values")
    if method.uses is not None and not set(method.uses(method.defaults)) <= set(method.defaults):
        raise ValueError(f"merge method {method.name}: uses() names hyperparameters it does not take")
    listed = STRATEGIES.get(method.name)
    if listed is None or listed.hyperparameters != tuple(method.defaults):
        raise ValueError(f"merge method {method.name}: mima.merging.catalogue.STRATEGIES must list it with the "
                         f"hyperparameters {tuple(method.defaults)} (it lists {listed})")
    MERGE_METHODS[method.name] = method
    return method


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
