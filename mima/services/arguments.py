"""What the Python API (mima.api) is given, checked before anything runs, so that a mistake is one
MimaError line as a command's is: a value of the wrong type (a number or bytes for a path, a list
for one path, a string for a switch), a state dict that is not one (keys that are not names,
values that are not tensors, no tensors at all, no floating-point weights, a dtype no merge reads,
a key or shape that differs between models) and a config mapping that YAML cannot hold.

The command line gives only words, so these have no command counterpart, except where the command
checks the same thing: models whose keys, shapes or dtypes differ are refused in the words `mima
merge` uses for files (mima.core.state_dicts.check_compatible, the label `models[i]` or `base` for
a state dict in memory), and a dtype no merge reads in the words of the file reader
(mima.core.tensor_files.unreadable_dtype). Values the command reads as words (a method, a device,
a choice) are handed on as their text and refused by the service as the command refuses the word.
Imports nothing heavy until a state dict is checked."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mima.core.errors import MimaError

if TYPE_CHECKING:
    import torch

PATH = "a path (str or os.PathLike)"
SHOWN_CHARACTERS = 60  # how much of a refused value a line shows


def shown(value: object) -> str:
    """A refused value in a message: its type and a short repr."""
    text = repr(value)
    text = text if len(text) <= SHOWN_CHARACTERS else text[:SHOWN_CHARACTERS - 3] + "..."
    return f"{type(value).__name__} {text}"


def refused(name: str, expected: str, value: object) -> MimaError:
    return MimaError(f"{name}: expected {expected}, got {shown(value)}")


# ------------------------------------------------------------------------------------ plain values
def is_path(value: object) -> bool:
    """A str, or an os.PathLike whose path is a str (bytes paths are refused: mima names files as text)."""
    if isinstance(value, str):
        return True
    return isinstance(value, os.PathLike) and isinstance(os.fspath(value), str)


def path_of(name: str, value: object) -> Path:
    if not is_path(value) or str(value) == "":
        raise refused(name, PATH, value)
    return Path(value)


def optional_path_of(name: str, value: object) -> Path | None:
    return None if value is None else path_of(name, value)


def paths_of(name: str, value: object) -> list[Path]:
    """One path, or a list (any sequence but a string) of them."""
    if is_path(value):
        return [path_of(name, value)]
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise refused(name, f"{PATH} or a list of them", value)
    return [path_of(f"{name}[{index}]", item) for index, item in enumerate(value)]


def switch_of(name: str, value: object) -> bool:
    """True or False, nothing else: a string such as "no" would otherwise switch it on."""
    if not isinstance(value, bool):
        raise refused(name, "True or False", value)
    return value


def names_of(name: str, value: object) -> list[str] | None:
    """A list of names (a method's, ...), None for the default; a lone string is not a list of them."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(item, str) for item in value):
        raise refused(name, "a list of names, e.g. ['ties']", value)
    return list(value)


def text_of(value: object) -> str:
    """A value the command reads as a word (a method, a device), as its text: refused, if it is not
    one, in the command's words for that word."""
    return value if isinstance(value, str) else str(value)


# ------------------------------------------------------------------------------------- config mappings
YAML_SCALARS = (type(None), bool, int, float, str)


def check_yaml_values(value: object, where: str) -> None:
    """A config given as a mapping holds what a YAML config file can: numbers, strings, booleans,
    null, lists and mappings with string keys; anything else is one line naming its key."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise MimaError(f"{where}: key {key!r} is not a string (a config's keys are names)")
            check_yaml_values(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_yaml_values(item, f"{where}[{index}]")
    elif not isinstance(value, YAML_SCALARS):
        raise MimaError(f"{where}: {shown(value)} is no value a YAML config can hold (numbers, strings, booleans, "
                        "null, lists and mappings)")


def config_of(name: str, value: object) -> Path | Mapping[str, Any]:
    """A config file's (or run folder's) path, or a config mapping that YAML can hold."""
    if isinstance(value, Mapping):
        check_yaml_values(value, name)
        return value
    if not is_path(value):
        raise refused(name, f"{PATH} of a config file or run folder, or a config mapping", value)
    return path_of(name, value)


# ------------------------------------------------------------------------------------- state dicts
def merge_inputs_of(models: object, base: object) -> tuple[list[Path | Mapping], Path | Mapping | None]:
    """mima.merge's `models` (one path, or a list of paths and state dicts) and `base` (a path, a
    state dict or None), each of a type the merge takes."""
    if is_path(models):
        listed: list = [path_of("models", models)]
    elif isinstance(models, Sequence) and not isinstance(models, (str, bytes)):
        listed = [model_of(f"models[{index}]", item) for index, item in enumerate(models)]
        if not listed:
            raise refused("models", "at least one model (a path or a state dict)", models)
    else:
        raise refused("models", f"{PATH}, or a list of paths and state dicts", models)
    return listed, None if base is None else model_of("base", base)


def model_of(name: str, value: object) -> Path | Mapping:
    if isinstance(value, Mapping):
        return value
    if not is_path(value):
        raise refused(name, f"{PATH} of a safetensors file, or a state dict", value)
    return path_of(name, value)


def checked_state_dicts(models: Sequence[Mapping], base: Mapping | None) -> None:
    """Models (and base) given as state dicts, checked as `mima merge` checks its files: each a
    mapping of names to tensors of a dtype a merge reads; then the same keys, shapes and dtypes in
    each (the command's words, each named models[i] or base); then weights to merge."""
    from mima.core.state_dicts import check_compatible, check_weights

    named = {f"models[{index}]": model for index, model in enumerate(models)}
    named = {"base": base, **named} if base is not None else named
    for label, state in named.items():
        check_state_dict(label, state)
    check_compatible(named)
    check_weights(named)


def check_state_dict(label: str, state: Mapping) -> None:
    """One state dict: names to tensors, each of a dtype the merges read (as a file's are)."""
    import torch

    from mima.core.tensor_files import DTYPES, unreadable_dtype

    for key, tensor in state.items():
        if not isinstance(key, str):
            raise MimaError(f"{label}: key {shown(key)} is not a tensor's name (a state dict's keys are strings)")
        if not isinstance(tensor, torch.Tensor):
            raise MimaError(f"{label}: '{key}' holds {shown(tensor)}, not a tensor")
        if tensor.dtype not in DTYPES.values():
            readable = [dtype_name(dtype) for dtype in DTYPES.values()]
            raise unreadable_dtype(label, key, dtype_name(tensor.dtype), readable)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
