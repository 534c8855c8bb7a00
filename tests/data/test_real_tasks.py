"""The clip suite's benchmark tasks on small fake on-disk layouts, and `mima data check`.

Every folder-read task (DTD, EuroSAT, RESISC45, SUN397) and a few torchvision-read ones (MNIST,
GTSRB, RenderedSST2) are loaded from tiny files written here in the layout each expects; nothing
is downloaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import Subset

from mima.cli import main
from mima.data import clip_text
from mima.data.clip_tasks import BENCHMARKS, GTSRB_FOLDERS, SUN397_FOLDERS, TASKS
from mima.data.datamodule import TaskSuiteDataModule
from mima.data.registry import DEFAULT_TASKS, SUITES
from mima.data.splits import validation_size
from mima.data.tasks import LoadOptions
from mima.core.errors import MimaError
from tests.helpers import FOLDER_TASKS, class_tree, fake_mnist, tiny_image

SIZE = 8  # loader tests use the fallback transform at this size (no model)


def _load(name: str, root: Path, split_seed: int = 0):
    return TASKS[name].load(LoadOptions(root=str(root), image_size=SIZE, split_seed=split_seed))


def _labels(dataset) -> list[int]:
    return [int(dataset[i][1]) for i in range(len(dataset))]


def _assert_carved(first, second, num_train: int) -> None:
    """Validation carved from the training split: 10% (<= 5000), fixed seed, disjoint from train."""
    assert isinstance(first.val, Subset) and isinstance(first.train, Subset)
    assert first.val.dataset is first.train.dataset
    assert len(first.val) == validation_size(num_train) and len(first.train) + len(first.val) == num_train
    assert not set(first.val.indices) & set(first.train.indices)
    assert first.val.indices == second.val.indices and first.train.indices == second.train.indices


# ------------------------------------------------------------------------------- the registry
def test_clip_suite_lists_the_benchmarks_with_heads_for_every_task():
    assert [len(BENCHMARKS[k]) for k in ("8", "14", "20")] == [8, 14, 20]
    assert BENCHMARKS["8"] == ("Cars", "DTD", "EuroSAT", "GTSRB", "MNIST", "RESISC45", "SUN397", "SVHN")
    assert BENCHMARKS["20"][:14] == BENCHMARKS["14"] and BENCHMARKS["14"][:8] == BENCHMARKS["8"]
    assert len(set(BENCHMARKS["20"])) == 20 and set(SUITES["clip"]) == set(BENCHMARKS["20"])
    assert DEFAULT_TASKS["clip"] == BENCHMARKS["8"]
    expected_classes = {"Cars": 196, "DTD": 47, "EuroSAT": 10, "GTSRB": 43, "MNIST": 10, "RESISC45": 45, "SUN397": 397,
                        "SVHN": 10, "CIFAR100": 100, "Flowers102": 102, "OxfordIIITPet": 37, "Food101": 101, "PCAM": 2,
                        "FER2013": 7, "STL10": 10, "RenderedSST2": 2}
    for name, spec in SUITES["clip"].items():
        assert spec.templates and all(t.count("{}") == 1 for t in spec.templates), name
        assert len(set(spec.classnames)) == len(spec.classnames) == expected_classes.get(name, 10), name
    # SUN397 class names follow task_vectors' rule on the folder names
    assert SUITES["clip"]["SUN397"].classnames[SUN397_FOLDERS.index("a_apartment_building_outdoor")] == "apartment building outdoor"


# ------------------------------------------------------------------ folder-read tasks (all four)
# (their fake layouts: tests/helpers.py, FOLDER_TASKS)
@pytest.mark.parametrize("name", list(FOLDER_TASKS))
def test_folder_tasks_load_with_the_right_classes_splits_and_labels(tmp_path, name):
    expected = FOLDER_TASKS[name](tmp_path)
    first, second = _load(name, tmp_path), _load(name, tmp_path)
    spec = TASKS[name]
    if "val" in expected:  # EuroSAT: its val folder is the validation split (task_vectors' EuroSATVal)
        assert (len(first.train), len(first.val)) == (expected["train"], expected["val"])
    else:
        _assert_carved(first, second, expected["train"])
    assert len(first.test) == expected["test"]
    image, label = first.test[0]
    assert image.shape == (3, SIZE, SIZE) and image.dtype == torch.float32 and isinstance(label, int)
    assert set(_labels(first.test)) == set(range(spec.num_classes))  # every class, labels in range
    # one known file: its label names the class of the folder it is in
    probe, classname = expected["probe"]
    samples = first.test.samples
    position = [path for path, _ in samples].index(str(tmp_path / probe))
    assert spec.classnames[samples[position][1]] == classname
    # another split seed gives another validation set
    if "val" not in expected:
        assert _load(name, tmp_path, split_seed=1).val.indices != first.val.indices


def test_folder_task_rejects_an_unknown_class_folder_and_missing_classes(tmp_path):
    FOLDER_TASKS["DTD"](tmp_path)
    tiny_image(tmp_path / "dtd" / "val" / "plaid" / "000.png", seed=1)
    with pytest.raises(MimaError, match=r"DTD \(test\): folder 'plaid' .* is not one of the task's 47 classes"):
        _load("DTD", tmp_path)
    for folder in (tmp_path / "dtd" / "val" / "plaid", tmp_path / "dtd" / "train" / "zigzagged"):
        for file in folder.iterdir():
            file.unlink()
        folder.rmdir()
    with pytest.raises(MimaError, match=r"task DTD incomplete \(missing dtd/train/ \(1 of 47 class folders missing, e.g. zigzagged/\)\)"):
        _load("DTD", tmp_path)


# ------------------------------------------------------------------ torchvision-read tasks
def test_mnist_reads_idx_files_as_rgb_with_a_deterministic_validation_split(tmp_path):
    fake_mnist(tmp_path)
    first, second = _load("MNIST", tmp_path), _load("MNIST", tmp_path)
    _assert_carved(first, second, 60)
    assert len(first.test) == 20 and _labels(first.test) == [i % 10 for i in range(20)]
    image, _ = first.train[0]
    assert image.shape == (3, SIZE, SIZE)  # grayscale made RGB for the CLIP tower
    torch.testing.assert_close(image[0], image[2])


def test_gtsrb_reads_torchvision_layout(tmp_path):
    base = tmp_path / "gtsrb"
    for label, folder in enumerate(GTSRB_FOLDERS):
        tiny_image(base / "GTSRB" / "Training" / folder / f"{label:05d}_00000.ppm", seed=label)
    rows = ["Filename;Width;Height;Roi.X1;Roi.Y1;Roi.X2;Roi.Y2;ClassId"]
    for i, label in enumerate((0, 42, 7)):
        tiny_image(base / "GTSRB" / "Final_Test" / "Images" / f"{i:05d}.ppm", seed=100 + i)
        rows.append(f"{i:05d}.ppm;6;6;0;0;5;5;{label}")
    (base / "GT-final_test.csv").write_text("\n".join(rows) + "\n")
    data = _load("GTSRB", tmp_path)
    assert len(data.train) + len(data.val) == 43 and len(data.val) == 4
    assert sorted(_labels(data.train) + _labels(data.val)) == list(range(43))
    assert _labels(data.test) == [0, 42, 7] and data.test[0][0].shape == (3, SIZE, SIZE)


def test_rendered_sst2_reads_torchvision_layout(tmp_path):
    base = tmp_path / "RenderedSST2" / "rendered-sst2"
    class_tree(base / "train", ("negative", "positive"), 10)
    class_tree(base / "test", ("negative", "positive"), 3, start=50)
    data = _load("RenderedSST2", tmp_path)
    assert (len(data.train), len(data.val), len(data.test)) == (18, 2, 6)
    assert _labels(data.test) == [0, 0, 0, 1, 1, 1]


# ---------------------------------------------------------------------- missing data: one line
def test_missing_data_is_one_clear_error_naming_task_root_and_layout(tmp_path):
    with pytest.raises(MimaError) as caught:
        _load("SUN397", tmp_path)
    message = str(caught.value)
    assert "\n" not in message
    for fragment in (f"task SUN397 not found under {tmp_path}; expected: sun397/train/<class>/ (397 class folders",
                     "sun397/val/", "mima data check --root", "source: https://vision.princeton.edu/"):
        assert fragment in message, message
    with pytest.raises(MimaError, match="data.download: true"):  # torchvision could fetch MNIST
        _load("MNIST", tmp_path)
    with pytest.raises(MimaError, match="data.root: task Cars is read from disk"):
        TASKS["Cars"].load(LoadOptions(root=None))


def test_a_run_with_missing_benchmark_files_stops_before_anything_starts(tmp_path, small_clip, capsys):
    with pytest.raises(MimaError, match="task GTSRB not found under"):
        TaskSuiteDataModule(suite="clip", tasks=["GTSRB"], root=str(tmp_path))
    TaskSuiteDataModule(suite="clip", tasks=["GTSRB"], root=str(tmp_path), download=True)  # torchvision would fetch it
    with pytest.raises(MimaError, match="task DTD not found under"):
        TaskSuiteDataModule(suite="clip", tasks=["DTD"], root=str(tmp_path), download=True)  # ... but not DTD
    run = tmp_path / "run"
    code = main(["fit", "--model.clip", small_clip, "--model.steps", "2", "--model.iterations", "1", "--data.suite", "clip",
                 "--data.tasks", '["MNIST"]', "--data.root", str(tmp_path), "--trainer.accelerator", "cpu", "--out", str(run)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "mima fit: error: data.root: task MNIST not found" in err, err
    assert not run.exists()


def test_unreadable_files_are_reported_without_a_traceback(tmp_path):
    for split in ("train", "t10k"):  # present but not idx files
        for kind in ("images-idx3", "labels-idx1"):
            path = tmp_path / "MNIST" / "raw" / f"{split}-{kind}-ubyte"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"not an idx file")
    with pytest.raises(MimaError, match=r"task MNIST: could not read its files under"):
        _load("MNIST", tmp_path)


# ------------------------------------------------------------------------------ mima data check
def _check(argv, capsys) -> tuple[int, str, str]:
    code = main(["data", "check", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _row(out: str, task: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.startswith(task + " "))


def test_data_check_on_an_empty_root_lists_every_task_as_missing(tmp_path, capsys):
    code, out, err = _check(["--root", tmp_path], capsys)
    assert code == 1 and err == ""
    for name in BENCHMARKS["20"]:
        assert _row(out, name)[1] == "missing", name
    assert "0 of 20 tasks found" in out
    assert "stanford_cars/cars_train/ (training images)" in out and "sun397/val/<class>/" in out
    assert "mima data check --root" in out and "--download" in out  # how to fetch what torchvision can
    assert "DTD: https://www.robots.ox.ac.uk/~vgg/data/dtd/" in out  # where the manual ones come from


def test_data_check_on_a_partial_root_says_what_is_missing(tmp_path, capsys):
    fake_mnist(tmp_path, train=2, test=2)
    (tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    FOLDER_TASKS["EuroSAT"](tmp_path)
    for name in clip_text.DTD[:5]:
        (tmp_path / "dtd" / "train" / name).mkdir(parents=True)
    code, out, _ = _check(["--root", tmp_path, "--benchmark", "8"], capsys)
    assert code == 1
    assert _row(out, "EuroSAT")[1] == "found" and _row(out, "Cars")[1] == "missing"
    assert _row(out, "MNIST")[1] == "partial" and _row(out, "DTD")[1] == "partial"
    mnist = [line for line in out.splitlines() if "MNIST/raw/" in line]
    assert [line.split()[-4] for line in mnist] == ["ok", "ok", "ok", "missing"]
    assert mnist[-1].split()[-3] == "MNIST/raw/t10k-labels-idx1-ubyte"
    dtd = next(line for line in out.splitlines() if "dtd/train/" in line)
    assert dtd.split()[2:4] == ["incomplete", "dtd/train/<class>/"], dtd
    assert dtd.endswith("[42 of 47 class folders missing, e.g. chequered/]"), dtd
    assert "1 of 8 tasks found" in out and "missing or partial: Cars, DTD, GTSRB, MNIST, RESISC45, SUN397, SVHN" in out


def test_data_check_exits_0_when_the_tasks_are_there(tmp_path, capsys):
    fake_mnist(tmp_path, train=2, test=2)
    code, out, _ = _check(["--root", tmp_path, "--tasks", "MNIST"], capsys)
    assert code == 0 and _row(out, "MNIST")[1] == "found" and "1 of 1 tasks found" in out


@pytest.mark.parametrize("argv, fragment", [
    (["--root", "R", "--tasks", "Imagenet"], "--tasks: unknown task 'Imagenet' (clip suite tasks: Cars, DTD"),
    (["--root", "R", "--benchmark", "12"], "--benchmark: invalid choice: '12'"),
    (["--tasks", "MNIST"], "the following arguments are required: --root"),
])
def test_data_check_usage_errors_are_one_line(capsys, argv, fragment):
    code, _, err = _check(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err


def test_mima_entry_point_runs_data_check(tmp_path):
    fake_mnist(tmp_path, train=2, test=2)
    script = Path(sys.executable).with_name("mima")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "mima"]
    result = subprocess.run([*command, "data", "check", "--root", str(tmp_path), "--tasks", "MNIST", "SVHN"],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 1, result.stderr
    assert _row(result.stdout, "MNIST")[1] == "found" and _row(result.stdout, "SVHN")[1] == "missing"
    assert "svhn/train_32x32.mat" in result.stdout and "1 of 2 tasks found" in result.stdout


def test_synthetic_suite_is_seeded_sized_and_cycles_its_pool():
    from mima.data.registry import resolve_tasks
    from mima.data.synthetic import POOL_SIZE
    from mima.data.tasks import LoadOptions

    spec_a, spec_b = resolve_tasks("synthetic", ["synthetic_a", "synthetic_b"])
    first, again = spec_a.load(LoadOptions(image_size=32)), spec_a.load(LoadOptions(image_size=32))
    image, label = first.train[3]
    assert image.shape == (3, 32, 32) and image.min() >= -1 and image.max() <= 1 and 0 <= int(label) < 10
    assert torch.equal(image, again.train[3][0])  # the same seed gives the same pool
    assert torch.equal(image, first.train[3 + POOL_SIZE][0])  # long splits cycle the pool
    assert not torch.equal(image, spec_b.load(LoadOptions(image_size=32)).train[3][0])  # tasks differ
