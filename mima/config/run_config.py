"""The one typed run configuration: what every command reads from a config file or a run folder.

The `model:` and `data:` options are two dataclasses, mima.config.model.ModelSettings and
mima.data.settings.DataSettings: their defaults are the only defaults. `mima fit` parses its config
with LightningCLI against MimaModule and TaskSuiteDataModule, which take exactly those fields
(mima.core.settings.takes_settings). Every other command (merge --config, evaluate, the sweeps and
the demo, each analysis, report) loads a config through `load_run_config`, which parses the same
two sections against the dataclasses with the same parser library, so it gets exactly the values
`mima fit` used, defaults included, and makes the same checks; it imports no Lightning and nothing
of the training layer. A run folder's config.yaml (written by `mima fit` with every value spelled
out) loads the same way.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentParser, Namespace

from mima.core.errors import MimaError
from mima.config.model import ModelSettings
from mima.config.parse_errors import config_error_text
from mima.config.source import check_config_source, check_run_values, config_mapping, read_config_file
from mima.core.run_folder import RunFolder
from mima.data.settings import DataSettings

SECTIONS = ("model", "data")


@dataclass(frozen=True)
class RunConfig:
    """The `model:` and `data:` sections of a run, every value checked against its type and every
    default filled in from ModelSettings and DataSettings."""

    model: Namespace
    data: Namespace
    seed: int = 0  # seed_everything
    source: str = "config"  # where it came from, for messages
    other: dict[str, Any] = field(default_factory=dict)  # trainer: and the fit options, as written

    def model_args(self) -> dict[str, Any]:
        return _plain(self.model)

    def data_args(self) -> dict[str, Any]:
        return _plain(self.data)

    def datamodule(self):
        """The data of the run's tasks (nothing is loaded until a task's splits are asked for): a
        TaskSuiteDataModule, imported here so that reading a config needs no Lightning."""
        from mima.data.datamodule import TaskSuiteDataModule

        return TaskSuiteDataModule(**self.data_args())

    def as_dict(self) -> dict[str, Any]:
        """A config dict that `mima fit` (run_fit) accepts and that reproduces this configuration."""
        return {**copy.deepcopy(self.other), "seed_everything": self.seed, "model": self.model_args(), "data": self.data_args()}


def _plain(value: Any) -> Any:
    if isinstance(value, Namespace):
        return {key: _plain(item) for key, item in value.as_dict().items()}
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if hasattr(value, "__dataclass_fields__"):
        return {name: _plain(getattr(value, name)) for name in value.__dataclass_fields__}
    return value


_PARSER: ArgumentParser | None = None


def _parser() -> ArgumentParser:
    """The model and data options: the fields LightningCLI offers for `mima fit`, from the same dataclasses."""
    global _PARSER
    if _PARSER is None:
        os.environ.setdefault("JSONARGPARSE_DEPRECATION_WARNINGS", "off")
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(ModelSettings, "model", fail_untyped=False, sub_configs=True)
        parser.add_class_arguments(DataSettings, "data", fail_untyped=False, sub_configs=True)
        _PARSER = parser
    return _PARSER


def load_run_config(source: str | os.PathLike | Mapping | RunFolder) -> RunConfig:
    """The run configuration of a config file, a run folder (its config.yaml) or a parsed dict."""
    if isinstance(source, Mapping):
        return parse_run_config(source, "config")
    folder = source if isinstance(source, RunFolder) else RunFolder(Path(source))
    if folder.path.is_dir():
        return parse_run_config(read_config_file(folder.config_file, str(folder.config_file)), str(folder.config_file))
    path = folder.path
    check_config_source(path)
    raw = read_config_file(path, f"--config {path}")
    return parse_run_config(raw, f"--config {path}")


def parse_run_config(raw: Mapping, source: str = "config") -> RunConfig:
    config_mapping(raw, source)  # each section a mapping
    check_run_values(raw)  # the numbers outside model: and data: (those the settings dataclasses check)
    sections = {name: dict(raw.get(name) or {}) for name in SECTIONS}
    try:
        parsed = _parser().parse_object(sections)
    except Exception as exc:  # jsonargparse's ArgumentError / ValueError: a user's config mistake
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, MimaError):
            raise cause from None
        raise MimaError(f"{source}: {config_error_text(exc)}") from None
    seed = raw.get("seed_everything", 0)
    if seed is True or seed is None:
        seed = 0
    other = {key: copy.deepcopy(value) for key, value in raw.items() if key not in (*SECTIONS, "seed_everything")}
    config = RunConfig(model=parsed.model, data=parsed.data, seed=int(seed), source=source, other=other)
    # the checks `mima fit` makes when it builds the module and the data (each names its option)
    ModelSettings(**config.model_args())
    DataSettings(**config.data_args())
    return config
