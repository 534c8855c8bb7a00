"""Tasks read from folders of images: a user's own tasks, and the shared code of the folder-based
benchmark tasks (DTD, EuroSAT, RESISC45, SUN397 in `mima.data.clip_tasks`).

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
class folder whose name is not valid UTF-8 (shown as its bytes).

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
also where validation is carved from the training images.
"""

from __future__ import annotations

import copy
import os
import re
import stat
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from PIL import Image
from torch.utils.data import Dataset, Subset

from mima.data.listing import listing_fingerprint
from mima.data.splits import carve_validation, holdout_split, validation_size
from mima.data.tasks import LoadOptions, TaskData, TaskSpec, check_templates
from mima.core.errors import MimaError
from mima.core.run_folder import RESERVED_TASK_NAMES

from mima.core.names import IMAGE_EXTENSIONS  # the files read as images (mima.data.prepare extracts the same)
DEFAULT_TEMPLATES = ("a photo of a {}.", "a photo of the {}.", "an image of a {}.")
SPLIT_FOLDERS = ("train", "val", "test")
TEST_FRACTION = 0.2
TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
TEST_SPLIT_SEED = 20240607  # + split_seed: the holdout moves with the split seed, as the digits suite does
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


# ------------------------------------------------------------------------- shared image reading
class ImageFiles(Dataset):
    """(image, label) pairs from image files: read with PIL, made RGB, then `transform`."""

    def __init__(self, samples: Sequence[tuple[str, int]], transform: Callable) -> None:
        self.samples = list(samples)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        try:
            with Image.open(path) as image:
                rgb = image.convert("RGB")  # decodes the whole file: a damaged one fails here
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            raise MimaError(f"{path}: not a readable image ({type(exc).__name__}: {exc}); remove or replace it") from None
        return self.transform(rgb), label


def rgb_transform(options: LoadOptions, train: bool = False) -> Callable:
    """The model's preprocessing after a conversion to RGB (grayscale datasets such as MNIST give
    one-channel images; CLIP towers want three): the evaluation transform, or with `train` the
    training transform where the options carry one. Without a model transform (loader tests),
    images are resized and centre-cropped to `options.image_size`, as tensors in [0, 1]."""
    from torchvision import transforms

    chosen = options.preprocess_train if train and options.preprocess_train is not None else options.preprocess
    preprocess = chosen or transforms.Compose(
        [transforms.Resize(options.image_size), transforms.CenterCrop(options.image_size), transforms.ToTensor()]
    )
    return transforms.Compose([_to_rgb, preprocess])


def with_training_transform(train: Dataset, options: LoadOptions) -> Dataset:
    """The training split read through the model's training transform (`options.preprocess_train`),
    or `train` itself when the options carry none. Nothing is read again: the result views the same
    files or arrays with the other transform, so a validation split carved from the same images
    (a Subset of the original) keeps the evaluation transform."""
    if options.preprocess_train is None:
        return train
    return retransformed(train, rgb_transform(options, train=True))


def retransformed(dataset: Dataset, transform: Callable) -> Dataset:
    """`dataset` with its image transform replaced: ImageFiles, torchvision datasets (a shallow copy
    sharing their arrays) and Subsets of either."""
    from torchvision.datasets import VisionDataset
    from torchvision.datasets.vision import StandardTransform

    if isinstance(dataset, Subset):
        return Subset(retransformed(dataset.dataset, transform), dataset.indices)
    if isinstance(dataset, ImageFiles):
        return ImageFiles(dataset.samples, transform)
    if isinstance(dataset, VisionDataset):
        other = copy.copy(dataset)
        other.transform = transform  # most torchvision datasets apply .transform, a few .transforms
        other.transforms = StandardTransform(transform, dataset.target_transform)
        return other
    raise TypeError(f"cannot replace the image transform of a {type(dataset).__name__}")


def _to_rgb(image: Image.Image) -> Image.Image:
    return image if image.mode == "RGB" else image.convert("RGB")


def class_folders(folder: Path) -> list[str]:
    """The sub-folder names of `folder`, sorted (torchvision ImageFolder's class order).

    A name that is not valid UTF-8 stops the command, shown as its bytes: it would become a class
    name (prompt text, JSON, hashes), which must be text."""
    names = sorted(entry.name for entry in os.scandir(folder) if entry.is_dir() and not entry.name.startswith("."))
    for name in names:
        if not name.isascii():
            try:
                name.encode("utf-8")  # os.scandir keeps undecodable bytes as lone surrogates, which do not encode
            except UnicodeEncodeError:
                raise MimaError(f"{folder}: folder name {escaped_name(name)} is not valid UTF-8; rename it") from None
    return names


