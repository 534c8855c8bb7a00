"""The `clip` suite: the image-classification tasks of the CLIP model-merging benchmark.

BENCHMARKS (mima.data.benchmarks) names the task lists of the papers: "8" (task_vectors, TIES, CART, MIMA: Cars, DTD,
EuroSAT, GTSRB, MNIST, RESISC45, SUN397, SVHN), "14" and "20" (TALL masks / Consensus merging).
The suite's default task list is the 8-task benchmark.

Every task reads its files from `data.root`, laid out as task_vectors and tall_masks expect them,
so a data folder prepared for those repositories works as it is. Datasets that torchvision reads
are read with torchvision (its own sub-folders, e.g. ROOT/MNIST/raw/); four datasets have no
usable torchvision reader and are read as folders of class folders, as task_vectors does:
  DTD       ROOT/dtd/{train,val}/<class>/      official partition 1: train+val in train/, test in val/
  EuroSAT   ROOT/EuroSAT_splits/{train,val,test}/<class>/   (21,600 / 2,700 / 2,700 images)
  RESISC45  ROOT/resisc45/NWPU-RESISC45/<class>/ with resisc45-{train,test}.txt listing file names
  SUN397    ROOT/sun397/{train,val}/<letter>_<category>/    official partition 1 (Training_01 /
            Testing_01), e.g. sun397/train/a_apartment_building_outdoor/
`mima data check --root ROOT` prints what each task expects and what is missing, file by file.

Splits (the task_vectors rules, `mima data splits --config FILE --out DIR` writes them): test is
the dataset's test split (for DTD and SUN397 it lives in the folder named `val`, as in
task_vectors); validation is carved from the training split exactly as task_vectors'
`split_train_into_train_val` carves it (`mima.data.splits.carve_validation`: torch's random_split
of [n - v, v] with `torch.Generator().manual_seed(0)`, v = min(int(0.1 n), 5000), validation the
permutation's TAIL), except for EuroSAT, whose `val` folder is its validation split (task_vectors'
EuroSATVal, the only dataset of task_vectors and tall_masks with a "Val" class of its own). Official
validation splits of other datasets are not used, as in task_vectors/tall_masks (Flowers102 trains
on torchvision's "train" split alone, PCAM on "train", RenderedSST2 on "train", RESISC45 on
resisc45-train.txt; their "val" parts are left out). Indices are into the training split as the
reader lists it (torchvision's order; ImageFolder's order for the folder-read tasks), n below is
the size of the full official training split:

  task           training split read            validation                       test
  Cars           StanfordCars train (8,144)     carved: 814                      StanfordCars test (8,041)
  DTD            dtd/train (3,760)              carved: 376                      dtd/val (1,880)
  EuroSAT        EuroSAT_splits/train (21,600)  EuroSAT_splits/val (2,700)       EuroSAT_splits/test (2,700)
  GTSRB          GTSRB train (26,640)           carved: 2,664                    GTSRB test (12,630)
  MNIST          MNIST train (60,000)           carved: 5,000 (train[0]: 36044)  MNIST test (10,000)
  RESISC45       resisc45-train.txt (18,900)    carved: 1,890                    resisc45-test.txt (6,300)
  SUN397         sun397/train (19,850)          carved: 1,985                    sun397/val (19,850)
  SVHN           SVHN train (73,257)            carved: 5,000                    SVHN test (26,032)
  STL10          STL10 train (5,000)            carved: 500                      STL10 test (8,000)
  OxfordIIITPet  trainval (3,680)               carved: 368                      test (3,669)
  Flowers102     train (1,020)                  carved: 102                      test (6,149)
  CIFAR100       train (50,000)                 carved: 5,000                    test (10,000)
  PCAM           train (262,144)                carved: 5,000                    test (32,768)
  FER2013        train (28,709)                 carved: 2,870                    test (7,178)
  CIFAR10        train (50,000)                 carved: 5,000                    test (10,000)
  Food101        train (75,750)                 carved: 5,000                    test (25,250)
  FashionMNIST   train (60,000)                 carved: 5,000                    test (10,000)
  RenderedSST2   train (6,920)                  carved: 692                      test (1,821)
  EMNIST         digits train (240,000)         carved: 5,000                    digits test (40,000)
  KMNIST         train (60,000)                 carved: 5,000                    test (10,000)

The sizes are those of the published datasets (carved = min(int(0.1 n), 5000)); a root with other
files gives other sizes by the same rule. Images go through the model's preprocessing after a conversion to RGB: the
training split through its training transform (`LoadOptions.preprocess_train`: open_clip's
RandomResizedCrop, scale 0.9-1.0, as task_vectors' `finetune.py` trains on `train_preprocess`),
validation (also where it is carved from the training split) and test through its evaluation
transform (`LoadOptions.preprocess`, as task_vectors evaluates with `val_preprocess`).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from torch.utils.data import Dataset

from mima.data import clip_text as text
from mima.data.benchmarks import BENCHMARKS
from mima.data.image_datasets import ImageFiles, rgb_transform, with_training_transform, with_validation
from mima.data.image_scan import class_folders, scan_split
from mima.data.tasks import LoadOptions, TaskData, TaskSpec
from mima.core.errors import MimaError

DEFAULT_TASKS = BENCHMARKS["8"]

# (train, validation or None to carve one, test), each yielding (image tensor, int label)
Splits = tuple[Dataset, "Dataset | None", Dataset]


# --------------------------------------------------------------------------------- file layout
@dataclass(frozen=True)
class Piece:
    """One file or folder a task needs, relative to the data root ("/" separated; folders end in "/").

    `classes`: sub-folders the folder must hold (one per class). `alternatives`: other paths that
    serve as well (any one of them is enough)."""

    path: str
    note: str = ""
    classes: tuple[str, ...] = ()
    alternatives: tuple[str, ...] = ()

    @property
    def is_folder(self) -> bool:
        return self.path.endswith("/")

    def describe(self) -> str:
        where = " or ".join((self.path, *self.alternatives))
        if self.classes:
            where = f"{self.path}<class>/ ({len(self.classes)} class folders: {', '.join(self.classes[:3])}, ...)"
        return f"{where} ({self.note})" if self.note and not self.classes else where

    def state(self, root: Path) -> tuple[str, str]:
        """("ok" | "missing" | "incomplete", detail), looking only at names on disk."""
        for candidate in (self.path, *self.alternatives):
            path = root / candidate
            if (path.is_dir() if self.is_folder else path.is_file()):
                break
        else:
            return "missing", ""
        if not self.classes:
            return "ok", ""
        present = set(class_folders(path))
        absent = [name for name in self.classes if name not in present]
        if absent:
            return "incomplete", f"{len(absent)} of {len(self.classes)} class folders missing, e.g. {absent[0]}/"
        return "ok", ""


@dataclass(frozen=True)
class RealTask:
    """A benchmark task: its class names, the files it needs under the data root, how to read them."""

    name: str
    classnames: tuple[str, ...]
    pieces: tuple[Piece, ...]
    read: Callable[[Path, Callable | None, bool], Splits]  # (root, transform, download) -> splits
    source: str  # where the files come from (README and `mima data check`)
    downloadable: bool = False  # torchvision can download it (`data.download`, `mima data check --download`)

    @property
    def templates(self) -> tuple[str, ...]:
        return text.TEMPLATES[self.name]

    def states(self, root: Path) -> list[tuple[Piece, str, str]]:
        return [(piece, *piece.state(root)) for piece in self.pieces]

    def layout(self) -> str:
        return "; ".join(piece.describe() for piece in self.pieces)

    def spec(self) -> TaskSpec:
        return TaskSpec(name=self.name, classnames=self.classnames, templates=self.templates, load=partial(load_task, self))

    def download(self, root: Path) -> None:
        """Let torchvision fetch the task's files into `root` (both splits)."""
        if not self.downloadable:
            raise MimaError(f"{self.name}: torchvision cannot download it; get it from {self.source}")
        root.mkdir(parents=True, exist_ok=True)
        self.read(root, None, True)


