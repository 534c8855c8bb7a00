"""A run config as mima.fit is given it (a config file or a mapping, keyword overrides, `out`): checked
as `mima fit` checks its --config values before Lightning is imported, and handed on as layers that
the program merges as the command merges successive --config files (mima.services.fit.program)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mima.config.source import check_run_values, config_mapping, read_config_file
from mima.config.trust import check_config_code
from mima.core.errors import MimaError
from mima.services.arguments import check_yaml_values, config_of, optional_path_of

NO_CONFIG_FILE = "cli"  # what --out's {config} becomes when no config file names the run
ONE_DEVICE = {"trainer": {"devices": 1, "num_nodes": 1}}  # mima.fit: one process, on one device


@dataclass(frozen=True)
class ConfigLayers:
    """A run config given as a config file (None: none) and mappings over it, merged as `mima fit
    --config FILE --config MAPPING ...` merges them (a section's keys into the section, a class's
    init_args into its init_args; any other value replaced)."""

    file: Path | None
    mappings: tuple[Mapping[str, Any], ...]


def check_config(raw: Mapping[str, Any], source: str) -> None:
    """A config (or a part of one) refused in one line naming `source`: a number outside its range
    (mima.config.source), a name of code outside mima's list (before jsonargparse imports it)."""
    check_run_values(raw)
    check_config_code(raw, source)


def check_config_file(path: Path, source: str) -> None:
    """A config file that does not exist, or that cannot be a run config (too large, not UTF-8, YAML
    whose aliases expand beyond a config's size, a section that is not a mapping, a number outside its
    range, code outside mima's list), refused in one line naming `source`; a folder is left to the
    parser, which names it."""
    if not path.exists():
        raise MimaError(f"{source}: no such file")
    if path.is_file():
        check_config(read_config_file(path, source), source)


def one_device_layers(config: str | os.PathLike | Mapping[str, Any], overrides: Mapping[str, Any],
                      out: str | os.PathLike | None) -> tuple[ConfigLayers, str]:
    """`config`, then `overrides`, then one process on one device, then `out`, each checked; and the
    name --out's {config} takes (the config file's, without its extension)."""
    config, out = config_of("config", config), optional_path_of("out", out)  # a path or a mapping YAML holds
    if isinstance(config, Mapping):
        file, name, mappings = None, NO_CONFIG_FILE, [checked_mapping(config, "config")]
    else:
        file, name, mappings = Path(config), Path(config).stem, []
        check_config_file(file, f"--config {config}")
        if not file.is_file():  # a folder: refused in the words the command's parser uses for it
            raise MimaError(f'config: Parser key "config": Path is not a file: {os.path.abspath(file)!r}')
    if overrides:
        mappings.append(checked_mapping(overrides, "overrides"))
    mappings.append(ONE_DEVICE)
    if out is not None:
        mappings.append({"out": str(out)})
    return ConfigLayers(file, tuple(mappings)), name


def checked_mapping(given: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    """A config mapping given in Python, shaped and checked as a config file's contents."""
    raw = config_mapping(dict(given), source)
    check_yaml_values(raw, source)  # what the run's config.yaml will hold
    check_config(raw, source)
    return raw