def escaped_name(name: str) -> str:
    """A file name as its bytes with backslash escapes (b'caf\\xe9'), printable whatever its encoding."""
    return repr(os.fsencode(name))


def image_files(folder: Path) -> list[str]:
    """Every image file below `folder` (recursively, following links), in torchvision ImageFolder's
    order (folders sorted by path, files sorted by name), so that split indices are ImageFolder's.

    Each folder is walked once: a link back to a folder already walked (a loop such as `loop -> .`, or
    a second link to the same folder) is not followed again (of two paths to one folder, the first in
    sorted order is walked). An image name on something that is not a regular file (a FIFO, device or
    socket, or a link to one) stops the command naming it, before anything opens it: opening a FIFO
    waits forever for a writer. A broken link stays listed (opening it fails with its name, as for any
    unreadable file)."""
    walked: set[tuple[int, int]] = set()
    listing = []
    for directory, subfolders, files in os.walk(folder, followlinks=True):
        identity = _identity(directory)
        if identity in walked:
            subfolders[:] = []  # a folder reached again through a link: already listed
            continue
        walked.add(identity)
        subfolders.sort()  # sorted descent: which of two paths to one folder is walked does not depend on the disk
        listing.append((directory, sorted(name for name in files if name.lower().endswith(IMAGE_EXTENSIONS))))
    found = [os.path.join(directory, name) for directory, names in sorted(listing) for name in names]
    for path in found:
        refuse_special_file(path)
    return found


