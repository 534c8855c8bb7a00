"""Where a run config comes from, checked before anything heavy is imported: the file itself (its size,
its encoding, YAML read with a bound on what its aliases expand to), the shape of its sections and the
numbers outside `model:` and `data:` (seed_everything, trainer:, fit's options), which the settings
dataclasses do not hold. `mima fit` checks its --config files here before Lightning is imported, and
every command that loads a run config (mima.config.run_config, `mima plan`) reads it here."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from mima.core.errors import MimaError
from mima.core.settings import check_section, check_value

# A run config is a few kilobytes (a long custom_tasks list: tens); more is not a config.
MAX_CONFIG_BYTES = 2**20
# YAML nodes after alias expansion: a "billion laughs" file of a few hundred bytes expands to 10^9 nodes,
# which every later walk (the parser's, a deep copy, a dump) would visit; a config has a few hundred.
MAX_CONFIG_NODES = 100_000
SECTIONS = ("model", "data", "trainer")
DIGITS = re.compile(r"\s*[+-]?\d+\s*")


def check_config_source(path: Path) -> None:
    """Refuse, in one line, a --config that is neither a config file nor a run folder."""
    if not path.is_file() and not path.is_dir():
        raise MimaError(f"--config {path}: no such file or run folder")


def read_config_file(path: Path, name: str) -> dict:
    """A YAML run config as a plain mapping; every way it can be unreadable or too large is one line naming `name`."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise MimaError(f"{name}: not a run config ({size} bytes; a run config is at most {MAX_CONFIG_BYTES} bytes)")
        data = path.read_bytes()[: MAX_CONFIG_BYTES + 1]  # a file that grew since
    except OSError as exc:
        raise MimaError(f"{name}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise MimaError(f"{name}: not a run config (more than {MAX_CONFIG_BYTES} bytes; a run config is at most "
                        f"{MAX_CONFIG_BYTES} bytes)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MimaError(f"{name}: not valid YAML (not a text file): byte 0x{data[exc.start]:02x} at offset {exc.start} "
                        "is not UTF-8; expected a YAML file in UTF-8") from None
    return config_mapping(bounded_yaml(text, name), name)


def bounded_yaml(text: str, name: str) -> Any:
    """YAML's safe loader with the expanded size bounded: the node graph is composed (aliases are
    references to one node), its size with every alias expanded counted without expanding it, and only
    then is it turned into Python values."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        nodes = expanded_nodes(node, {})
        if nodes > MAX_CONFIG_NODES:
            raise MimaError(f"{name}: its aliases expand to {nodes} YAML nodes; a run config has at most "
                            f"{MAX_CONFIG_NODES} (is it a YAML alias bomb?)")
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise MimaError(f"{name}: not valid YAML ({str(exc).splitlines()[0]})") from None
    except RecursionError:
        raise MimaError(f"{name}: YAML nested too deeply for a run config") from None
    finally:
        loader.dispose()


def expanded_nodes(node: yaml.Node, sizes: dict[int, int]) -> int:
    """The number of nodes `node` stands for with every alias expanded (each shared node counted once per
    use, computed once: `sizes` by node id)."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    sizes[id(node)] = MAX_CONFIG_NODES + 1  # a node that contains itself expands without end
    if isinstance(node, yaml.MappingNode):
        total = 1 + sum(expanded_nodes(key, sizes) + expanded_nodes(value, sizes) for key, value in node.value)
    elif isinstance(node, yaml.SequenceNode):
        total = 1 + sum(expanded_nodes(item, sizes) for item in node.value)
    else:
        total = 1
    sizes[id(node)] = total
    return total


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
    (mima.core.settings.VALUE_RANGES): seed_everything, --collective_timeout, --threads_per_process and the
    trainer's devices, num_nodes and accumulate_grad_batches. `seed_everything: true` is Lightning's
    "choose a seed"; trainer.devices may also be "auto" or a list of device indices."""
    top = {key: value for key, value in config.items() if not (key == "seed_everything" and isinstance(value, bool))}
    check_section("", top)
    trainer = config.get("trainer") or {}
    if not isinstance(trainer, Mapping):
        return  # named by config_mapping
    devices = trainer.get("devices")
    if (isinstance(devices, int) and not isinstance(devices, bool)) or (isinstance(devices, str) and DIGITS.fullmatch(devices)):
        check_value("trainer.devices", devices)
    check_section("trainer", {key: value for key, value in trainer.items() if key != "devices"})


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
