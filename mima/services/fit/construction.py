"""The classes a `mima fit` config names (its callbacks, plugins, profiler, strategy, accelerator), made
so that one that refuses its arguments is one line naming the option, the class and the library's own
message (mima.config.parse_errors.construction_refusal), not jsonargparse's "Does not validate
against any of the Union subtypes", which swallows it; and the trackers `trainer.logger` names left
to mima (mima.training.trackers.build_trackers), which makes them in the run folder, once."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins import CheckpointIO, LayerSync, Precision
from lightning.pytorch.plugins.environments import ClusterEnvironment
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.strategies import Strategy

from mima.config.parse_errors import construction_refusal
from mima.core.errors import MimaError

# What the Trainer's arguments take as a class_path (its plugins: Lightning's PLUGIN_INPUT). The module
# and the datamodule are LightningCLI's to make (its instantiators keep their hyperparameters).
CONFIG_CLASS_BASES: tuple[type, ...] = (Callback, Logger, Profiler, Strategy, Accelerator, Precision, ClusterEnvironment,
                                        CheckpointIO, LayerSync)


@dataclass(frozen=True)
class ClassEntry:
    """A class the config names: where (`trainer.callbacks[1]`), which, and with what arguments."""

    option: str
    class_path: str
    init_args: Mapping[str, Any]

    def names_class(self, class_type: type) -> bool:
        module, _, name = self.class_path.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name) is class_type  # imported already by jsonargparse
        except (ImportError, AttributeError, ValueError):
            return False

    def gives(self, arguments: Mapping[str, Any]) -> bool:
        """Whether its plain arguments (numbers, strings) are those of `arguments`."""
        plain = {key: value for key, value in self.init_args.items() if not isinstance(value, Mapping | list)}
        return all(arguments.get(key) == value for key, value in plain.items())


def entry_made(entries: list[ClassEntry], class_type: type, arguments: Mapping[str, Any]) -> ClassEntry | None:
    """The entry made as `class_type(**arguments)`: of that class, with those arguments where several are."""
    of_class = [entry for entry in entries if entry.names_class(class_type)]
    return next((entry for entry in of_class if entry.gives(arguments)), of_class[0] if of_class else None)


def class_entries(value: Any, option: str) -> Iterator[ClassEntry]:
    """Every class_path in a config value (nested ones too), with the option that holds it."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, Mapping):
        if isinstance(value.get("class_path"), str):
            init_args = dict(value.get("init_args") or {})
            yield ClassEntry(option, value["class_path"], init_args)
            for key, item in init_args.items():
                yield from class_entries(item, f"{option}.init_args.{key}")
        else:
            for key, item in value.items():
                yield from class_entries(item, f"{option}.{key}" if option else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from class_entries(item, f"{option}[{index}]")


def named_instantiators(config: Namespace) -> list[tuple[Callable[..., Any], type, bool]]:
    """jsonargparse instantiators (`parser.instantiate(..., instantiators=...)`) for the Trainer's
    classes: each made as jsonargparse would, a refusal raised as one line naming its option."""
    entries = list(class_entries(config.get("trainer"), "trainer"))

    def make(class_type: type, *args: Any, **kwargs: Any) -> Any:
        try:
            return class_type(*args, **kwargs)
        except MimaError:
            raise
        except Exception as exc:  # the class's own refusal, whatever its type: the user's arguments
            entry = entry_made(entries, class_type, kwargs)
            option = entry.option if entry else "trainer"
            class_path = entry.class_path if entry else f"{class_type.__module__}.{class_type.__qualname__}"
            raise construction_refusal(option, class_path, exc) from None

    return [(make, base, True) for base in CONFIG_CLASS_BASES]


def without_trackers(config: Namespace) -> Namespace:
    """`config` for jsonargparse to make its classes from: the trackers `trainer.logger` names left out
    (mima makes them in the run folder, after the run's checks: mima.training.trackers.build_trackers;
    jsonargparse would make them first, in the working directory)."""
    setting = config.get("trainer.logger")
    if isinstance(setting, bool) or not setting:  # no tracker named (mima.training.trackers.tracker_entries)
        return config
    copy = config.clone()
    copy["trainer.logger"] = None  # replaced by the run's loggers (FitRun.trainer_arguments)
    return copy
