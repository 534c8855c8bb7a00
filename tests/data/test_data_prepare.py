"""`mima data prepare` on small fake archives in each publisher's exact format.

Every archive below has the publisher's archive type, internal folder structure and split-file
format (tiny images made with PIL). The expected split sizes are computed here from what each
archive holds; the prepared folders are then read back the way a run reads them (`mima data check`
for the layout, the task's loader for the splits).
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import threading
import zipfile
from dataclasses import replace
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mima.cli import main
from mima.data import clip_text, prepare
from mima.data.clip_tasks import SUN397_FOLDERS, TASKS
from mima.data.splits import task_split_record

_JPEGS: list[bytes] = []


def _jpeg(index: int) -> bytes:
    """A tiny JPEG; 16 different ones, reused (the file names make the files distinct)."""
    if not _JPEGS:
        for seed in range(16):
            pixels = np.random.default_rng(seed).integers(0, 256, (4, 4, 3), dtype=np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, format="JPEG")
            _JPEGS.append(buffer.getvalue())
    return _JPEGS[index % len(_JPEGS)]


def _tar(path: Path, files: dict[str, bytes]) -> None:
    mode = "w:gz" if path.name.endswith(("gz", ".tgz")) else "w"
    with tarfile.open(path, mode) as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def _zip(path: Path, files: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)


def _text(lines) -> bytes:
    return ("\n".join(lines) + "\n").encode()


# ------------------------------------------------------------------- the publishers' archives
def _dtd_archive(folder: Path) -> dict:
    """dtd-r1.0.1.tar.gz: dtd/images/<class>/<class>_NNNN.jpg, dtd/labels/{train,val,test}<k>.txt
    listing '<class>/<file>' (10 partitions in the release; two here, the second another split)."""
    files, lists = {}, {}
    for c, name in enumerate(clip_text.DTD):
        images = [f"{name}/{name}_{i:04d}.jpg" for i in range(1, 5)]
        for i, image in enumerate(images):
            files[f"dtd/images/{image}"] = _jpeg(c + i)
        for split, chosen in (("train1", images[:2]), ("val1", images[2:3]), ("test1", images[3:]),
                              ("train2", images[1:3]), ("val2", images[3:]), ("test2", images[:1])):
            lists.setdefault(split, []).extend(chosen)
    for split, lines in lists.items():
        files[f"dtd/labels/{split}.txt"] = _text(lines)
    files["dtd/labels/labels_joint_anno.txt"] = b"banded/banded_0001.jpg banded\n"
    files["dtd/imdb/imdb.mat"] = b"MATLAB 5.0 MAT-file (not read)"
    _tar(folder / "dtd-r1.0.1.tar.gz", files)
    train = len(lists["train1"]) + len(lists["val1"])
    return {"train": train, "test": len(lists["test1"]), "files": files,
            "placed": {f"dtd/val/{line}": f"dtd/images/{line}" for line in lists["test1"]}
            | {f"dtd/train/{line}": f"dtd/images/{line}" for line in lists["train1"] + lists["val1"]}}


EUROSAT_PER_CLASS = 543  # 270 validation + 270 test + 3 training images per class


def _eurosat_archive(folder: Path, name: str = "EuroSAT.zip", top: str = "2750") -> dict:
    """EuroSAT.zip (RGB): 2750/<Class>/<Class>_<n>.jpg, n from 1 (EuroSAT_RGB.zip: EuroSAT_RGB/...)."""
    files = {f"{top}/{cls}/{cls}_{n}.jpg": _jpeg(c + n)
             for c, cls in enumerate(clip_text.EUROSAT_FOLDERS) for n in range(1, EUROSAT_PER_CLASS + 1)}
    _zip(folder / name, files)
    classes = len(clip_text.EUROSAT_FOLDERS)
    return {"train": classes * (EUROSAT_PER_CLASS - 540), "val": classes * 270, "test": classes * 270, "files": files}


def _resisc45_archive(folder: Path) -> dict:
    """NWPU-RESISC45 (the folder of class folders, here as the .zip of it) and the split lists of
    Neumann et al., resisc45-{train,val,test}.txt: one file name per line."""
    files = {f"NWPU-RESISC45/{cls}/{cls}_{i:03d}.jpg": _jpeg(c + i)
             for c, cls in enumerate(clip_text.RESISC45_FOLDERS) for i in range(1, 5)}
    _zip(folder / "NWPU-RESISC45.zip", files)
    lists = {split: [f"{cls}_{i:03d}.jpg" for cls in clip_text.RESISC45_FOLDERS for i in ids]
             for split, ids in (("train", (1, 2)), ("val", (3,)), ("test", (4,)))}
    for split, names in lists.items():
        (folder / f"resisc45-{split}.txt").write_bytes(_text(names))
    return {"train": len(lists["train"]), "test": len(lists["test"]), "files": files}


def _sun397_category(folder_name: str) -> str:
    """Our folder name back to SUN397's path: 'a_apartment_building_outdoor' -> 'a/apartment_building/outdoor'."""
    category = next(c for c in clip_text.SUN397_CATEGORIES if f"{c[0]}_{c.replace('/', '_')}" == folder_name)
    return f"{category[0]}/{category}"


