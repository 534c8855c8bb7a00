"""Settings dataclasses as constructor signatures.

A component whose options are a typed dataclass (mima.config.model.ModelSettings,
mima.data.settings.DataSettings) takes them as keyword arguments, so that LightningCLI and
jsonargparse, which read constructor signatures, offer exactly the dataclass's fields with its
types, defaults and documentation. The dataclass stays the one place where an option and its
default are written; `mima fit` and every command that reads a run config see the same.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from typing import TypeVar

Component = TypeVar("Component", bound=type)


def keyword_signature(settings: type) -> inspect.Signature:
    """`(self, *, field: type = default, ...)` for the fields of a settings dataclass, with the
    annotations resolved (a string annotation could not be resolved in the component's module)."""
    hints = typing.get_type_hints(settings)
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for field in dataclasses.fields(settings):
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = inspect.Parameter.empty
        parameters.append(
            inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=hints[field.name])
        )
    return inspect.Signature(parameters)


def takes_settings(settings: type) -> Callable[[Component], Component]:
    """Class decorator: the class's `__init__(self, **options)` is declared to take exactly the
    fields of `settings`, and the fields' documentation (the dataclass's "Args:" section) is
    appended to the class's docstring, where jsonargparse reads each option's help."""

    def adopt(component: Component) -> Component:
        component.__init__.__signature__ = keyword_signature(settings)
        args = (settings.__doc__ or "").split("Args:", 1)
        if len(args) == 2:
            component.__doc__ = f"{(component.__doc__ or '').rstrip()}\n\n    Args:{args[1]}"
        return component

    return adopt