def require_files(task: RealTask, root: str | None, download: bool) -> Path:
    """The data root, after checking (names on disk only) that the task's files are there; else a
    one-line MimaError naming the task, the root, what is missing and the expected layout."""
    if not root:
        raise MimaError(f"data.root: task {task.name} is read from disk; set data.root to the folder that holds its files")
    path = Path(root).expanduser()
    states = task.states(path)
    missing = [f"{piece.path} ({detail})" if detail else piece.path for piece, state, detail in states if state != "ok"]
    if missing and not (download and task.downloadable):
        nothing = all(state == "missing" for _, state, _ in states)
        found = "not found" if nothing else f"incomplete (missing {', '.join(missing)})"
        hint = " or set data.download: true" if task.downloadable else f"; source: {task.source}"
        raise MimaError(
            f"data.root: task {task.name} {found} under {path}; expected: {task.layout()}; "
            f"`mima data check --root {path}` lists what every task needs{hint}"
        )
    return path


def check_specs(specs, root: str | None, download: bool) -> None:
    """Fail early, before a model is built or a process launched, when a clip-suite task among
    `specs` misses files (custom tasks that share a benchmark task's name are not checked)."""
    for spec in specs:
        if spec.name in TASKS and TASKS[spec.name] is spec:
            require_files(REAL_TASKS[spec.name], root, download)


