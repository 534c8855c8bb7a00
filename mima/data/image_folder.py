"""A user's own tasks, read from folders of images: the config entry (`FolderTask`), the folder's
layout, class names and templates, and the task's TaskSpec. What this module composes, shared with
the folder-based benchmark tasks (DTD, EuroSAT, RESISC45, SUN397 in `mima.data.clip_tasks`): the
image files listed and checked (mima.data.image_scan), the datasets and splits (mima.data.image_datasets).

A custom task is any folder of class sub-folders, named in a config:

    data:
      custom_tasks:
        - name: shapes
          path: /data/shapes
          classnames_file: null     # optional: one class name per line, in sorted folder order
          templates: null           # optional: prompt templates; default DEFAULT_TEMPLATES
          bad_images: error         # or skip: leave out (and count) files PIL cannot open

Two layouts are accepted:
  split layout   PATH/train/<class>/*.png  [+ PATH/val/<class>/...]  [+ PATH/test/<class>/...]
                 (used when PATH/train exists and PATH holds no folders besides train, val, test)
  flat layout    PATH/<class>/*.png
Classes are the sub-folders of PATH/train (split layout) or PATH (flat layout), in sorted order,
as torchvision's ImageFolder orders them; a class's name is its folder name with "_" read as a
space, unless `classnames_file` gives the names. Files are read recursively below each class folder.

Relative paths are read from the working directory.

Every image file is opened and verified (PIL's `verify`: the header, and for PNG every chunk's
checksum) when the config is read, before anything is written; an unreadable file stops the
command with its name, or with `bad_images: skip` is left out with a count. A file that passes
`verify` but fails to decode later (a truncated JPEG) still stops training with its name.
An image name on something that is not a regular file (a FIFO, device or socket, or a link to
one) stops the command naming it whatever `bad_images` says, before anything opens it; so does a
class folder whose name is not valid UTF-8 (shown as its bytes). (mima.data.image_scan)

Splits (fixed seeds, so every run and every merge sees the same images):
  test  PATH/test, or else a holdout of TEST_FRACTION of the training images;
  val   PATH/val, or else carved from the training images (what is left after the test holdout)
        by the task_vectors rule (`mima.data.splits.carve_validation`): torch's random_split with
        manual_seed(data.split_seed), validation the permutation's tail, 10% of the images, at
        most 5000. Indices are into the folder's listing: classes in sorted order, then files in
        sorted order below each (torchvision ImageFolder's order); `mima data splits` writes them.
Transforms: the training split goes through the model's training transform
(`LoadOptions.preprocess_train`, open_clip's RandomResizedCrop as task_vectors trains) when one is
given; validation and test always go through the evaluation transform (`LoadOptions.preprocess`),
also where validation is carved from the training images. (mima.data.image_datasets)
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mima.data.image_datasets import check_split_sizes, folder_splits
from mima.data.image_scan import class_folders, readable_samples, scan_split
from mima.data.listing import listing_fingerprint
from mima.data.tasks import LoadOptions, TaskData, TaskSpec, check_templates
from mima.core.errors import MimaError
from mima.core.run_folder import RESERVED_TASK_NAMES

DEFAULT_TEMPLATES = ("a photo of a {}.", "a photo of the {}.", "an image of a {}.")
SPLIT_FOLDERS = ("train", "val", "test")
TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
BAD_IMAGE_CHOICES = ("error", "skip")


@dataclass
class FolderTask:
    """A task read from a folder of class sub-folders (see the module docstring for the layouts).

    Args:
        name: the task's name in `data.tasks`, run folders and results (must not be a suite task's).
        path: the task's folder.
        classnames_file: a text file with one class name per line, in the sorted order of the class
            folders (default: the folder names, "_" read as a space).
        templates: prompt templates of the zero-shot head, each with one "{}" for the class name
            (default: DEFAULT_TEMPLATES).
        bad_images: "error" (default): a file PIL cannot open stops the command, naming it;
            "skip": such files are left out of the task, and their number is printed.
    """

    name: str
    path: str
    classnames_file: str | None = None
    templates: list[str] | None = None
    bad_images: str = "error"


def as_folder_task(value: FolderTask | Mapping, position: int = 0) -> FolderTask:
    """A FolderTask from itself or from a mapping (a config read as plain YAML)."""
    if isinstance(value, FolderTask):
        task = value
    elif isinstance(value, Mapping):
        allowed = set(FolderTask.__dataclass_fields__)
        extra = sorted(set(value) - allowed)
        if extra:
            raise MimaError(f"data.custom_tasks[{position}]: unknown key '{extra[0]}' (keys: {', '.join(sorted(allowed))})")
        if "name" not in value or "path" not in value:
            raise MimaError(f"data.custom_tasks[{position}]: needs 'name' and 'path'")
        task = FolderTask(**value)
    else:
        raise MimaError(f"data.custom_tasks[{position}]: expected a mapping with name and path, got {value!r}")
    if not TASK_NAME.fullmatch(str(task.name)):
        # the name becomes file names (final/<task>.safetensors, cached heads)
        raise MimaError(f"data.custom_tasks[{position}]: name {task.name!r} must be letters, digits and _ . + - (no spaces or '/')")
    if str(task.name).lower() in RESERVED_TASK_NAMES:
        raise MimaError(f"data.custom_tasks[{position}]: name {task.name!r} is reserved (the run folder and results use "
                        f"{', '.join(repr(name) for name in RESERVED_TASK_NAMES)}); give the task another name")
    if task.bad_images not in BAD_IMAGE_CHOICES:
        raise MimaError(f"data.custom_tasks '{task.name}': bad_images {task.bad_images!r} must be one of {', '.join(BAD_IMAGE_CHOICES)}")
    folder_templates(task)  # now, with the config: a bad template would otherwise stop training at the head
    return task


@dataclass(frozen=True)
class FolderLayout:
    """What was found in a custom task's folder: the class folders and the split folders."""

    classes: tuple[str, ...]
    train: Path
    val: Path | None
    test: Path | None


