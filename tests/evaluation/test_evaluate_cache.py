"""`mima evaluate --cache auto|on|off`: the decoded-image cache's evaluation path (whole uint8
batches read from the memory-mapped file, normalised on the device; several models per batch read)
against independent computations: open_clip's transform applied image by image, a hand loop over
plain tensors, and the image-folder path of the same run (the demo's digits tasks written as PNG
folders), whose results.json the cache must reproduce number for number."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torch.utils.data import Subset, TensorDataset

from mima.cli import main
from mima.commands.fit.run import run_fit
from mima.core.errors import MimaError
from mima.data import digits
from mima.data.cache_store import CachedSplit
from mima.data.datamodule import TaskSuiteDataModule
from mima.evaluation.accuracy import EvalSettings, TaskEvaluator, models_correct_images
from mima.evaluation.cache_use import CacheUse, cache_use
from mima.evaluation.cached_batches import CachedBatches
from mima.pools import task_pool
from tests.helpers import assert_one_line, cli, fit_config

SIZE = 12
DIGIT_TASKS = ("rot90", "mirror")  # two of the demo's four tasks


def _transform(size: int):
    from open_clip.transform import PreprocessCfg, image_transform_v2

    return image_transform_v2(PreprocessCfg(size=(size, size)), is_train=False)


def write_digit_folders(root: Path, tasks=DIGIT_TASKS, count: int | None = None) -> dict[str, Path]:
    """The demo's digits tasks as image folders (flat layout, one folder per class): each of
    scikit-learn's 8x8 digits under the task's transform, its 0..16 values as 8-bit grey PNGs."""
    from sklearn.datasets import load_digits

    bunch = load_digits()  # read here, as the digits tasks read it
    images, labels = bunch.images.astype(np.float32), bunch.target
    folders = {}
    for task in tasks:
        folders[task] = root / task
        for index, (image, label) in enumerate(zip(images[:count], labels[:count])):
            folder = folders[task] / digits.CLASSNAMES[label]
            folder.mkdir(parents=True, exist_ok=True)
            pixels = np.ascontiguousarray(digits.TRANSFORMS[task](image)) * 15.9375  # 16 -> 255
            Image.fromarray(pixels.round().astype(np.uint8)).save(folder / f"{index:04d}.png")
    return folders


def _folder_settings(folders: dict[str, Path], cache_dir: Path) -> dict:
    return {"suite": None, "batch_size": 16, "seed": 3, "cache_dir": str(cache_dir),
            "custom_tasks": [{"name": task, "path": str(path), "templates": list(digits.TEMPLATES)}
                             for task, path in folders.items()]}


# --------------------------------------------------------------------------------- the switch
def test_cache_modes_resolve_by_the_evaluation_device():
    assert cache_use("auto", "cuda") == CacheUse.WHERE_POSSIBLE
    assert cache_use("auto", "cpu") == CacheUse.OFF  # the CPU default: the evaluation as it always ran
    assert cache_use("on", "cpu") == CacheUse.EVERY_TASK and cache_use("on", "cuda") == CacheUse.EVERY_TASK
    assert cache_use("off", "cuda") == CacheUse.OFF
    assert CacheUse.OFF.models_per_pass == 1 and CacheUse.EVERY_TASK.models_per_pass > 1
    with pytest.raises(MimaError, match=r"^--cache yes: expected one of auto, on, off$"):
        cache_use("yes", "cpu")


def test_a_bad_cache_mode_is_one_line(capfd):
    outcome = cli(["evaluate", "runs/a", "--out", "o", "--cache", "yes"], capfd)
    assert_one_line(outcome.code, outcome.err, "--cache", "'yes'")


# ------------------------------------------------------------------------------- the batches
@pytest.fixture(scope="module")
def cached_folder(tmp_path_factory) -> tuple[CachedSplit, Subset]:
    """One digits task as PNGs: its test split from the cache, and the same split through open_clip's
    transform image by image (the per-item path, no cache)."""
    root = tmp_path_factory.mktemp("digit-pngs")
    folders = write_digit_folders(root, tasks=("rot90",), count=200)
    settings = _folder_settings(folders, root / "cache")
    preprocess = _transform(SIZE)
    cached = TaskSuiteDataModule(**settings, cache=True).task_data("rot90", SIZE, preprocess).test
    plain = TaskSuiteDataModule(**settings).task_data("rot90", SIZE, preprocess).test
    return cached, plain


@pytest.mark.parametrize("batch_size", [7, 64, 1000])
def test_cached_batches_equal_open_clips_transform_image_by_image(cached_folder, batch_size):
    cached, plain = cached_folder
    batches = list(CachedBatches(cached, None, batch_size, torch.device("cpu")))
    assert len(batches) == -(-len(plain) // batch_size) and all(len(images) <= batch_size for images, _ in batches)
    images = torch.cat([images for images, _ in batches])
    labels = torch.cat([labels for _, labels in batches])
    expected = torch.stack([plain[i][0] for i in range(len(plain))])
    assert images.dtype == torch.float32 and torch.equal(images, expected)  # the same float32 operations: equal
    assert labels.tolist() == [plain[i][1] for i in range(len(plain))]


def test_cached_batches_of_a_subset_read_its_indices_and_an_early_stop_ends_the_reader(cached_folder):
    cached, plain = cached_folder
    indices = [1, 2, 5, 17, 18, 30, 39]
    batches = CachedBatches(cached, np.asarray(indices), 3, torch.device("cpu"))
    images = torch.cat([images for images, _ in batches])
    assert torch.equal(images, torch.stack([plain[i][0] for i in indices]))
    passes = iter(CachedBatches(cached, None, 4, torch.device("cpu")))
    next(passes)
    passes.close()  # stopped after one batch (as a stop request between batches does)
    assert not [thread for thread in threading.enumerate() if thread.name == "mima-cached-batches"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cached_batches_made_on_a_gpu_equal_the_cpus(cached_folder):
    """The side stream's copy and the device's normalisation: IEEE float32 division and subtraction
    round the same on both (CUDA kernels are built without fast math)."""
    cached, plain = cached_folder
    gpu = torch.device("cuda", torch.cuda.current_device())
    batches = list(CachedBatches(cached, None, 16, gpu))
    assert all(images.device == gpu for images, _ in batches)
    assert torch.equal(torch.cat([images.cpu() for images, _ in batches]), torch.stack([plain[i][0] for i in range(len(plain))]))
    assert torch.cat([labels.cpu() for _, labels in batches]).tolist() == [plain[i][1] for i in range(len(plain))]


# ------------------------------------------------------------------------ several models per batch
def test_several_models_on_each_batch_give_each_models_own_hand_counted_record():
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Flatten(), nn.Linear(12, 6))
    models = [{key: torch.randn_like(value) for key, value in encoder.state_dict().items()} for _ in range(3)]
    head = torch.randn(4, 6)  # 4 classes of 6-dimensional features
    images, labels = torch.randn(50, 3, 2, 2), torch.randint(0, 4, (50,))
    batches = [(images[i:i + 16], labels[i:i + 16]) for i in range(0, 50, 16)]
    records = models_correct_images(encoder, head, batches, models)
    for model, record in zip(models, records):
        features = images.flatten(1) @ model["1.weight"].T + model["1.bias"]
        logits = (features / features.norm(dim=1, keepdim=True)) @ head.T  # cosine logits (argmax: any positive scale)
        hand = (logits.argmax(dim=1) == labels).numpy()
        assert record.dtype == bool and np.array_equal(record, hand)
    # an evaluator hears each (model, task) record once; a model that does not fit is refused before any batch
    evaluator = TaskEvaluator(encoder, {"t": head}, {"t": TensorDataset(images, labels)},
                              settings=EvalSettings(batch_size=16, cache=CacheUse.EVERY_TASK))
    heard = []
    evaluator.records_of_models(models, ["t"], on_record=lambda index, task, record: heard.append((index, task)))
    assert heard == [(0, "t"), (1, "t"), (2, "t")]
    with pytest.raises(RuntimeError, match="Missing key"):
        evaluator.records_of_models([models[0], {"1.weight": models[1]["1.weight"]}], ["t"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_compiled_encoder_on_a_gpu_gives_the_cpus_records_for_several_models():
    """The cache path on CUDA: the encoder compiled (one static shape: the last batch padded), each
    model's weights copied in before its pass over a batch; against the CPU's uncompiled records."""
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.GELU(), nn.Linear(6, 6))
    models = [{key: torch.randn_like(value) for key, value in encoder.state_dict().items()} for _ in range(3)]
    head, images, labels = torch.randn(4, 6), torch.randn(50, 3, 2, 2), torch.randint(0, 4, (50,))
    expected = models_correct_images(encoder, head, [(images, labels)], models)
    gpu = torch.device("cuda", torch.cuda.current_device())
    evaluator = TaskEvaluator(encoder.to(gpu), {"t": head}, {"t": TensorDataset(images, labels)},
                              settings=EvalSettings(batch_size=16, cache=CacheUse.EVERY_TASK))
    assert not isinstance(evaluator.forward(), nn.Sequential)  # compiled
    found = evaluator.records_of_models(models, ["t"])["t"]
    agree = [float(np.mean(a == b)) for a, b in zip(found, expected)]
    assert min(agree) >= 0.96, agree  # 50 images: at most 2 near-ties flipped by a fused kernel's rounding


# ------------------------------------------------------------------------------- task pools
def test_auto_leaves_the_demos_tensor_tasks_on_their_path_and_on_refuses_them(tmp_path, small_clip):
    config = fit_config(tmp_path / "run", small_clip, list(DIGIT_TASKS), steps=2, iterations=1)
    plain = task_pool(config)
    where_possible = task_pool(config, CacheUse.WHERE_POSSIBLE)
    for task in DIGIT_TASKS:
        for split in ("val", "test"):
            first, second = getattr(plain.splits[task], split), getattr(where_possible.splits[task], split)
            assert not isinstance(second, CachedSplit) and torch.equal(first[0][0], second[0][0])
    with pytest.raises(MimaError, match=r"^--cache on: task 'rot90' is built from tensors, not images .*--cache off$"):
        task_pool(config, CacheUse.EVERY_TASK)


# --------------------------------------------------------------- mima evaluate: folders vs cache
@pytest.fixture(scope="module")
def folder_run(tmp_path_factory, small_clip) -> tuple[Path, Path]:
    """A finished N=2 run on two of the demo's tasks written as PNG folders (trained without the
    cache), and the cache folder its config names (empty until an evaluation builds it)."""
    root = tmp_path_factory.mktemp("folder-run")
    folders = write_digit_folders(root / "tasks")
    # linear-probe heads: the small random CLIP's zero-shot heads give every image one class, and equal
    # results would then prove nothing about the pixels; the probes' predictions depend on them
    config = fit_config(root / "run", small_clip, None, steps=6, iterations=2, lr=2e-4, heads="linear_probe")
    config["data"] = _folder_settings(folders, root / "cache")
    return run_fit(config).run_dir, root / "cache"


def _rows(out: Path) -> list[dict]:
    return json.loads((out / "results.json").read_text())


def test_evaluate_from_the_cache_gives_the_image_folders_results(folder_run, tmp_path):
    run, cache = folder_run
    merges = ["--merges", "uniform", "task_arithmetic", "ties"]
    assert main(["evaluate", str(run), "--out", str(tmp_path / "folders"), "--cache", "off", *merges]) == 0
    assert not cache.exists()  # the image folders only: nothing decoded into the cache
    assert main(["evaluate", str(run), "--out", str(tmp_path / "cache"), "--cache", "on", *merges]) == 0
    # what an evaluation reads, decoded once: the validation and test splits, not the training split
    assert sorted(path.name for path in next(cache.iterdir()).iterdir()) == [
        f"{split}.{ext}" for split in ("test", "val") for ext in ("json", "npy")]
    folders, cached = _rows(tmp_path / "folders"), _rows(tmp_path / "cache")
    assert {(row["model"], row["task"]) for row in folders} == {
        (model, task) for model in ("zero_shot", "fine_tuned", "uniform", "task_arithmetic", "ties")
        for task in (*DIGIT_TASKS, "mean")}
    assert max(row["accuracy"] for row in folders) > 0.25  # one class for every image would score about 0.1
    assert cached == folders  # every accuracy, count and chosen point equal: the same pixels and float32 operations
    selection = [json.loads((tmp_path / out / "selection.json").read_text()) for out in ("folders", "cache")]
    for one in selection:
        one.pop("seconds_total")
    assert selection[0] == selection[1]
    # the paired tests of results.md read the per-image records: equal records, equal tables
    assert (tmp_path / "folders" / "results.md").read_text() == (tmp_path / "cache" / "results.md").read_text()


def test_evaluate_from_the_cache_on_validation_subsets_gives_the_image_folders_results(folder_run, tmp_path):
    run, _ = folder_run
    merges = ["--merges", "task_arithmetic", "--val-examples", "40"]
    assert main(["evaluate", str(run), "--out", str(tmp_path / "folders"), "--cache", "off", *merges]) == 0
    assert main(["evaluate", str(run), "--out", str(tmp_path / "cache"), "--cache", "on", *merges]) == 0
    assert _rows(tmp_path / "cache") == _rows(tmp_path / "folders")


def test_another_input_path_in_the_same_out_folder_is_another_evaluation(folder_run, tmp_path, capfd):
    """Cells computed from the image folders are not mixed with cells from the cache (on a GPU the
    cache path's compiled encoder may differ in the last bits): one line naming the difference."""
    run, _ = folder_run
    out, merges = tmp_path / "out", ["--merges", "uniform"]
    assert main(["evaluate", str(run), "--out", str(out), "--cache", "off", *merges]) == 0
    capfd.readouterr()
    assert main(["evaluate", str(run), "--out", str(out), "--cache", "on", *merges]) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "inputs" in err and "decoded-image cache (every task)" in err, err
    assert main(["evaluate", str(run), "--out", str(out), "--cache", "off", *merges]) == 0  # the same path resumes
