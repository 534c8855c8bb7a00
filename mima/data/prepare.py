"""`mima data prepare`: the publishers' downloads, laid out as the clip suite reads them.

The archives are read as their sites distribute them, from a folder the user downloaded them into
(`--archives`, default the data root); `--download` first fetches, with torchvision's downloader,
those whose address is public. Each task is prepared in a temporary folder beside its target and
renamed into place when complete, so a missing or damaged archive leaves nothing half-written; a
folder already there is kept unless `--overwrite`. The splits are those of task_vectors /
tall_masks:

  DTD       dtd-r1.0.1.tar.gz: partition 1 of the publisher's own lists, labels/train1.txt +
            val1.txt into dtd/train/ (3,760), test1.txt into dtd/val/ (1,880).
  EuroSAT   EuroSAT.zip (or EuroSAT_RGB.zip): per class 270 validation and 270 test images, the
            rest training (21,600 / 2,700 / 2,700), as task_vectors' preparation script (their
            issue #1) does; its unseeded shuffle is replaced by a seeded one (torch.randperm,
            seed 0, over the file names in sorted order), so the split is reproducible but not
            image for image the one of any earlier copy of task_vectors' folders.
  RESISC45  NWPU-RESISC45.rar (or a .zip of the same folder) plus resisc45-{train,val,test}.txt,
            the split lists of "In-domain representation learning for remote sensing" (Neumann
            et al.) that task_vectors reads, accepted as input files (18,900 / 6,300 / 6,300).
  SUN397    SUN397.tar.gz plus Partitions.zip: Training_01.txt into sun397/train/, Testing_01.txt
            into sun397/val/ (19,850 each), folders named <letter>_<category path with '_'>.
  Cars      cars_train.tgz, cars_test.tgz, car_devkit.tgz, cars_test_annos_withlabels.mat:
            torchvision's StanfordCars layout, the dataset's own split (8,144 / 8,041).
  FER2013   Kaggle's challenge zip (or fer2013.tar.gz): fer2013/fer2013.csv, or icml_face_data.csv
            (both hold the test labels); Training rows train, PublicTest + PrivateTest test.

The other tasks are read by torchvision from its own layout; `--download` lets torchvision fetch
them (as `mima data check --download` does).
"""

from __future__ import annotations

import csv
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mima.core.errors import MimaError
from mima.core.names import IMAGE_EXTENSIONS
from mima.data import clip_text as text
from mima.data.archives import archive_files, copy_to, damaged_archive, nested_tar_files, safe_parts, staged_folder
from mima.data.check import STATUS_FOUND, check_task
from mima.data.clip_tasks import REAL_TASKS, SUN397_FOLDERS, Piece, RealTask

EUROSAT_HELD_OUT_PER_CLASS = 270  # validation and test images per class (2,700 each over 10 classes)
EUROSAT_SEED = 0


@dataclass(frozen=True)
class Download:
    """One file a task is prepared from, as its publisher names it; `url`: where to get it (said
    when it is missing); `alternatives`: other names of the same content (any one will do);
    `fetch`/`md5`: the address torchvision's downloader fetches it from with `--download`."""

    name: str
    url: str
    alternatives: tuple[str, ...] = ()
    fetch: str | None = None
    md5: str | None = None

    def find(self, folder: Path) -> Path | None:
        return next((folder / name for name in (self.name, *self.alternatives) if (folder / name).is_file()), None)


Inputs = dict[str, Path]  # Download.name -> the file found for it
Sizes = dict[str, int]  # split -> images written


@dataclass(frozen=True)
class Recipe:
    task: str
    folder: str  # the folder under the data root it writes (one per task)
    inputs: tuple[Download, ...]
    build: Callable[[Inputs, Path], Sizes]  # (the archives, the temporary folder) -> split sizes


# --------------------------------------------------------------------------------- helpers
def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def _class_and_file(name: str) -> tuple[str, str] | None:
    """(class folder, file name) of an image member '.../<class>/<file>', or None."""
    parts = safe_parts(name)
    if len(parts) < 2 or not _is_image(parts[-1]) or parts[-1].startswith("."):
        return None
    return parts[-2], parts[-1]


