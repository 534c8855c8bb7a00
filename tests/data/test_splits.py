"""`mima data splits` and the split rule: validation carved as task_vectors carves it.

task_vectors (src/datasets/registry.py, `split_train_into_train_val`) splits a training set of n
examples with `torch.utils.data.random_split(train, [n - v, v], generator=torch.Generator().manual_seed(0))`,
v = min(int(0.1 n), 5000). Every expected split below is computed with `random_split` itself, on
fake roots in each dataset's on-disk format, and compared with the JSON files the command writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image
from torch.utils.data import random_split
from torchvision.datasets import ImageFolder

from mima.cli import main
from mima.data import digits
from mima.data.clip_tasks import GTSRB_FOLDERS
from tests.helpers import FOLDER_TASKS, class_tree, fake_mnist, tiny_image


def _task_vectors_split(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """(train, val) indices as task_vectors' split_train_into_train_val makes them."""
    val_size = min(int(n * 0.1), 5000)
    train, val = random_split(range(n), [n - val_size, val_size], generator=torch.Generator().manual_seed(seed))
    return list(train.indices), list(val.indices)


def _splits(tmp_path: Path, data: dict, capsys, name: str = "c") -> dict[str, dict]:
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({"model": {"clip": "embedded:tiny-digits"}, "data": data}))
    out = tmp_path / f"{name}-splits"
    code = main(["data", "splits", "--config", str(config), "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return {path.stem: json.loads(path.read_text()) for path in sorted(out.glob("*.json"))}


def _assert_task_vectors_carve(record: dict, num_train: int) -> None:
    train, val = _task_vectors_split(num_train)
    assert record["train"]["from"] == record["val"]["from"] == "train"
    assert record["train"]["source_size"] == num_train
    assert record["train"]["indices"] == train and record["val"]["indices"] == val


def test_mnist_validation_is_the_tail_of_task_vectors_random_split(tmp_path, capsys):
    fake_mnist(tmp_path, train=60000, test=100)
    records = _splits(tmp_path, {"suite": "clip", "tasks": ["MNIST"], "root": str(tmp_path)}, capsys)
    record = records["MNIST"]
    _assert_task_vectors_carve(record, 60000)
    assert record["train"]["size"] == 55000 and record["val"]["size"] == 5000
    assert record["train"]["indices"][0] == 36044  # task_vectors' own assertion for MNISTVal
    assert record["test"] == {"from": "test", "source_size": 100, "size": 100, "indices": list(range(100))}
    assert record["split_seed"] == 0


def _fake_gtsrb(root: Path) -> dict:
    base = root / "gtsrb"
    for label, folder in enumerate(GTSRB_FOLDERS):
        for i in range(3):
            tiny_image(base / "GTSRB" / "Training" / folder / f"{label:05d}_{i:05d}.ppm", seed=10 * label + i)
    rows = ["Filename;Width;Height;Roi.X1;Roi.Y1;Roi.X2;Roi.Y2;ClassId"]
    for i, label in enumerate((0, 42, 7)):
        tiny_image(base / "GTSRB" / "Final_Test" / "Images" / f"{i:05d}.ppm", seed=1000 + i)
        rows.append(f"{i:05d}.ppm;6;6;0;0;5;5;{label}")
    (base / "GT-final_test.csv").write_text("\n".join(rows) + "\n")
    return {"train": 129, "test": 3}


def _fake_sst2(root: Path) -> dict:
    base = root / "RenderedSST2" / "rendered-sst2"
    class_tree(base / "train", ("negative", "positive"), 25)
    class_tree(base / "test", ("negative", "positive"), 3, start=50)
    return {"train": 50, "test": 6}


def _fake_small_mnist(root: Path) -> dict:
    fake_mnist(root, train=60, test=20)
    return {"train": 60, "test": 20}


FAKE_ROOTS = {**FOLDER_TASKS, "GTSRB": _fake_gtsrb, "RenderedSST2": _fake_sst2, "MNIST": _fake_small_mnist}
# the folder that torchvision's ImageFolder lists as each folder-read task's training split
IMAGE_FOLDERS = {"DTD": "dtd/train", "EuroSAT": "EuroSAT_splits/train", "SUN397": "sun397/train",
                 "RESISC45": "resisc45/NWPU-RESISC45", "RenderedSST2": "RenderedSST2/rendered-sst2/train"}


def test_every_task_with_a_fake_root_is_split_by_the_task_vectors_rule(tmp_path, capsys):
    expected = {name: fake(tmp_path) for name, fake in FAKE_ROOTS.items()}
    records = _splits(tmp_path, {"suite": "clip", "tasks": list(FAKE_ROOTS), "root": str(tmp_path)}, capsys)
    assert sorted(records) == sorted(FAKE_ROOTS)
    for name, sizes in expected.items():
        record = records[name]
        if name == "EuroSAT":  # task_vectors' EuroSATVal: the val folder is the validation split
            assert record["train"]["indices"] == list(range(sizes["train"]))
            assert record["val"] == {"from": "val", "source_size": sizes["val"], "size": sizes["val"],
                                     "indices": list(range(sizes["val"]))}
        else:
            _assert_task_vectors_carve(record, sizes["train"])
        assert record["test"]["from"] == "test" and record["test"]["indices"] == list(range(sizes["test"])), name
    # indices are into torchvision ImageFolder's listing of the training folder (an independent listing)
    from mima.data.clip_tasks import TASKS
    from mima.data.tasks import LoadOptions

    for name, folder in IMAGE_FOLDERS.items():
        listing = ImageFolder(str(tmp_path / folder)).samples
        if name == "RESISC45":
            names = set((tmp_path / "resisc45" / "resisc45-train.txt").read_text().split())
            listing = [(path, label) for path, label in listing if Path(path).name in names]
        data = TASKS[name].load(LoadOptions(root=str(tmp_path), image_size=8))
        val = records[name]["val"]["indices"]
        if name != "EuroSAT":
            assert [int(data.val[i][1]) for i in range(len(val))] == [listing[j][1] for j in val], name


def test_custom_folders_hold_out_test_then_carve_validation_by_the_same_rule(tmp_path, capsys):
    for label, name in enumerate(("a_class", "b_class")):
        (tmp_path / "flat" / name).mkdir(parents=True)
        for i in range(40):
            Image.fromarray(np.full((5, 5, 3), 3 * i + label, np.uint8)).save(tmp_path / "flat" / name / f"{i:02d}.png")
    records = _splits(tmp_path, {"suite": None, "custom_tasks": [{"name": "flat", "path": str(tmp_path / "flat")}]}, capsys)
    record = records["flat"]
    test = record["test"]["indices"]
    assert record["test"]["from"] == "train" and len(test) == 16  # TEST_FRACTION of the 80 images
    rest = sorted(set(range(80)) - set(test))
    train, val = _task_vectors_split(len(rest))
    assert record["train"]["indices"] == [rest[i] for i in train]
    assert record["val"]["indices"] == [rest[i] for i in val] and len(val) == 6
    assert record["train"]["from"] == record["val"]["from"] == "train" and record["train"]["source_size"] == 80


def test_the_digits_demo_carves_validation_by_the_same_rule(tmp_path, capsys):
    records = _splits(tmp_path, {"suite": "digits", "tasks": ["rot90", "mirror"]}, capsys)
    test = records["rot90"]["test"]["indices"]
    rest = sorted(set(range(1797)) - set(test))
    train, val = _task_vectors_split(len(rest))
    assert len(test) == 539 and len(val) == 125 and len(train) == 1133
    assert records["rot90"]["train"]["indices"] == [rest[i] for i in train]
    assert records["rot90"]["val"]["indices"] == [rest[i] for i in val]
    assert records["mirror"]["val"] == records["rot90"]["val"]  # the splits are shared by the tasks
    # the loaded split holds those images (the upright digits are scikit-learn's own)
    from mima.data.tasks import LoadOptions

    data = digits.TASKS["upright"].load(LoadOptions(image_size=8))
    pixels, labels = digits.transformed_images("upright", 8)
    picked = records["rot90"]["val"]["indices"]
    assert torch.equal(torch.stack([data.val[i][0] for i in range(len(picked))]), pixels[picked])
    assert [int(data.val[i][1]) for i in range(len(picked))] == labels[picked].tolist()


def test_splits_of_a_root_without_the_files_is_a_one_line_error(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"clip": "embedded:tiny-digits"},
                                      "data": {"suite": "clip", "tasks": ["MNIST"], "root": str(tmp_path / "empty")}}))
    assert main(["data", "splits", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mima data splits: error: data.root: task MNIST not found" in err
    assert not (tmp_path / "out").exists()


def test_split_files_already_there_are_kept_unless_asked(tmp_path, capsys):
    first = _splits(tmp_path, {"suite": "digits", "tasks": ["rot90"]}, capsys)
    out = tmp_path / "c-splits"
    (out / "rot90.json").write_text("the user's own file\n")
    argv = ["data", "splits", "--config", str(tmp_path / "c.yaml"), "--out", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds rot90.json" in err[0] and "--overwrite" in err[0], err
    assert (out / "rot90.json").read_text() == "the user's own file\n"
    assert main([*argv, "--overwrite"]) == 0
    assert json.loads((out / "rot90.json").read_text()) == first["rot90"]
