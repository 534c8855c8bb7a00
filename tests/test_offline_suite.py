"""The offline suite: real MNIST / Fashion-MNIST / digits files, the ImageNet MobileNetV2 mapped into
an open_clip CLIP, linear-probe heads, and a short fit of configs/offline.yaml."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mima.data import offline
from mima.errors import MimaError
from mima.models import mobilenet
from mima.models.heads import fit_linear_probe

ROOT = Path(__file__).resolve().parents[1]


def _assets_missing() -> str | None:
    try:
        mobilenet.weights_path()
        offline.mnist_splits()
        offline.fashion_mnist_splits()
    except MimaError as exc:
        return str(exc)
    return None


needs_assets = pytest.mark.skipif(_assets_missing() is not None, reason=f"offline assets: {_assets_missing()}")


@needs_assets
def test_mapped_mobilenet_computes_the_same_features_as_torchvision():
    """timm's tower holding the mapped weights agrees with torchvision's own MobileNetV2 (an
    independent implementation) loaded with the original file."""
    from torchvision.models import mobilenet_v2

    from mima.models.clip import load_clip

    reference = mobilenet_v2()
    reference.load_state_dict(torch.load(mobilenet.weights_path(), map_location="cpu", weights_only=True))
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


@needs_assets
def test_real_sources_have_the_published_sizes_and_splits_are_disjoint():
    mnist, fashion = offline.mnist_splits(), offline.fashion_mnist_splits()
    for raw in (mnist, fashion):
        assert raw["train"][0].shape == (60000, 28, 28) and raw["test"][0].shape == (10000, 28, 28)
        assert raw["train"][0].dtype == np.uint8 and raw["train"][0].max() == 255
        assert np.bincount(raw["test"][1]).tolist() == [np.sum(raw["test"][1] == c) for c in range(10)]
        assert sorted(set(raw["train"][1].tolist())) == list(range(10))
    index = offline.suite_split_indices(60000, 10000, split_seed=0)
    assert len(index["val"]) == offline.VAL_SIZE and len(index["train"]) == 60000 - offline.VAL_SIZE
    assert not set(index["train"]) & set(index["val"])
    assert len(index["test"]) == offline.TEST_SIZE and len(set(index["test"])) == offline.TEST_SIZE
    again = offline.suite_split_indices(60000, 10000, split_seed=0)
    assert all(np.array_equal(index[k], again[k]) for k in index)
    assert not np.array_equal(index["val"], offline.suite_split_indices(60000, 10000, split_seed=1)["val"])


@needs_assets
def test_rotated_task_is_the_rotated_image_through_the_model_transform():
    from torchvision import transforms

    preprocess = transforms.ToTensor()
    from mima.data.tasks import LoadOptions

    options = LoadOptions(preprocess=preprocess)
    upright, rotated = offline.TASKS["mnist"].load(options), offline.TASKS["mnist_rot90"].load(options)
    image, label = upright.test[7]
    turned, same_label = rotated.test[7]
    assert label == same_label and image.shape == (3, 28, 28)
    torch.testing.assert_close(turned, torch.rot90(image, k=1, dims=(1, 2)))


def test_linear_probe_head_matches_scikit_learn_predictions():
    from sklearn.linear_model import LogisticRegression

    generator = torch.Generator().manual_seed(0)
    centers = torch.randn(4, 16, generator=generator)
    labels = torch.arange(200) % 4
    features = torch.nn.functional.normalize(centers[labels] + 0.8 * torch.randn(200, 16, generator=generator), dim=1)
    head = fit_linear_probe(features, labels, num_classes=5)  # class 4 has no examples
    assert head.shape == (5, 16) and torch.equal(head[4], torch.zeros(16))
    reference = LogisticRegression(C=10.0, fit_intercept=False, max_iter=2000, tol=1e-6).fit(features.double(), labels)
    predicted = (features @ head.T).argmax(dim=1)
    assert predicted.tolist() == reference.predict(features.double()).tolist()
    assert (predicted == labels).float().mean() > 0.9
    # two classes: scikit-learn keeps one row; the head must give the same decisions
    two = labels < 2
    binary = fit_linear_probe(features[two], labels[two], num_classes=2)
    reference = LogisticRegression(C=10.0, fit_intercept=False, max_iter=2000, tol=1e-6).fit(features[two].double(), labels[two])
    assert (features[two] @ binary.T).argmax(1).tolist() == reference.predict(features[two].double()).tolist()


@needs_assets
def test_offline_config_fits_with_probe_heads_and_frozen_statistics(tmp_path):
    """configs/offline.yaml, cut to two tasks and a few steps: heads are the probes the context
    builds, BatchNorm statistics stay theta_0's, and the task models moved."""
    from mima.merging.context import context_from_config
    from mima.run_dir import RunFolder
    from mima.training.trainer import run_fit

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
    context = context_from_config(tmp_path / "run")
    accuracy = context.evaluator("test").accuracy(base)
    assert set(accuracy) == {"digits", "mnist"} and min(accuracy.values()) > 0.5  # probes far above chance (10%)