def _lines(data: bytes) -> list[str]:
    return [line.strip() for line in data.decode("utf-8", "replace").splitlines() if line.strip()]


def _count_files(folder: Path) -> int:
    return sum(1 for path in folder.rglob("*") if path.is_file())


def _missing(path: Path, listed_in: str, absent: Iterable[str], source: str) -> MimaError:
    absent = sorted(absent)
    return MimaError(f"{path}: {len(absent)} images listed in {listed_in} are not in the archive (e.g. {absent[0]}); "
                     f"is it the complete download from {source}?")


# -------------------------------------------------------------------------------------- DTD
DTD_URL = "https://www.robots.ox.ac.uk/~vgg/data/dtd/download/dtd-r1.0.1.tar.gz"
DTD_FILES = (Download("dtd-r1.0.1.tar.gz", DTD_URL, fetch=DTD_URL, md5="fff73e5086ae6bdbea199a49dfb8a4c1"),)
DTD_PARTITION = {"train": ("train1.txt", "val1.txt"), "val": ("test1.txt",)}  # our folder <- the publisher's lists


def prepare_dtd(inputs: Inputs, out: Path) -> Sizes:
    """One pass over the tar: every image into out/images/, the label lists kept; then each image
    of partition 1 is moved to the folder its list names."""
    archive = inputs["dtd-r1.0.1.tar.gz"]
    source = DTD_FILES[0].url
    lists: dict[str, list[str]] = {}
    wanted = {name for names in DTD_PARTITION.values() for name in names}
    images = out / "images"
    with damaged_archive(archive, source):
        for name, stream in archive_files(archive, source):
            parts = safe_parts(name)
            if len(parts) >= 2 and parts[-2] == "labels" and parts[-1] in wanted:
                lists[parts[-1]] = _lines(stream.read())
            elif len(parts) >= 3 and parts[-3] == "images" and parts[-2] in text.DTD and _is_image(parts[-1]):
                copy_to(stream, images / parts[-2] / parts[-1])
    absent_lists = sorted(wanted - set(lists))
    if absent_lists:
        raise MimaError(f"{archive}: holds no dtd/labels/{absent_lists[0]}; is it the download from {source}?")
    sizes: Sizes = {}
    for split, list_names in DTD_PARTITION.items():
        for list_name in list_names:
            entries = [safe_parts(line) for line in lists[list_name]]
            absent = [line for line, parts in zip(lists[list_name], entries)
                      if len(parts) != 2 or not (images / parts[0] / parts[1]).is_file()]
            if absent:
                raise _missing(archive, f"dtd/labels/{list_name}", absent, source)
            for class_name, file_name in entries:
                destination = out / split / class_name / file_name
                destination.parent.mkdir(parents=True, exist_ok=True)
                (images / class_name / file_name).rename(destination)
        sizes[split] = _count_files(out / split)
    shutil.rmtree(images)  # images of no partition-1 list (the release has none)
    return {"train": sizes["train"], "test (in val/)": sizes["val"]}


# ---------------------------------------------------------------------------------- EuroSAT
# torchvision's copy of the publisher's EuroSAT.zip (the RGB release, folder 2750/)
EUROSAT_FETCH = "https://huggingface.co/datasets/torchgeo/eurosat/resolve/c877bcd43f099cd0196738f714544e355477f3fd/EuroSAT.zip"
EUROSAT_FILES = (Download("EuroSAT.zip", f"https://github.com/phelber/EuroSAT (RGB release), or {EUROSAT_FETCH}",
                          alternatives=("EuroSAT_RGB.zip",), fetch=EUROSAT_FETCH, md5="c8fa014336c82ac7804f0398fcb19387"),)