def load_task(task: RealTask, options: LoadOptions) -> TaskData:
    """The task's splits, or a one-line MimaError naming what is missing or unreadable under the root."""
    root = require_files(task, options.root, options.download)
    try:
        train, val, test = task.read(root, rgb_transform(options), options.download)
    except MimaError:
        raise
    except Exception as exc:  # torchvision's "not found or corrupted", unpickling, asserts on file headers, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        raise MimaError(f"data.root: task {task.name}: could not read its files under {root} ({reason}); expected: {task.layout()}") from None
    train, val = with_validation(train, val, options.split_seed)
    # Only the training split is augmented; val (carved from the same images) and test are not.
    return TaskData(train=with_training_transform(train, options), val=val, test=test)


def _checked_classes(task: str, found: list[str], expected: tuple[str, ...], normalise=lambda name: name) -> None:
    """Labels come from the dataset's own class order; the heads from our names. They must agree."""
    names = tuple(normalise(name) for name in found)
    if names != expected:
        differ = next((f"'{a}' vs '{b}'" for a, b in zip(names, expected) if a != b), f"{len(names)} vs {len(expected)} classes")
        raise MimaError(f"{task}: the dataset's classes differ from mima's class names ({differ})")


# ------------------------------------------------------------------ torchvision-read datasets
def _read_cars(root: Path, transform, download: bool) -> Splits:
    from torchvision.datasets import StanfordCars

    train = StanfordCars(str(root), split="train", transform=transform)
    test = StanfordCars(str(root), split="test", transform=transform)
    if len(train.classes) != len(text.CARS):
        raise MimaError(f"Cars: {root}/stanford_cars/devkit/cars_meta.mat lists {len(train.classes)} classes, not {len(text.CARS)}")
    return train, None, test


def _read_gtsrb(root: Path, transform, download: bool) -> Splits:
    from torchvision.datasets import GTSRB

    return (GTSRB(str(root), split="train", transform=transform, download=download), None,
            GTSRB(str(root), split="test", transform=transform, download=download))


def _read_mnist_like(cls_name: str, folder: str | None, root: Path, transform, download: bool, **kwargs) -> Splits:
    import torchvision.datasets as tvd

    cls = getattr(tvd, cls_name)
    where = str(root / folder if folder else root)
    return (cls(where, train=True, transform=transform, download=download, **kwargs), None,
            cls(where, train=False, transform=transform, download=download, **kwargs))


