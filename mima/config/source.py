"""Where a run config comes from, checked before anything heavy is imported: the file itself (its size,
its encoding, YAML read with a bound on what its aliases expand to: mima.core.bounded_yaml), the shape of its sections and the
numbers outside `model:` and `data:` (seed_everything, trainer:, fit's options), which the settings
dataclasses do not hold. `mima fit` checks its --config files here before Lightning is imported, and
every command that loads a run config (mima.config.run_config, `mima plan`) reads it here."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mima.config.fit_options import RUN_OPTIONS
from mima.core.bounded_yaml import bounded_yaml, read_bounded_yaml
from mima.core.errors import MimaError
from mima.core.settings import check_section

__all__ = ["bounded_yaml", "check_config_source", "check_run_values", "check_trainer_options", "config_mapping",
           "read_config_file"]

SECTIONS = ("model", "data", "trainer")
DIGITS = re.compile(r"\s*[+-]?\d+\s*")


def check_config_source(path: Path) -> None:
    """Refuse, in one line, a --config that is neither a config file nor a run folder."""
    if not path.is_file() and not path.is_dir():
        raise MimaError(f"--config {path}: no such file or run folder")


def read_config_file(path: Path, name: str) -> dict:
    """A YAML run config as a plain mapping; every way it can be unreadable, too large or not shaped
    like a run config is one line naming `name`."""
    return config_mapping(read_bounded_yaml(path, name), name)


def config_mapping(loaded: Any, name: str) -> Mapping:
    """`loaded` as a run config: a mapping whose model:, data: and trainer: sections are mappings (or empty)."""
    if loaded is None:
        return {}
    if not isinstance(loaded, Mapping):
        raise MimaError(f"{name}: expected a mapping with model:, data:, trainer: sections, got {type(loaded).__name__}")
    for section in SECTIONS:
        value = loaded.get(section)
        if value is not None and not isinstance(value, Mapping):
            raise MimaError(f"{name}: '{section}:' must be a mapping of options, got {type(value).__name__} {_shown(value)}")
    return loaded


def check_run_values(config: Mapping[str, Any]) -> None:
    """The numbers of a run config outside model: and data: against their ranges
    (mima.config.fit_options): seed_everything, --collective_timeout, --threads_per_process and the
    trainer's devices, num_nodes and accumulate_grad_batches. `seed_everything: true` is Lightning's
    "choose a seed"; trainer.devices may also be "auto" or a list of device indices."""
    top = {key: value for key, value in config.items() if not (key == "seed_everything" and isinstance(value, bool))}
    check_section(RUN_OPTIONS, "", top)
    trainer = config.get("trainer") or {}
    if not isinstance(trainer, Mapping):
        return  # named by config_mapping
    devices = trainer.get("devices")
    if (isinstance(devices, int) and not isinstance(devices, bool)) or (isinstance(devices, str) and DIGITS.fullmatch(devices)):
        check_section(RUN_OPTIONS, "trainer", {"devices": devices})
    check_section(RUN_OPTIONS, "trainer", {key: value for key, value in trainer.items() if key != "devices"})
    check_trainer_options(trainer)


# Trainer options that would end `trainer.fit` before the plan's last step (so without final models) and
# the values that leave the run whole. mima sets the run length from model.steps and model.iterations.
RUN_LENGTH_OPTIONS: dict[str, tuple[Any, ...]] = {
    "max_steps": (None, -1),
    "max_epochs": (None,),
    "max_time": (None,),
    "min_steps": (None,),
    "limit_train_batches": (None, 1.0),  # an int is a number of batches, a float a fraction of them
    "fast_dev_run": (None, False, 0),
    "overfit_batches": (None, 0, 0.0),
}


def check_trainer_options(trainer: Mapping[str, Any]) -> None:
    """Refuse, in one line, a trainer option that would cut the run short of its plan (a run that ends
    early would say it finished without writing final/), or that would mix the tasks' BatchNorm statistics."""
    for key, whole in RUN_LENGTH_OPTIONS.items():
        value = trainer.get(key)
        if not any(value is neutral or (type(value) is type(neutral) and value == neutral) for neutral in whole):
            raise MimaError(f"trainer.{key}={_shown(value)}: would end the run before its plan; the run length is "
                            "set by model.steps and model.iterations, leave it unset")
    if trainer.get("sync_batchnorm"):
        raise MimaError("trainer.sync_batchnorm: would average BatchNorm statistics across tasks; leave it off")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