def eurosat_split(file_names: Sequence[str], held_out: int = EUROSAT_HELD_OUT_PER_CLASS,
                  seed: int = EUROSAT_SEED) -> dict[str, list[str]]:
    """One class's images into val (the first `held_out` of a seeded permutation of the sorted
    names), test (the next `held_out`) and train (the rest), as task_vectors' script orders them."""
    names = sorted(file_names)
    order = torch.randperm(len(names), generator=torch.Generator().manual_seed(seed)).tolist()
    shuffled = [names[i] for i in order]
    return {"val": shuffled[:held_out], "test": shuffled[held_out:2 * held_out], "train": shuffled[2 * held_out:]}


def prepare_eurosat(inputs: Inputs, out: Path) -> Sizes:
    archive = inputs["EuroSAT.zip"]
    source = EUROSAT_FILES[0].url
    with damaged_archive(archive, source):
        members = {}
        for name, stream in archive_files(archive, source):
            found = _class_and_file(name)
            if found and found[0] in text.EUROSAT_FOLDERS:
                members.setdefault(found[0], {})[found[1]] = name
                copy_to(stream, out / "all" / found[0] / found[1])
    for class_name in text.EUROSAT_FOLDERS:
        count = len(members.get(class_name, {}))
        if count <= 2 * EUROSAT_HELD_OUT_PER_CLASS:
            raise MimaError(f"{archive}: class folder {class_name}/ holds {count} images; more than "
                            f"{2 * EUROSAT_HELD_OUT_PER_CLASS} are needed (270 validation, 270 test, the rest "
                            f"training); is it the RGB release from {source}?")
    for class_name in text.EUROSAT_FOLDERS:
        for split, names in eurosat_split(list(members[class_name])).items():
            (out / split / class_name).mkdir(parents=True, exist_ok=True)
            for file_name in names:
                (out / "all" / class_name / file_name).rename(out / split / class_name / file_name)
    shutil.rmtree(out / "all")  # empty folders by now
    return {split: _count_files(out / split) for split in ("train", "val", "test")}


# --------------------------------------------------------------------------------- RESISC45
RESISC45_LISTS = "https://storage.googleapis.com/remote_sensing_representations/resisc45-{}.txt"
RESISC45_FILES = (
    Download("NWPU-RESISC45.rar", "https://gcheng-nwpu.github.io/#Datasets, the authors' links; or torchgeo's .zip",
             alternatives=("NWPU-RESISC45.zip",)),
    *(Download(f"resisc45-{split}.txt", RESISC45_LISTS.format(split), fetch=RESISC45_LISTS.format(split)) for split in ("train", "test")),
)


def prepare_resisc45(inputs: Inputs, out: Path) -> Sizes:
    archive = inputs["NWPU-RESISC45.rar"]
    source = RESISC45_FILES[0].url
    images = out / "NWPU-RESISC45"
    written: set[str] = set()
    with damaged_archive(archive, source):
        for name, stream in archive_files(archive, source):
            found = _class_and_file(name)
            if found and found[0] in text.RESISC45_FOLDERS:
                copy_to(stream, images / found[0] / found[1])
                written.add(found[1])
    sizes: Sizes = {}
    for split in ("train", "test"):
        list_file = inputs[f"resisc45-{split}.txt"]
        names = list_file.read_text().split()
        absent = set(names) - written
        if absent:
            raise _missing(archive, list_file.name, absent, source)
        (out / list_file.name).write_bytes(list_file.read_bytes())
        sizes[split] = len(names)
    return sizes


# ----------------------------------------------------------------------------------- SUN397
SUN397_URL = "http://vision.princeton.edu/projects/2010/SUN/SUN397.tar.gz"
SUN397_PARTITIONS_URL = "https://vision.princeton.edu/projects/2010/SUN/download/Partitions.zip"
SUN397_FILES = (
    Download("SUN397.tar.gz", SUN397_URL, fetch=SUN397_URL, md5="8ca2778205c41d23104230ba66911c7a"),
    Download("Partitions.zip", SUN397_PARTITIONS_URL, fetch=SUN397_PARTITIONS_URL),
)
SUN397_PARTITION = {"Training_01.txt": "train", "Testing_01.txt": "val"}