def read_layout(task: FolderTask) -> FolderLayout:
    """The layout of `task.path` (cheap: lists folders, reads no image)."""
    root = Path(task.path).expanduser()
    what = f"data.custom_tasks '{task.name}'"
    if not root.is_dir():
        raise MimaError(f"{what}: path {root} is not a folder (expected {root}/<class>/<images> or {root}/train/<class>/<images>)")
    subfolders = class_folders(root)
    split_layout = (root / "train").is_dir() and set(subfolders) <= set(SPLIT_FOLDERS)
    train = root / "train" if split_layout else root
    classes = tuple(class_folders(train))
    if len(classes) < 2:
        raise MimaError(f"{what}: {train} has {len(classes)} class folder(s); a task needs at least 2 (one sub-folder per class)")
    optional = {name: (root / name if split_layout and (root / name).is_dir() else None) for name in ("val", "test")}
    return FolderLayout(classes, train, optional["val"], optional["test"])


def read_classnames(task: FolderTask, classes: Sequence[str]) -> tuple[str, ...]:
    """Class names from `task.classnames_file` (one a line, sorted folder order) or the folder names."""
    if task.classnames_file is None:
        return tuple(name.replace("_", " ") for name in classes)
    path = Path(task.classnames_file).expanduser()
    if not path.is_file():  # is_file is a stat: a FIFO here is refused, never opened
        problem = "not a regular file" if path.exists() else "no such file"
        raise MimaError(f"data.custom_tasks '{task.name}': classnames_file {path}: {problem}")
    names = tuple(line.strip() for line in path.read_text().splitlines() if line.strip())
    if len(names) != len(classes):
        raise MimaError(
            f"data.custom_tasks '{task.name}': classnames_file {path} has {len(names)} names but {task.path} has "
            f"{len(classes)} class folders (one name per line, in sorted folder order: {', '.join(classes[:3])}, ...)"
        )
    return names


def folder_templates(task: FolderTask) -> tuple[str, ...]:
    """The task's prompt templates (default DEFAULT_TEMPLATES), checked (`mima.data.tasks.check_templates`)."""
    templates = task.templates if task.templates is not None else DEFAULT_TEMPLATES
    return check_templates(templates, f"data.custom_tasks '{task.name}'")


def folder_task_spec(task: FolderTask) -> TaskSpec:
    """The TaskSpec of a custom task. Class folders and names are read now (heads are built before
    any image is loaded); the images are listed when the task's data is loaded."""
    layout = read_layout(task)
    classnames = read_classnames(task, layout.classes)
    templates = folder_templates(task)
    # Listed and checked now, with the config, so that a folder without (readable) images, or with
    # too few for the splits, stops `mima fit` before it has built a model or written a run folder
    # (not at the first batch); the listing is then reused.
    what = f"data.custom_tasks '{task.name}'"
    samples = {split: readable_samples(pairs, f"{what} ({split})", skip_bad=task.bad_images == "skip")
               for split, pairs in scan_splits(task, layout).items()}
    check_split_sizes(samples, what, layout.train)

    def load(options: LoadOptions) -> TaskData:
        return folder_splits(samples, options, f"task '{task.name}'", layout.train)

    listing = {split: listing_fingerprint(pairs, Path(task.path).expanduser()) for split, pairs in samples.items()}
    return TaskSpec(name=task.name, classnames=classnames, templates=templates, load=load, listing=listing)


def scan_splits(task: FolderTask, layout: FolderLayout) -> dict[str, list[tuple[str, int]]]:
    """(file, label) pairs of each split folder the task has (train, and test and val if present)."""
    index = {name: i for i, name in enumerate(layout.classes)}
    folders = {"train": layout.train, "test": layout.test, "val": layout.val}
    return {split: scan_split(folder, index, f"task '{task.name}' ({split})") for split, folder in folders.items()
            if folder is not None}
