"""YAML config files read with bounds: at most MAX_CONFIG_BYTES, UTF-8, and YAML whose aliases
expand to at most MAX_CONFIG_NODES nodes, so that a hostile file (a "billion laughs" alias bomb, a
binary file, a huge file) is refused in one line in milliseconds. Every reader of a config file uses
it: `mima fit`'s --config (before Lightning is imported), mima.config.source, a run folder's config.yaml."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from mima.core.errors import MimaError

# A run config is a few kilobytes (a long custom_tasks list: tens); more is not a config.
MAX_CONFIG_BYTES = 2**20
# YAML nodes after alias expansion: a "billion laughs" file of a few hundred bytes expands to 10^9 nodes,
# which every later walk (the parser's, a deep copy, a dump) would visit; a config has a few hundred.
MAX_CONFIG_NODES = 100_000


def read_bounded_yaml(path: Path, name: str) -> Any:
    """The YAML document of the config file `path` (a run's config.yaml, a --config): too large, unreadable,
    not UTF-8 or an alias bomb is one line naming `name`."""
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
    return bounded_yaml(text, name)


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