def _sun397_lists(partitions: Path) -> dict[str, list[str]]:
    source = SUN397_FILES[1].url
    lists: dict[str, list[str]] = {}
    with damaged_archive(partitions, source):
        for name, stream in archive_files(partitions, source):
            base = name.rsplit("/", 1)[-1]
            if base in SUN397_PARTITION:
                lists[base] = _lines(stream.read())
    absent = [name for name in SUN397_PARTITION if name not in lists]
    if absent:
        raise MimaError(f"{partitions}: holds no {absent[0]}; is it the download from {source}?")
    return lists


def prepare_sun397(inputs: Inputs, out: Path) -> Sizes:
    """Stream SUN397.tar.gz once, writing each image of partition 1 to the folder task_vectors uses:
    '/a/apartment_building/outdoor/sun_x.jpg' -> <split>/a_apartment_building_outdoor/sun_x.jpg."""
    archive = inputs["SUN397.tar.gz"]
    source = SUN397_FILES[0].url
    known = set(SUN397_FOLDERS)
    wanted: dict[str, Path] = {}  # path in the partition list, without the leading '/' -> destination
    lists = _sun397_lists(inputs["Partitions.zip"])
    for list_name, split in SUN397_PARTITION.items():
        for line in lists[list_name]:
            parts = safe_parts(line.lstrip("/"))
            folder = "_".join(parts[:-1])
            if len(parts) < 3 or folder not in known:
                raise MimaError(f"{inputs['Partitions.zip']}: {list_name} lists '{line}', not an image of one of "
                                f"SUN397's 397 categories")
            wanted["/".join(parts)] = out / split / folder / parts[-1]
    remaining = dict(wanted)
    with damaged_archive(archive, source):
        for name, stream in archive_files(archive, source):
            parts = safe_parts(name)
            key = "/".join(parts)
            if key not in remaining and len(parts) > 1:
                key = "/".join(parts[1:])  # below the archive's top folder SUN397/
            destination = remaining.pop(key, None)
            if destination is not None:
                copy_to(stream, destination)
    if remaining:
        raise _missing(archive, "Partitions.zip (Training_01.txt, Testing_01.txt)", remaining, source)
    return {"train": _count_files(out / "train"), "test (in val/)": _count_files(out / "val")}


# ------------------------------------------------------------------------------------- Cars
CARS_SITE = "http://ai.stanford.edu/~jkrause/cars/car_dataset.html, offline now: copies on Kaggle or the Internet Archive"
CARS_FILES = (
    Download("cars_train.tgz", CARS_SITE),
    Download("cars_test.tgz", CARS_SITE),
    Download("car_devkit.tgz", CARS_SITE),
    Download("cars_test_annos_withlabels.mat", CARS_SITE),
)
CARS_FOLDERS = {"cars_train.tgz": "cars_train", "cars_test.tgz": "cars_test", "car_devkit.tgz": "devkit"}


def prepare_cars(inputs: Inputs, out: Path) -> Sizes:
    """Each archive's one top folder (cars_train/, cars_test/, devkit/) unpacked as it is."""
    for archive_name, folder in CARS_FOLDERS.items():
        archive = inputs[archive_name]
        count = 0
        with damaged_archive(archive, CARS_SITE):
            for name, stream in archive_files(archive, CARS_SITE):
                parts = safe_parts(name)
                if len(parts) >= 2 and parts[0] == folder:
                    copy_to(stream, out.joinpath(*parts))
                    count += 1
        if count == 0:
            raise MimaError(f"{archive}: holds no {folder}/ folder; is it the Stanford Cars file of that name?")
    labels = inputs["cars_test_annos_withlabels.mat"]
    (out / labels.name).write_bytes(labels.read_bytes())
    return {"train": _count_files(out / "cars_train"), "test": _count_files(out / "cars_test")}


