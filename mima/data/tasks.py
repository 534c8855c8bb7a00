"""What a task is: class names and prompt templates (for its zero-shot head) plus its data splits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from string import Formatter

from torch.utils.data import Dataset

from mima.core.errors import MimaError


@dataclass(frozen=True)
class TaskData:
    """The three splits of a task. `val` is carved from the training set; `test` is never used for selection."""

    train: Dataset
    val: Dataset
    test: Dataset


@dataclass(frozen=True)
class LoadOptions:
    """What a loader may need: a data root (datasets on disk), the model's input size, its image
    transforms, the split seed, and whether torchvision may download a missing dataset.

    `preprocess` is the evaluation transform (PIL image -> normalised tensor, open_clip's
    deterministic resize + centre crop): validation, test, and anything fitted or scored on clean
    images. `preprocess_train` is the training transform (open_clip's RandomResizedCrop, as
    task_vectors trains); None means the training split goes through `preprocess` as well. Loaders
    of PIL images (the `clip` suite, custom image-folder tasks) apply it to the training split only;
    validation (carved from the training images) and test always use `preprocess`. The tensor
    `digits` suite and the `offline` suite ignore it (no augmentation; their docstrings say why)."""

    root: str | None = None
    image_size: int = 224
    split_seed: int = 0
    preprocess: Callable | None = None
    download: bool = False
    preprocess_train: Callable | None = None


@dataclass(frozen=True)
class TaskSpec:
    name: str
    classnames: tuple[str, ...]
    templates: tuple[str, ...]
    load: Callable[[LoadOptions], TaskData]
    # a task read from a folder the user can change: each split folder's listing fingerprint
    # (mima.data.listing), recorded in the run folder so that a resume or an evaluation sees a change
    listing: dict[str, dict] | None = None

    @property
    def num_classes(self) -> int:
        return len(self.classnames)


# A stand-in class name: templates are checked when the config is read, before class names are known.
PROBE_CLASSNAME = "classname"


def check_templates(templates: object, what: str) -> tuple[str, ...]:
    """`templates` as a tuple, each checked as zero-shot heads use it (mima.models.heads formats
    `template.format(classname)`: one positional argument), so that a bad one stops the command with
    one line naming `what` and the template when the config is read, not inside training.

    Each must hold one plain "{}" (no name, index, conversion or format spec); other braces are
    written doubled ("{{", "}}")."""
    if isinstance(templates, (str, bytes)) or not isinstance(templates, (list, tuple)):
        raise MimaError(f"{what}: templates must be a list of strings, each with '{{}}' once, got {templates!r}")
    if not templates:
        raise MimaError(f"{what}: templates is empty")
    for template in templates:
        problem = template_problem(template)
        if problem is not None:
            raise MimaError(f"{what}: template {template!r} {problem}; write '{{}}' once where the class name goes "
                            "(e.g. 'a photo of a {}.'), and any other brace doubled ('{{' or '}}')")
    return tuple(templates)


def template_problem(template: object) -> str | None:
    """Why `template` cannot be a prompt template (None when it can)."""
    if not isinstance(template, str):
        return "is not a string"
    try:
        template.format(PROBE_CLASSNAME)  # what the head does: anything but positional field 0 fails here
        fields = [(name, spec, conversion) for _, name, spec, conversion in Formatter().parse(template) if name is not None]
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
        return f"cannot be filled with a class name ({type(exc).__name__}: {exc})"
    if fields != [("", "", None)]:
        written = ", ".join("{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
                            for name, spec, conversion in fields)
        return f"has {len(fields)} replacement fields ({written or 'none'}) where one plain '{{}}' is needed"
    return None