def _sun397_archives(folder: Path) -> dict:
    """SUN397.tar.gz: SUN397/<letter>/<category path>/sun_<id>.jpg; Partitions.zip: Partitions/
    Training_<k>.txt and Testing_<k>.txt listing '/<letter>/<category path>/sun_<id>.jpg'."""
    files, lists = {"SUN397/ClassName.txt": b"/a/abbey\n"}, {}
    for c, folder_name in enumerate(SUN397_FOLDERS):
        path = _sun397_category(folder_name)
        images = [f"/{path}/sun_{c:03d}{letter}.jpg" for letter in "abc"]
        for i, image in enumerate(images):
            files[f"SUN397{image}"] = _jpeg(c + i)
        for split, chosen in (("Training_01", images[:1]), ("Testing_01", images[1:2]),
                              ("Training_02", images[2:]), ("Testing_02", images[:1])):
            lists.setdefault(split, []).extend(chosen)
    _tar(folder / "SUN397.tar.gz", files)
    _zip(folder / "Partitions.zip", {f"Partitions/{name}.txt": _text(lines) for name, lines in lists.items()}
         | {"Partitions/ClassName.txt": b"/a/abbey\n"})
    return {"train": len(lists["Training_01"]), "test": len(lists["Testing_01"]), "files": files}


def _cars_archives(folder: Path) -> dict:
    """The Stanford Cars files: cars_train.tgz (cars_train/00001.jpg ...), cars_test.tgz, car_devkit.tgz
    (devkit/cars_meta.mat, ...) and cars_test_annos_withlabels.mat."""
    train = {f"cars_train/{i:05d}.jpg": _jpeg(i) for i in range(1, 8)}
    test = {f"cars_test/{i:05d}.jpg": _jpeg(i + 3) for i in range(1, 6)}
    devkit = {f"devkit/{name}": b"MATLAB 5.0 MAT-file (not read)"
              for name in ("cars_meta.mat", "cars_train_annos.mat", "cars_test_annos.mat", "eval_train.m", "README.txt")}
    _tar(folder / "cars_train.tgz", train)
    _tar(folder / "cars_test.tgz", test)
    _tar(folder / "car_devkit.tgz", devkit)
    (folder / "cars_test_annos_withlabels.mat").write_bytes(b"MATLAB 5.0 MAT-file (labels)")
    return {"train": len(train), "test": len(test), "files": train | test | devkit}