def _identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of what `path` leads to (links followed); None for a broken link."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def refuse_special_file(path: str) -> None:
    """A one-line error when `path` (links followed) exists but is not a regular file."""
    try:
        mode = os.stat(path).st_mode  # stat, not open: it never blocks on a FIFO
    except OSError:
        return
    if not stat.S_ISREG(mode):
        kinds = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                 (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"))
        kind = next((word for test, word in kinds if test(mode)), "not a regular file")
        link = " (through a symbolic link)" if os.path.islink(path) else ""
        raise MimaError(f"{path}: is {kind}{link}, not an image file; remove it from the data folder")


def without_repeats(samples: list[tuple[str, int]], what: str, class_names: Sequence[str]) -> list[tuple[str, int]]:
    """`samples` with each image file counted once: a path that leads to a file listed before (a link, a
    hard link) is left out and counted in one line on stderr; one file under two classes is an error
    (which label would it have?)."""
    first: dict[tuple[int, int], tuple[str, int]] = {}
    kept, repeats = [], []
    for path, label in samples:
        identity = _identity(path)
        if identity is None:  # a broken link: its reader names it
            kept.append((path, label))
            continue
        earlier = first.setdefault(identity, (path, label))
        if earlier == (path, label):
            kept.append((path, label))
        elif earlier[1] != label:
            raise MimaError(f"{what}: {path} (class '{class_names[label]}') is the same file as {earlier[0]} (class "
                            f"'{class_names[earlier[1]]}'); an image has one class: remove one of them")
        else:
            repeats.append((path, earlier[0]))
    if repeats:
        print(f"{what}: {len(repeats)} paths lead to image files already listed (links or hard links) and are counted "
              f"once (first: {repeats[0][0]} is {repeats[0][1]})", file=sys.stderr)
    return kept


def scan_split(
    folder: Path,
    class_to_index: Mapping[str, int],
    what: str,
    require_all: bool = False,
    keep: Callable[[str], bool] | None = None,
) -> list[tuple[str, int]]:
    """(file, label) pairs of a folder of class sub-folders whose labels come from `class_to_index`.

    A sub-folder that is not a known class is an error (labels would silently shift otherwise);
    with `require_all` every class must have a folder. `keep` filters files by path. `what` names
    the task and split in messages."""
    if not folder.is_dir():
        raise MimaError(f"{what}: {folder} is not a folder")
    present = class_folders(folder)
    unknown = [name for name in present if name not in class_to_index]
    if unknown:
        raise MimaError(f"{what}: folder '{unknown[0]}' in {folder} is not one of the task's {len(class_to_index)} classes")
    if require_all and len(present) < len(class_to_index):
        absent = [name for name in class_to_index if name not in present]
        raise MimaError(f"{what}: {folder} lacks {len(absent)} of the {len(class_to_index)} class folders (e.g. '{absent[0]}')")
    samples = []
    for name in present:
        files = image_files(folder / name)
        samples += [(path, class_to_index[name]) for path in files if keep is None or keep(path)]
    samples = without_repeats(samples, what, sorted(class_to_index, key=class_to_index.get))
    if not samples:
        raise MimaError(f"{what}: no image files ({', '.join(IMAGE_EXTENSIONS[:3])}, ...) below {folder}")
    return samples


def with_validation(train: Dataset, val: Dataset | None, split_seed: int) -> tuple[Dataset, Dataset]:
    """(train, val): the given validation split, or else one carved from `train` by the task_vectors
    rule (`carve_validation`: random_split with manual_seed(split_seed); validation is the
    permutation's tail, 10% of the training set, at most 5000 examples; both in permutation order)."""
    if val is not None:
        return train, val
    train_idx, val_idx = carve_validation(len(train), split_seed)
    return Subset(train, train_idx.tolist()), Subset(train, val_idx.tolist())


# ------------------------------------------------------------------------------- custom tasks
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
    samples = {split: readable_samples(task, split, pairs) for split, pairs in scan_splits(task, layout).items()}
    check_split_sizes(task, layout, samples)

    def load(options: LoadOptions) -> TaskData:
        return load_folder_task(task, layout, options, samples)

    listing = {split: listing_fingerprint(pairs, Path(task.path).expanduser()) for split, pairs in samples.items()}
    return TaskSpec(name=task.name, classnames=classnames, templates=templates, load=load, listing=listing)


def scan_splits(task: FolderTask, layout: FolderLayout) -> dict[str, list[tuple[str, int]]]:
    """(file, label) pairs of each split folder the task has (train, and test and val if present)."""
    index = {name: i for i, name in enumerate(layout.classes)}
    folders = {"train": layout.train, "test": layout.test, "val": layout.val}
    return {split: scan_split(folder, index, f"task '{task.name}' ({split})") for split, folder in folders.items()
            if folder is not None}


def image_problem(path: str) -> str | None:
    """Why PIL cannot open `path` (None when it can): header, format and, for PNG, chunk checksums."""
    try:
        with Image.open(path) as image:
            image.verify()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def readable_samples(task: FolderTask, split: str, samples: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """`samples` whose files open; an unreadable one is an error, or with `bad_images: skip` left out."""
    # threads: verify is file reading and checksums, mostly outside the GIL
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        problems = list(pool.map(image_problem, [path for path, _ in samples]))
    bad = [(path, problem) for (path, _), problem in zip(samples, problems) if problem is not None]
    if not bad:
        return samples
    what = f"data.custom_tasks '{task.name}' ({split})"
    first = f"{bad[0][0]}: {bad[0][1]}"
    if task.bad_images != "skip":
        raise MimaError(f"{what}: {len(bad)} of {len(samples)} image files cannot be opened (first: {first}); "
                        "remove them or set bad_images: skip")
    print(f"{what}: leaving out {len(bad)} of {len(samples)} image files that cannot be opened (first: {first})",
          file=sys.stderr)
    return [sample for sample, problem in zip(samples, problems) if problem is None]


def check_split_sizes(task: FolderTask, layout: FolderLayout, samples: dict[str, list[tuple[str, int]]]) -> None:
    """Every split gets at least one image (by the same rules `load_folder_task` splits with)."""
    training = len(samples["train"])
    test = len(samples["test"]) if "test" in samples else int(round(TEST_FRACTION * training))
    remaining = training if "test" in samples else training - test
    val = len(samples["val"]) if "val" in samples else validation_size(remaining)
    train = remaining if "val" in samples else remaining - val
    sizes = {"train": train, "val": val, "test": test}
    empty = [split for split, size in sizes.items() if size < 1]
    if empty:
        raise MimaError(
            f"data.custom_tasks '{task.name}': {training} readable training images under {layout.train} leave the "
            f"{empty[0]} split empty (splits: {', '.join(f'{k} {v}' for k, v in sizes.items())}); add images"
        )


def load_folder_task(task: FolderTask, layout: FolderLayout, options: LoadOptions,
                     samples_by_split: dict[str, list[tuple[str, int]]] | None = None) -> TaskData:
    transform = rgb_transform(options)
    what = f"task '{task.name}'"
    samples_by_split = samples_by_split or scan_splits(task, layout)
    samples = samples_by_split["train"]
    if "test" in samples_by_split:
        train_all = ImageFiles(samples, transform)
        test: Dataset = ImageFiles(samples_by_split["test"], transform)
    else:
        everything = ImageFiles(samples, transform)
        rest, held = holdout_split(len(everything), TEST_FRACTION, TEST_SPLIT_SEED + options.split_seed)
        train_all, test = Subset(everything, rest.tolist()), Subset(everything, held.tolist())
    val = ImageFiles(samples_by_split["val"], transform) if "val" in samples_by_split else None
    train, val = with_validation(train_all, val, options.split_seed)
    train = with_training_transform(train, options)  # val and test keep the evaluation transform
    for split, dataset in (("train", train), ("val", val), ("test", test)):
        if len(dataset) == 0:
            raise MimaError(f"{what}: the {split} split is empty ({len(samples)} training images under {layout.train})")
    return TaskData(train=train, val=val, test=test)