def _read_svhn(root: Path, transform, download: bool) -> Splits:
    from torchvision.datasets import SVHN

    where = str(root / "svhn")
    return (SVHN(where, split="train", transform=transform, download=download), None,
            SVHN(where, split="test", transform=transform, download=download))


def _read_split_named(cls_name: str, folder: str, train_split: str, root: Path, transform, download: bool) -> Splits:
    """Datasets whose constructor takes split= and download= (STL10, Flowers102, PCAM, RenderedSST2, ...)."""
    import torchvision.datasets as tvd

    cls = getattr(tvd, cls_name)
    where = str(root / folder)
    return (cls(where, split=train_split, transform=transform, download=download), None,
            cls(where, split="test", transform=transform, download=download))


def _read_pets(root: Path, transform, download: bool) -> Splits:
    train, val, test = _read_split_named("OxfordIIITPet", "OxfordIIITPet", "trainval", root, transform, download)
    _checked_classes("OxfordIIITPet", train.classes, text.OXFORD_PETS)
    return train, val, test


def _read_food(root: Path, transform, download: bool) -> Splits:
    train, val, test = _read_split_named("Food101", "food101", "train", root, transform, download)
    _checked_classes("Food101", train.classes, text.FOOD101, lambda name: name.replace("_", " "))
    return train, val, test


def _read_pcam(root: Path, transform, download: bool) -> Splits:
    try:
        import h5py  # noqa: F401  torchvision's PCAM reader needs it
    except ImportError:
        raise MimaError("PCAM: reading its .h5 files needs the h5py package (pip install h5py)") from None
    return _read_split_named("PCAM", "PCAM", "train", root, transform, download)


def _read_fer(root: Path, transform, download: bool) -> Splits:
    from torchvision.datasets import FER2013

    # torchvision cannot download FER2013; with fer2013.csv (or icml_face_data.csv) the test split
    # (PublicTest + PrivateTest) has labels, with test.csv alone it would not.
    try:
        return (FER2013(str(root), split="train", transform=transform), None,
                FER2013(str(root), split="test", transform=transform))
    except (csv.Error, RuntimeError, ValueError, IndexError, KeyError) as error:
        # a damaged or edited csv: torchvision checks its md5 and parses it as it reads (a field over the
        # csv module's limit, a short row)
        raise MimaError(f"FER2013: the csv files under {root / 'fer2013'} cannot be read as FER2013's "
                        f"({type(error).__name__}: {str(error).splitlines()[0][:200]}); download them again") from None


# ------------------------------------------------------------------------ folder-read datasets
def _read_folders(folder: str, class_folder_names: tuple[str, ...], splits: dict[str, str], task: str,
                  root: Path, transform, download: bool) -> Splits:
    """Folders of class folders; `splits` maps train/val/test to sub-folders (val may be absent)."""
    index = {name: i for i, name in enumerate(class_folder_names)}

    def read(split: str) -> ImageFiles:
        where = root / folder / splits[split]
        return ImageFiles(scan_split(where, index, f"{task} ({split})", require_all=split == "train"), transform)

    return read("train"), read("val") if "val" in splits else None, read("test")


def _read_resisc45(root: Path, transform, download: bool) -> Splits:
    """task_vectors' RESISC45: the class folders of NWPU-RESISC45, split by the file-name lists of
    "In-domain representation learning for remote sensing" (resisc45-{train,test}.txt)."""
    index = {name: i for i, name in enumerate(text.RESISC45_FOLDERS)}
    images = root / "resisc45" / "NWPU-RESISC45"

    def read(split: str) -> ImageFiles:
        names = set((root / "resisc45" / f"resisc45-{split}.txt").read_text().split())
        keep = lambda path: os.path.basename(path) in names  # noqa: E731
        return ImageFiles(scan_split(images, index, f"RESISC45 ({split})", require_all=True, keep=keep), transform)

    return read("train"), None, read("test")


def _sun397_folder(category: str) -> str:
    """task_vectors' folder of a SUN397 category: "apartment_building/outdoor" -> "a_apartment_building_outdoor"."""
    return f"{category[0]}_{category.replace('/', '_')}"


