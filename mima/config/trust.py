"""The trust boundary of a run config: what code a config may make `mima fit` import.

`mima fit` is a LightningCLI, and jsonargparse imports whatever a config names where a class or a
callable is expected (a `class_path:` of trainer.callbacks, trainer.logger, ..., or a dotted name given
to a callable argument) while it parses, before any check of mima's. A config from someone else (a run
folder's config.yaml, a file from a paper's repository) could so run any installed code. Before the
parser sees a config or a command line, every name in it that would import code must be one of
Lightning's callbacks, loggers and profilers below (by their short name or their full path), unless the
user trusts the config's code explicitly: `MIMA_TRUST_CODE=1` in the environment (never from the config
itself, which could otherwise grant itself the trust).

A "name that would import code" is a `class_path` value (short or dotted), or any string shaped like a dotted Python path
whose first part is an installed module (`os.system`, `tests.helpers.KillAtStep`); a folder named
`checkpoints.v2` is not one (no module `checkpoints`). Looking a module up (importlib.util.find_spec of the
first part) runs none of its code.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

from mima.core.errors import MimaError

TRUST_ENV = "MIMA_TRUST_CODE"

# Lightning's classes a config may name (LambdaCallback is left out: its arguments are callables).
ALLOWED_CLASSES: dict[str, tuple[str, ...]] = {
    "lightning.pytorch.callbacks": (
        "BackboneFinetuning", "BatchSizeFinder", "DeviceStatsMonitor", "EarlyStopping", "EMAWeightAveraging",
        "GradientAccumulationScheduler", "LearningRateMonitor", "ModelSummary", "RichModelSummary",
        "RichProgressBar", "SpikeDetection", "ThroughputMonitor", "Timer", "TQDMProgressBar",
    ),
    "lightning.pytorch.loggers": ("CSVLogger", "TensorBoardLogger", "WandbLogger", "MLFlowLogger", "CometLogger",
                                  "NeptuneLogger"),
    "lightning.pytorch.profilers": ("SimpleProfiler", "AdvancedProfiler", "PyTorchProfiler", "PassThroughProfiler"),
}
ALLOWED_NAMES = frozenset(
    name for module, classes in ALLOWED_CLASSES.items() for short in classes for name in (short, f"{module}.{short}"))
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
# options whose values are paths or names, never code (the folder or file a user names may hold dots)
NOT_CODE_OPTIONS = ("--config", "-c", "--out", "--ckpt_path")


def code_trusted(environment: Mapping[str, str] | None = None) -> bool:
    return (environment if environment is not None else os.environ).get(TRUST_ENV, "") not in ("", "0")


def check_config_code(config: Any, source: str) -> None:
    """Refuse, in one line naming `source` and the key, a name in `config` (a parsed YAML mapping) that
    would import code outside ALLOWED_CLASSES, unless the code is trusted (MIMA_TRUST_CODE=1)."""
    if code_trusted():
        return
    for where, name in code_names(config, ""):
        raise MimaError(f"{source}: {where or 'the config'}: {name!r} names code outside mima's list (Lightning's "
                        f"callbacks, loggers and profilers), which the config would import and run; if you trust this "
                        f"config's code, run with {TRUST_ENV}=1")


def check_argument_code(argv: list[str]) -> None:
    """The same for `mima fit`'s command line: each option's value (YAML or a plain word), except the
    values of --config, --out and --ckpt_path, which are paths."""
    if code_trusted():
        return
    for index, word in enumerate(argv):
        if word.startswith("-"):
            option, _, value = word.partition("=")
            if not value or option in NOT_CODE_OPTIONS:
                continue
        elif index > 0 and argv[index - 1].startswith("-") and "=" not in argv[index - 1]:
            option, value = argv[index - 1], word
            if option in NOT_CODE_OPTIONS:
                continue
        else:
            continue
        check_config_code(_value(value), option)


def code_names(value: Any, where: str) -> Iterator[tuple[str, str]]:
    """(key, name) of every name in `value` that would import code outside the list."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            inner = f"{where}.{key}" if where else str(key)
            if key == "class_path":
                if item not in ALLOWED_NAMES:  # a bare name too: jsonargparse may import it as a module ("this")
                    yield inner, str(item)
            else:
                yield from code_names(item, inner)
    elif isinstance(value, list | tuple):
        for position, item in enumerate(value):
            yield from code_names(item, f"{where}[{position}]")
    elif isinstance(value, str) and value not in ALLOWED_NAMES and imports_code(value):
        yield where, value


def imports_code(text: str) -> bool:
    """Whether `text` reads as a dotted Python path whose first part is an installed module."""
    if not DOTTED.fullmatch(text.strip()):
        return False
    try:
        return importlib.util.find_spec(text.strip().split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _value(text: str) -> Any:
    """A command-line value as jsonargparse would read it: YAML when it holds a mapping or a list."""
    if text.lstrip().startswith(("{", "[")) or "class_path" in text:
        from mima.core.bounded_yaml import bounded_yaml

        try:
            return bounded_yaml(text, "the command line")
        except MimaError:
            return text
    return text