def _fer_archive(folder: Path) -> dict:
    """Kaggle's challenge zip: example_submission.csv, fer2013.tar.gz (fer2013/fer2013.csv, README,
    fer2013.bib), icml_face_data.csv, test.csv, train.csv."""
    usages = ["Training"] * 6 + ["PublicTest"] * 2 + ["PrivateTest"] * 3
    pixels = " ".join(["7"] * 48 * 48)
    csv_bytes = _text(["emotion,pixels,Usage", *(f"{i % 7},{pixels},{usage}" for i, usage in enumerate(usages))])
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w:gz") as archive:
        for name, data in (("fer2013/fer2013.csv", csv_bytes), ("fer2013/README", b"readme")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    _zip(folder / "challenges-in-representation-learning-facial-expression-recognition-challenge.zip", {
        "example_submission.csv": b"Id,Emotion\n", "fer2013.tar.gz": inner.getvalue(),
        "icml_face_data.csv": _text(["emotion, Usage, pixels", f"0,Training,{pixels}"]),
        "test.csv": _text(["pixels", pixels]), "train.csv": _text(["emotion,pixels", f"0,{pixels}"]),
    })
    return {"train": usages.count("Training"), "test": len(usages) - usages.count("Training"), "csv": csv_bytes}


# ---------------------------------------------------------------------------------- running
def _prepare(capsys, root: Path, *args: str) -> tuple[int, list[str], str]:
    code = main(["data", "prepare", "--root", str(root), *args])
    captured = capsys.readouterr()
    return code, [line for line in captured.out.splitlines() if line.strip()], captured.err


def _check(capsys, root: Path, tasks) -> tuple[int, str]:
    code = main(["data", "check", "--root", str(root), "--tasks", *tasks])
    return code, capsys.readouterr().out


def _split_sizes(task: str, root: Path) -> dict[str, int]:
    """The sizes of the dataset each split is read from, as a run reads the prepared folder."""
    record = task_split_record(TASKS[task], str(root), 0)
    return {split: record[split]["source_size"] for split in ("train", "val", "test") if record[split]["from"] == split}


def _leftovers(root: Path) -> list[str]:
    return sorted(path.name for path in root.iterdir() if path.name.startswith("."))


FOLDER_TASKS = {"DTD": _dtd_archive, "EuroSAT": _eurosat_archive, "RESISC45": _resisc45_archive,
                "SUN397": _sun397_archives}


def test_the_four_folder_tasks_are_prepared_from_the_publishers_archives(tmp_path, capsys):
    archives, root = tmp_path / "downloads", tmp_path / "data"
    archives.mkdir()
    expected = {name: make(archives) for name, make in FOLDER_TASKS.items()}
    code, lines, err = _prepare(capsys, root, "--archives", str(archives), "--tasks", *FOLDER_TASKS)
    assert code == 0, (lines, err)
    assert len(lines) == len(FOLDER_TASKS)  # one line per task
    code, table = _check(capsys, root, FOLDER_TASKS)
    assert code == 0, table
    assert "4 of 4 tasks found" in table
    for name, sizes in expected.items():
        line = next(line for line in lines if line.startswith(f"{name}: "))
        assert line.startswith(f"{name}: prepared: "), line
        read = _split_sizes(name, root)
        assert read["train"] == sizes["train"] and read["test"] == sizes["test"], (name, read, sizes)
        if "val" in sizes:
            assert read["val"] == sizes["val"]
        assert f"train {sizes['train']:,}" in line and f"{sizes['test']:,}" in line, line
    assert _leftovers(root) == []
    # DTD: partition 1 exactly, byte for byte (partition 2 would put other images in each folder)
    dtd = expected["DTD"]
    for placed, member in dtd["placed"].items():
        assert (root / placed).read_bytes() == dtd["files"][member]
    assert sum(1 for p in (root / "dtd").rglob("*") if p.is_file()) == len(dtd["placed"])
    # SUN397: partition 1, in task_vectors' folder names
    abbey = "a_abbey"
    assert [p.name for p in (root / "sun397" / "train" / abbey).iterdir()] == [f"sun_{SUN397_FOLDERS.index(abbey):03d}a.jpg"]
    assert (root / "sun397" / "val" / "a_apartment_building_outdoor").is_dir()
    # RESISC45: all images in class folders, the lists beside them
    assert (root / "resisc45" / "resisc45-test.txt").read_bytes() == (archives / "resisc45-test.txt").read_bytes()


def test_eurosat_holds_out_270_images_per_class_reproducibly(tmp_path, capsys):
    archives = tmp_path / "downloads"
    archives.mkdir()
    made = _eurosat_archive(archives, name="EuroSAT_RGB.zip", top="EuroSAT_RGB")  # the Zenodo release's name
    listings = []
    for copy in ("one", "two"):
        code, lines, err = _prepare(capsys, tmp_path / copy, "--archives", str(archives), "--tasks", "EuroSAT")
        assert code == 0, (lines, err)
        listings.append(sorted(str(p.relative_to(tmp_path / copy)) for p in (tmp_path / copy).rglob("*.jpg")))
    assert listings[0] == listings[1]  # the same images in the same splits every time
    splits = tmp_path / "one" / "EuroSAT_splits"
    for cls in clip_text.EUROSAT_FOLDERS:
        names = {split: {p.name for p in (splits / split / cls).iterdir()} for split in ("train", "val", "test")}
        assert [len(names[s]) for s in ("train", "val", "test")] == [EUROSAT_PER_CLASS - 540, 270, 270]
        assert names["train"] | names["val"] | names["test"] == {f"{cls}_{n}.jpg" for n in range(1, EUROSAT_PER_CLASS + 1)}
        member = f"EuroSAT_RGB/{cls}/{sorted(names['val'])[0]}"
        assert (splits / "val" / cls / sorted(names["val"])[0]).read_bytes() == made["files"][member]


def test_cars_and_fer2013_are_laid_out_as_torchvision_reads_them(tmp_path, capsys):
    cars = _cars_archives(tmp_path)
    fer = _fer_archive(tmp_path)
    code, lines, err = _prepare(capsys, tmp_path, "--tasks", "Cars", "FER2013")  # archives in the root itself
    assert code == 0, (lines, err)
    assert lines == [f"Cars: prepared: train {cars['train']}, test {cars['test']} -> {tmp_path / 'stanford_cars'}",
                     f"FER2013: prepared: train {fer['train']}, test {fer['test']} -> {tmp_path / 'fer2013'}"]
    code, table = _check(capsys, tmp_path, ["Cars", "FER2013"])
    assert code == 0, table
    assert (tmp_path / "fer2013" / "fer2013.csv").read_bytes() == fer["csv"]  # byte for byte: torchvision checks its md5
    for member, data in cars["files"].items():
        assert (tmp_path / "stanford_cars" / member).read_bytes() == data


def test_a_prepared_folder_is_kept_and_a_partial_one_replaced_only_when_asked(tmp_path, capsys):
    made = _dtd_archive(tmp_path)
    assert _prepare(capsys, tmp_path, "--tasks", "DTD")[0] == 0
    probe = tmp_path / "dtd" / "train" / "banded" / "banded_0001.jpg"
    probe.write_bytes(b"the user's own file")
    code, lines, _ = _prepare(capsys, tmp_path, "--tasks", "DTD")
    assert code == 0 and lines == [f"DTD: already there ({tmp_path / 'dtd'}; --overwrite prepares it again)"]
    assert probe.read_bytes() == b"the user's own file"
    for path in (tmp_path / "dtd" / "val" / "zigzagged").iterdir():  # now incomplete
        path.unlink()
    (tmp_path / "dtd" / "val" / "zigzagged").rmdir()
    code, lines, _ = _prepare(capsys, tmp_path, "--tasks", "DTD")
    assert code == 1 and len(lines) == 1 and "exists but is incomplete" in lines[0] and "--overwrite" in lines[0]
    assert probe.read_bytes() == b"the user's own file"
    code, lines, _ = _prepare(capsys, tmp_path, "--tasks", "DTD", "--overwrite")
    assert code == 0 and lines[0].startswith(f"DTD: prepared: train {made['train']}, test (in val/) {made['test']} -> ")
    assert probe.read_bytes() != b"the user's own file" and _check(capsys, tmp_path, ["DTD"])[0] == 0
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("task, make, archive", [
    ("DTD", _dtd_archive, "dtd-r1.0.1.tar.gz"),
    ("EuroSAT", _eurosat_archive, "EuroSAT.zip"),
    ("SUN397", _sun397_archives, "SUN397.tar.gz"),
])
def test_a_damaged_archive_is_one_line_and_leaves_nothing(tmp_path, capsys, task, make, archive):
    archives, root = tmp_path / "downloads", tmp_path / "data"
    archives.mkdir()
    make(archives)
    data = (archives / archive).read_bytes()
    (archives / archive).write_bytes(data[: len(data) // 2])  # a download cut off half way
    code, lines, err = _prepare(capsys, root, "--archives", str(archives), "--tasks", task)
    assert code != 0
    assert len(lines) == 1 and lines[0].startswith(f"{task}: {archives / archive}: "), lines
    assert "damaged or incomplete" in lines[0] and "download it again from http" in lines[0]
    assert not root.exists() or list(root.iterdir()) == []  # no folder, no temporary


def test_a_missing_archive_names_the_file_and_its_source(tmp_path, capsys):
    _sun397_archives(tmp_path)
    (tmp_path / "Partitions.zip").unlink()
    code, lines, _ = _prepare(capsys, tmp_path, "--tasks", "SUN397", "RESISC45")
    assert code == 1
    assert lines[0] == (f"SUN397: missing Partitions.zip (from https://vision.princeton.edu/projects/2010/SUN/download/"
                        f"Partitions.zip) in {tmp_path}")
    assert lines[1].startswith("RESISC45: missing NWPU-RESISC45.rar or NWPU-RESISC45.zip (from ")
    assert "resisc45-train.txt (from https://storage.googleapis.com/remote_sensing_representations/resisc45-train.txt)" in lines[1]
    assert not (tmp_path / "sun397").exists() and _leftovers(tmp_path) == []


def test_an_archive_without_the_listed_images_is_one_line(tmp_path, capsys):
    made = _resisc45_archive(tmp_path)
    files = {name: data for name, data in made["files"].items() if not name.endswith("/sea_ice_004.jpg")}
    _zip(tmp_path / "NWPU-RESISC45.zip", files)  # a copy that lost one test image
    code, lines, _ = _prepare(capsys, tmp_path, "--tasks", "RESISC45")
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith(f"RESISC45: {tmp_path / 'NWPU-RESISC45.zip'}: 1 images listed in resisc45-test.txt "
                               f"are not in the archive (e.g. sea_ice_004.jpg)")
    assert not (tmp_path / "resisc45").exists() and _leftovers(tmp_path) == []


def test_tasks_torchvision_downloads_are_named_not_prepared(tmp_path, capsys):
    code, lines, _ = _prepare(capsys, tmp_path, "--tasks", "MNIST")
    assert code == 1 and len(lines) == 1 and lines[0].startswith("MNIST: missing; torchvision downloads it: add --download")


@pytest.mark.parametrize("args, message", [
    (["--archives", "NOWHERE"], "--archives"),
    (["--tasks", "Nope"], "unknown task 'Nope'"),
    ([], "--root"),  # the archives are looked for in the root, which does not exist
])
def test_wrong_arguments_are_one_line_before_any_work(tmp_path, capsys, args, message):
    _dtd_archive(tmp_path)
    args = [a.replace("NOWHERE", str(tmp_path / "nowhere")) for a in args]
    code = main(["data", "prepare", "--root", str(tmp_path / "data"), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "data").exists()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def web_site(tmp_path):
    """A local HTTP server for a folder: a real download through torchvision's downloader."""
    site = tmp_path / "site"
    site.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield site, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_download_fetches_the_archive_with_its_checksum_then_prepares(tmp_path, capsys, monkeypatch, web_site):
    site, address = web_site
    made = _dtd_archive(site)
    data = (site / "dtd-r1.0.1.tar.gz").read_bytes()
    recipe = prepare.RECIPES["DTD"]
    archives, root = tmp_path / "downloads", tmp_path / "data"

    def serve(md5: str) -> None:
        item = replace(recipe.inputs[0], fetch=f"{address}/dtd-r1.0.1.tar.gz", md5=md5)
        monkeypatch.setitem(prepare.RECIPES, "DTD", replace(recipe, inputs=(item,)))

    serve("0" * 32)  # a checksum the file does not have: nothing is kept
    code, lines, _ = _prepare(capsys, root, "--archives", str(archives), "--tasks", "DTD", "--download")
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith(f"DTD: download of dtd-r1.0.1.tar.gz from {address}/dtd-r1.0.1.tar.gz failed")
    assert list(archives.iterdir()) == [] and not root.exists()
    serve(hashlib.md5(data).hexdigest())
    code, lines, _ = _prepare(capsys, root, "--archives", str(archives), "--tasks", "DTD", "--download")
    assert code == 0 and lines[0].startswith(f"DTD: prepared: train {made['train']}, test (in val/) {made['test']} -> ")
    assert [p.name for p in archives.iterdir()] == ["dtd-r1.0.1.tar.gz"]
    assert (archives / "dtd-r1.0.1.tar.gz").read_bytes() == data
    assert _split_sizes("DTD", root) == {"train": made["train"], "test": made["test"]}