# ---------------------------------------------------------------------------------- FER2013
FER_SOURCE = "https://www.kaggle.com/c/challenges-in-representation-learning-facial-expression-recognition-challenge/data"
FER_FILES = (Download("challenges-in-representation-learning-facial-expression-recognition-challenge.zip", FER_SOURCE,
                      alternatives=("fer2013.tar.gz",)),)
FER_CSVS = ("fer2013.csv", "icml_face_data.csv")  # the files with test labels, in torchvision's order of preference


def _fer_usage_counts(path: Path) -> Sizes:
    with open(path, newline="", encoding="utf-8", errors="replace") as stream:
        rows = csv.reader(stream)
        header = [cell.strip() for cell in next(rows, [])]
        if "Usage" not in header:
            raise MimaError(f"FER2013: {path.name} has no Usage column; is it the challenge's file?")
        column = header.index("Usage")
        usage = [row[column].strip() for row in rows if len(row) > column]
    return {"train": usage.count("Training"), "test": usage.count("PublicTest") + usage.count("PrivateTest")}


def prepare_fer2013(inputs: Inputs, out: Path) -> Sizes:
    """The labelled csv, taken from Kaggle's zip (directly, or from the fer2013.tar.gz inside it)
    or from fer2013.tar.gz, written byte for byte (torchvision checks its md5); of the two, the
    one torchvision prefers is kept."""
    archive = inputs[FER_FILES[0].name]

    def take(files) -> None:
        for name, stream in files:
            base = name.rsplit("/", 1)[-1]
            if base in FER_CSVS and not (out / base).exists():
                copy_to(stream, out / base)
            elif base == "fer2013.tar.gz":
                take(nested_tar_files(stream))

    with damaged_archive(archive, FER_SOURCE):
        take(archive_files(archive, FER_SOURCE))
    found = [name for name in FER_CSVS if (out / name).exists()]
    if not found:
        raise MimaError(f"{archive}: holds neither fer2013.csv nor icml_face_data.csv (the files with test labels); "
                        f"download the challenge's data from {FER_SOURCE}")
    for unused in found[1:]:
        (out / unused).unlink()
    return _fer_usage_counts(out / found[0])


RECIPES: dict[str, Recipe] = {recipe.task: recipe for recipe in (
    Recipe("Cars", "stanford_cars", CARS_FILES, prepare_cars),
    Recipe("DTD", "dtd", DTD_FILES, prepare_dtd),
    Recipe("EuroSAT", "EuroSAT_splits", EUROSAT_FILES, prepare_eurosat),
    Recipe("RESISC45", "resisc45", RESISC45_FILES, prepare_resisc45),
    Recipe("SUN397", "sun397", SUN397_FILES, prepare_sun397),
    Recipe("FER2013", "fer2013", FER_FILES, prepare_fer2013),
)}


# ----------------------------------------------------------------------------------- running
def _relative(piece: Piece, folder: str) -> Piece:
    """A piece of a task's layout as seen from inside its own folder (to check the staging folder)."""
    strip = lambda path: path[len(folder) + 1:]  # noqa: E731
    return replace(piece, path=strip(piece.path), alternatives=tuple(strip(p) for p in piece.alternatives))


def _incomplete(task: RealTask, folder: str, where: Path) -> str | None:
    """The first piece missing or incomplete under `where` (the task's folder), or None."""
    for piece in task.pieces:
        state, detail = _relative(piece, folder).state(where)
        if state != "ok":
            return f"{piece.path}" + (f" ({detail})" if detail else f" ({state})")
    return None


def _fetch(download: Download, folder: Path, say: Callable[[str], None]) -> None:
    from torchvision.datasets.utils import download_url

    say(f"mima data prepare: downloading {download.fetch} into {folder} ...")
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{download.name}.{os.getpid()}.part"  # the file gets its name once complete
    try:
        download_url(download.fetch, str(folder), filename=partial.name, md5=download.md5)
        partial.rename(folder / download.name)
    except Exception as exc:  # network errors, a wrong checksum (torchvision's RuntimeError)
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise MimaError(f"download of {download.name} from {download.fetch} failed ({reason})") from None
    finally:
        partial.unlink(missing_ok=True)