SUN397_FOLDERS = tuple(sorted(_sun397_folder(category) for category in text.SUN397_CATEGORIES))
GTSRB_FOLDERS = tuple(f"{label:05d}" for label in range(len(text.GTSRB)))


def _mnist_files(folder: str, prefix: str = "", names: tuple[str, str] = ("train", "t10k")) -> tuple[Piece, ...]:
    return tuple(
        Piece(f"{folder}/{prefix}{split}-{kind}-ubyte", note)
        for split, note in zip(names, ("training split", "test split"))
        for kind in ("images-idx3", "labels-idx1")
    )


def _files(folder: str, names: tuple[str, ...], note: str = "") -> tuple[Piece, ...]:
    return tuple(Piece(f"{folder}/{name}", note) for name in names)


_TASKS: tuple[RealTask, ...] = (
    RealTask(
        "Cars", text.CARS,
        (Piece("stanford_cars/devkit/cars_meta.mat", "class names"),
         Piece("stanford_cars/devkit/cars_train_annos.mat", "training labels"),
         Piece("stanford_cars/cars_train/", "training images"),
         Piece("stanford_cars/cars_test/", "test images"),
         Piece("stanford_cars/cars_test_annos_withlabels.mat", "test labels")),
        _read_cars,
        "Stanford Cars (the original site is offline; torchvision's layout, e.g. the Kaggle copy plus the devkit)",
    ),
    RealTask(
        "DTD", text.DTD,
        (Piece("dtd/train/", classes=text.DTD), Piece("dtd/val/", classes=text.DTD)),
        partial(_read_folders, "dtd", text.DTD, {"train": "train", "test": "val"}, "DTD"),
        "https://www.robots.ox.ac.uk/~vgg/data/dtd/ (partition 1: train1+val1 into dtd/train, test1 into dtd/val)",
    ),
    RealTask(
        "EuroSAT", tuple(text.EUROSAT_FOLDERS.values()),
        tuple(Piece(f"EuroSAT_splits/{split}/", classes=tuple(text.EUROSAT_FOLDERS)) for split in ("train", "val", "test")),
        partial(_read_folders, "EuroSAT_splits", tuple(text.EUROSAT_FOLDERS), {s: s for s in ("train", "val", "test")},
                "EuroSAT"),
        "https://github.com/phelber/EuroSAT (RGB, folder 2750/), split 21,600/2,700/2,700 into EuroSAT_splits/",
    ),
    RealTask(
        "GTSRB", text.GTSRB,
        (Piece("gtsrb/GTSRB/Training/", classes=GTSRB_FOLDERS),
         Piece("gtsrb/GTSRB/Final_Test/Images/", "test images"),
         Piece("gtsrb/GT-final_test.csv", "test labels")),
        _read_gtsrb, "torchvision GTSRB", downloadable=True,
    ),
    RealTask("MNIST", text.DIGITS, _mnist_files("MNIST/raw"), partial(_read_mnist_like, "MNIST", None),
             "torchvision MNIST", downloadable=True),
    RealTask(
        "RESISC45", tuple(name.replace("_", " ") for name in text.RESISC45_FOLDERS),
        (Piece("resisc45/NWPU-RESISC45/", classes=text.RESISC45_FOLDERS),
         Piece("resisc45/resisc45-train.txt", "training file names"),
         Piece("resisc45/resisc45-test.txt", "test file names")),
        _read_resisc45,
        "NWPU-RESISC45 images in class folders, plus the split lists of "
        "https://storage.googleapis.com/remote_sensing_representations/resisc45-{train,test}.txt",
    ),
    RealTask(
        "SUN397", tuple(folder[2:].replace("_", " ") for folder in SUN397_FOLDERS),
        (Piece("sun397/train/", classes=SUN397_FOLDERS), Piece("sun397/val/", classes=SUN397_FOLDERS)),
        partial(_read_folders, "sun397", SUN397_FOLDERS, {"train": "train", "test": "val"}, "SUN397"),
        "https://vision.princeton.edu/projects/2010/SUN/ (Training_01.txt into sun397/train, Testing_01.txt into sun397/val)",
    ),
    RealTask("SVHN", text.DIGITS, _files("svhn", ("train_32x32.mat", "test_32x32.mat")), _read_svhn,
             "torchvision SVHN", downloadable=True),
    RealTask("CIFAR10", text.CIFAR10,
             _files("cifar-10-batches-py", (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta")),
             partial(_read_mnist_like, "CIFAR10", None), "torchvision CIFAR10", downloadable=True),
    RealTask("CIFAR100", text.CIFAR100, _files("cifar-100-python", ("train", "test", "meta")),
             partial(_read_mnist_like, "CIFAR100", None), "torchvision CIFAR100", downloadable=True),
    RealTask("STL10", text.STL10,
             _files("stl10/stl10_binary", ("train_X.bin", "train_y.bin", "unlabeled_X.bin", "test_X.bin", "test_y.bin")),
             partial(_read_split_named, "STL10", "stl10", "train"), "torchvision STL10", downloadable=True),
    RealTask("OxfordIIITPet", text.OXFORD_PETS,
             (Piece("OxfordIIITPet/oxford-iiit-pet/images/", "images"),
              *_files("OxfordIIITPet/oxford-iiit-pet/annotations", ("trainval.txt", "test.txt"), "split lists")),
             _read_pets, "torchvision OxfordIIITPet", downloadable=True),
    RealTask("Flowers102", text.FLOWERS102,
             (Piece("flowers102/flowers-102/jpg/", "images"),
              *_files("flowers102/flowers-102", ("imagelabels.mat", "setid.mat"), "labels and splits")),
             partial(_read_split_named, "Flowers102", "flowers102", "train"), "torchvision Flowers102", downloadable=True),
    RealTask("PCAM", text.PCAM,
             _files("PCAM/pcam", tuple(f"camelyonpatch_level_2_split_{s}_{k}.h5" for s in ("train", "test") for k in "xy")),
             _read_pcam, "torchvision PCAM (needs h5py)", downloadable=True),
    RealTask("FER2013", text.FER2013,
             (Piece("fer2013/fer2013.csv", "train and labelled test", alternatives=("fer2013/icml_face_data.csv",)),),
             _read_fer, "https://www.kaggle.com/c/challenges-in-representation-learning-facial-expression-recognition-challenge"),
    RealTask("Food101", text.FOOD101,
             (Piece("food101/food-101/images/", "images"), *_files("food101/food-101/meta", ("train.json", "test.json"))),
             _read_food, "torchvision Food101", downloadable=True),
    RealTask("FashionMNIST", text.FASHION_MNIST, _mnist_files("FashionMNIST/FashionMNIST/raw"),
             partial(_read_mnist_like, "FashionMNIST", "FashionMNIST"), "torchvision FashionMNIST", downloadable=True),
    RealTask("RenderedSST2", text.RENDERED_SST2,
             tuple(Piece(f"RenderedSST2/rendered-sst2/{split}/", classes=text.RENDERED_SST2) for split in ("train", "test")),
             partial(_read_split_named, "RenderedSST2", "RenderedSST2", "train"), "torchvision RenderedSST2",
             downloadable=True),
    RealTask("EMNIST", text.DIGITS,
             _mnist_files("EMNIST/EMNIST/raw", prefix="emnist-digits-", names=("train", "test")),
             partial(_read_mnist_like, "EMNIST", "EMNIST", split="digits"), "torchvision EMNIST (split 'digits')",
             downloadable=True),
    RealTask("KMNIST", text.KMNIST, _mnist_files("KMNIST/KMNIST/raw"), partial(_read_mnist_like, "KMNIST", "KMNIST"),
             "torchvision KMNIST", downloadable=True),
)

REAL_TASKS: dict[str, RealTask] = {task.name: task for task in _TASKS}
TASKS: dict[str, TaskSpec] = {task.name: task.spec() for task in _TASKS}