def _inputs(recipe: Recipe, archives: Path, download: bool, say: Callable[[str], None]) -> Inputs:
    """The files the recipe reads, fetched first where `download` and torchvision can; a missing
    one is one MimaError naming every missing file and where it comes from."""
    found: Inputs = {}
    for item in recipe.inputs:
        path = item.find(archives)
        if path is None and download and item.fetch:
            _fetch(item, archives, say)
            path = item.find(archives)
        if path is not None:
            found[item.name] = path
    missing = [item for item in recipe.inputs if item.name not in found]
    if missing:
        by_source: dict[str, list[str]] = {}  # files from one place named together
        for item in missing:
            by_source.setdefault(item.url, []).append(" or ".join((item.name, *item.alternatives)))
        named = "; ".join(f"{', '.join(names)} (from {url})" for url, names in by_source.items())
        raise MimaError(f"missing {named} in {archives}")
    return found


def _sizes(sizes: Sizes) -> str:
    return ", ".join(f"{split} {count:,}" for split, count in sizes.items())


def prepare_task(name: str, root: Path, archives: Path, download: bool, overwrite: bool,
                 say: Callable[[str], None]) -> tuple[bool, str]:
    """(done, what happened) for one task; a MimaError is a line about this task, not the others."""
    task = REAL_TASKS[name]
    found = check_task(task, root).status == STATUS_FOUND
    recipe = RECIPES.get(name)
    if recipe is None:  # torchvision reads and downloads it in its own layout
        if found:
            return True, "already there"
        if not download:
            return False, "missing; torchvision downloads it: add --download"
        say(f"mima data prepare: {name}: downloading with torchvision into {root} ...")
        try:
            task.download(root)
        except MimaError:
            raise
        except Exception as exc:  # network errors, torchvision's "not found or corrupted"
            reason = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise MimaError(f"download by torchvision failed ({reason})") from None
        return True, "downloaded by torchvision"
    target = root / recipe.folder
    if found and not overwrite:
        return True, f"already there ({target}; --overwrite prepares it again)"
    if (target.exists() or target.is_symlink()) and not overwrite:
        missing = _incomplete(task, recipe.folder, target)
        return False, f"{target} exists but is incomplete (missing {missing}); pass --overwrite to replace it"
    inputs = _inputs(recipe, archives, download, say)
    say(f"mima data prepare: {name}: reading {', '.join(path.name for path in inputs.values())} ...")
    with staged_folder(target, overwrite) as staging:
        sizes = recipe.build(inputs, staging)
        missing = _incomplete(task, recipe.folder, staging)
        if missing:
            names = ", ".join(path.name for path in inputs.values())
            raise MimaError(f"{names} in {archives}: give no {missing}; are they the downloads from {recipe.inputs[0].url}?")
    return True, f"prepared: {_sizes(sizes)} -> {target}"


def run_prepare(root: Path, archives: Path, names: Sequence[str], download: bool = False, overwrite: bool = False,
                say: Callable[[str], None] = print, progress: Callable[[str], None] = print) -> int:
    """One line per task (`say`); 0 when every task is prepared or already there, else 1."""
    failed = 0
    for name in names:
        try:
            done, line = prepare_task(name, root, archives, download, overwrite, progress)
        except MimaError as exc:
            done, line = False, str(exc)
        failed += not done
        say(f"{name}: {line}")
    return 1 if failed else 0


def validate_arguments(root: Path, archives: Path, download: bool, archives_option: str = "--archives") -> None:
    """Before any work: the data root is a folder (or can be made), the archive folder exists
    (`archives_option`: the option that named it, --root when --archives is not given)."""
    for option, path in (("--root", root), (archives_option, archives)):
        if path.exists() and not path.is_dir():
            raise MimaError(f"{option} {path}: is a file, not a folder")
    if not archives.is_dir() and not download:
        raise MimaError(f"{archives_option} {archives}: no such folder; put the downloaded archives there "
                        f"(or pass --download to let torchvision fetch those it can)")
