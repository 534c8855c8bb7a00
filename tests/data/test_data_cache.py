"""The decoded-image cache (`data.cache: true`; mima.data.cache_store and mima.data.cache_augment):
evaluation tensors equal to open_clip's transform, stale caches rebuilt, the device-side random
resized crop, per-example draws independent of sharding, and `mima fit` on the cache giving the
same task models at W = 1 and 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from open_clip.transform import PreprocessCfg, image_transform_v2
from PIL import Image

from mima.core.errors import MimaError
from mima.core.plan import PhasePlan
from mima.core.safetensors_io import load_state_dict
from mima.data.cache_augment import CropSettings, crop_boxes, resized_crops
from mima.data.cache_store import source_fingerprint
from mima.data.clip_tasks import TASKS
from mima.data.datamodule import TaskSuiteDataModule
from mima.data.sampler import PhaseBatchSampler
from mima.data.tasks import LoadOptions
from tests.helpers import dark_and_light_pngs, run_command

# Max abs difference allowed between the cached evaluation path and open_clip's transform: both do
# float32 x / 255 then (x - mean) / std, so on the CPU they agree exactly; 1e-6 leaves room for a
# fused or reordered normalisation (one float32 rounding of values of size ~2).
BOUND = 1e-6


def _transforms(size: int):
    config = PreprocessCfg(size=(size, size))
    return image_transform_v2(config, is_train=False), image_transform_v2(config, is_train=True)


def _write_pngs(root: Path, seed: int = 0) -> None:
    """Two classes of PNGs of mixed sizes, aspect ratios and modes (RGB, greyscale, palette)."""
    dark_and_light_pngs(root, seed, per_class=12, smallest=14, noise=40, modes=("RGB", "L", "P"))


def _max_difference(cached, reference) -> float:
    assert len(cached) == len(reference)
    worst = 0.0
    for i in range(len(cached)):
        (a, label_a), (b, label_b) = cached[i], reference[i]
        assert label_a == label_b and a.shape == b.shape and a.dtype == b.dtype == torch.float32
        worst = max(worst, float((a - b).abs().max()))
    return worst


@pytest.mark.parametrize("task", ["digits", "folder"])
def test_cached_evaluation_path_gives_open_clip_tensors(tmp_path, task):
    size = 20
    preprocess, _ = _transforms(size)
    if task == "digits":  # the offline suite's scikit-learn digits: 8x8 greyscale arrays, upsampled
        settings = {"suite": "offline", "tasks": ["digits"]}
    else:  # a folder of PNG files
        _write_pngs(tmp_path / "pngs")
        settings = {"suite": None, "custom_tasks": [{"name": "pngs", "path": str(tmp_path / "pngs")}]}
    name = settings.get("tasks", ["pngs"])[0]
    cached = TaskSuiteDataModule(**settings, cache=True, cache_dir=str(tmp_path / "cache")).task_data(name, size, preprocess)
    reference = TaskSuiteDataModule(**settings).task_data(name, size, preprocess)
    for split in ("train", "val", "test"):
        assert _max_difference(getattr(cached, split), getattr(reference, split)) <= BOUND, split
    # what is stored: the PIL image after open_clip's resize + centre crop, as uint8 CHW
    first = np.load(next((tmp_path / "cache").glob("*/test.npy")))[0]
    if task == "folder":
        path = reference.test.dataset.samples[reference.test.indices[0]][0]
        with Image.open(path) as image:  # torchvision's rules: the long side truncated, the offsets rounded
            short = min(image.size)
            resized = image.convert("RGB").resize(tuple(size if side == short else int(size * side / short)
                                                        for side in image.size), Image.BICUBIC)
        left, top = (round((side - size) / 2) for side in resized.size)
        expected = np.asarray(resized.crop((left, top, left + size, top + size))).transpose(2, 0, 1)
        assert np.array_equal(first, expected)


def _cached_pngs(tmp_path, size: int) -> tuple[dict, object]:
    """A custom task of PNGs with data.cache on, its cache built once: (data settings, preprocess)."""
    preprocess, _ = _transforms(size)
    _write_pngs(tmp_path / "pngs")
    settings = {"suite": None, "custom_tasks": [{"name": "pngs", "path": str(tmp_path / "pngs")}],
                "cache": True, "cache_dir": str(tmp_path / "cache")}
    TaskSuiteDataModule(**settings).task_data("pngs", size, preprocess)
    return settings, preprocess


def test_a_changed_source_file_rebuilds_the_cache_and_an_unchanged_one_does_not(tmp_path):
    size = 16
    settings, preprocess = _cached_pngs(tmp_path, size)
    (folder,) = (tmp_path / "cache").iterdir()
    stamps = {path.name: path.stat().st_mtime_ns for path in folder.iterdir()}
    fingerprints = {split: json.loads((folder / f"{split}.json").read_text())["fingerprint"] for split in ("train", "val", "test")}

    TaskSuiteDataModule(**settings).task_data("pngs", size, preprocess)  # unchanged: read, not rebuilt
    assert {path.name: path.stat().st_mtime_ns for path in folder.iterdir()} == stamps

    # overwrite one file with a white image; its mtime and size change
    changed = sorted((tmp_path / "pngs" / "dark").glob("*.png"))[0]
    Image.fromarray(np.full((30, 30, 3), 255, np.uint8)).save(changed)
    os.utime(changed, ns=(stamps["train.npy"] + 10**9, stamps["train.npy"] + 10**9))
    data = TaskSuiteDataModule(**settings).task_data("pngs", size, preprocess)
    now = {split: json.loads((folder / f"{split}.json").read_text())["fingerprint"] for split in fingerprints}
    assert now != fingerprints
    reference = TaskSuiteDataModule(**{k: v for k, v in settings.items() if not k.startswith("cache")}).task_data("pngs", size, preprocess)
    for split in ("train", "val", "test"):
        assert _max_difference(getattr(data, split), getattr(reference, split)) <= BOUND
    # (the reference reads the new file: equal tensors mean the split holding it was rebuilt)


def test_a_torchvision_dataset_is_fingerprinted_by_the_files_of_its_own_folder(tmp_path):
    """RenderedSST2 lists its files in private attributes only: the fingerprint covers the folder it
    reads (root/rendered-sst2), so a file changed there counts and files beside it do not."""
    base = tmp_path / "RenderedSST2" / "rendered-sst2"
    for split, count in (("train", 10), ("test", 3)):
        for label in ("negative", "positive"):
            (base / split / label).mkdir(parents=True)
            for i in range(count):
                Image.fromarray(np.full((6, 6, 3), 20 * i, np.uint8)).save(base / split / label / f"{i}.png")

    def fingerprints() -> list[str]:
        data = TASKS["RenderedSST2"].load(LoadOptions(root=str(tmp_path), image_size=8, split_seed=0))
        return [source_fingerprint(getattr(data, split)) for split in ("train", "val", "test")]

    before = fingerprints()
    assert len(set(before)) == 3 and fingerprints() == before
    (tmp_path / "RenderedSST2" / "notes.txt").write_text("beside the dataset's folder")
    (tmp_path / "MNIST").mkdir()
    (tmp_path / "MNIST" / "another-task").write_text("elsewhere under the data root")
    assert fingerprints() == before
    Image.fromarray(np.full((7, 7, 3), 255, np.uint8)).save(base / "test" / "positive" / "0.png")
    assert all(now != then for now, then in zip(fingerprints(), before))  # the folder is hashed whole


def test_fer2013_is_fingerprinted_by_its_own_folder_not_the_whole_data_root(tmp_path):
    """FER2013 takes the data root itself as its root (torchvision reads ROOT/fer2013/fer2013.csv):
    its fingerprint reads only ROOT/fer2013, so files of other tasks under the root leave it alone.
    (torchvision checks the csv's md5, so a fake csv cannot be parsed; the fingerprint needs only
    the dataset's root, set by VisionDataset's own constructor.)"""
    from torchvision.datasets import FER2013, VisionDataset

    (tmp_path / "fer2013").mkdir()
    (tmp_path / "fer2013" / "fer2013.csv").write_text("emotion,pixels,Usage\n0," + " ".join(["7"] * 2304) + ",Training\n")
    _write_pngs(tmp_path / "sun397" / "train")

    def fingerprint() -> str:
        dataset = FER2013.__new__(FER2013)
        VisionDataset.__init__(dataset, str(tmp_path))  # what FER2013(str(root)) sets before reading the csv
        return source_fingerprint(dataset)

    before = fingerprint()
    Image.fromarray(np.zeros((5, 5, 3), np.uint8)).save(tmp_path / "sun397" / "train" / "dark" / "new.png")
    (tmp_path / "MNIST" / "raw").mkdir(parents=True)
    (tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte").write_bytes(b"another task's file")
    (tmp_path / "notes.txt").write_text("beside every task")
    assert fingerprint() == before
    (tmp_path / "fer2013" / "icml_face_data.csv").write_text("another copy")
    assert fingerprint() != before  # its own folder is read


def test_tensor_suites_are_refused_with_one_line(tmp_path):
    preprocess, _ = _transforms(16)
    data = TaskSuiteDataModule(suite="digits", tasks=["rot90"], cache=True, cache_dir=str(tmp_path))
    with pytest.raises(MimaError, match="data.cache: task 'rot90' is built from tensors"):
        data.task_data("rot90", 16, preprocess)


# ------------------------------------------------------------------------ device-side crop
def test_resized_crop_of_the_whole_image_is_the_image_and_a_half_box_is_a_2x_bicubic_upsampling():
    generator = torch.Generator().manual_seed(0)
    pixels = torch.rand((2, 3, 16, 16), generator=generator)
    whole = resized_crops(pixels.clone(), torch.tensor([[0, 0, 16, 16]] * 2))
    assert (whole - pixels).abs().max() <= 1e-5
    # box (top 3, left 5, 8 x 8) -> 16 x 16: torch's own bicubic upsampling of the crop by 2,
    # compared away from the crop's edges (there grid_sample reads the neighbours outside the crop)
    out = resized_crops(pixels.clone(), torch.tensor([[3, 5, 8, 8]] * 2))
    expected = F.interpolate(pixels[:, :, 3:11, 5:13], scale_factor=2, mode="bicubic", align_corners=False).clamp(0, 1)
    assert (out[:, :, 4:12, 4:12] - expected[:, :, 4:12, 4:12]).abs().max() <= 1e-5


def test_crop_boxes_follow_random_resized_crop_limits_and_depend_on_the_draw_only():
    settings = CropSettings(scale=(0.9, 1.0), ratio=(3 / 4, 4 / 3), mode="bicubic")
    boxes = [tuple(box) for box in crop_boxes(range(300), 224, settings).tolist()]
    assert boxes == [tuple(crop_boxes([draw], 224, settings)[0]) for draw in range(300)]  # whatever else is in the batch
    for top, left, height, width in boxes:
        assert 0 <= top <= 224 - height and 0 <= left <= 224 - width
        # torchvision's rule: area in [0.9, 1.0] x 224^2 and ratio in [3/4, 4/3] before rounding
        assert 0.9 * 224**2 - 2 * 224 <= height * width <= 224**2
        assert 3 / 4 - 0.02 <= width / height <= 4 / 3 + 0.02
    assert len(set(boxes)) > 200


def test_draws_of_a_step_are_the_same_whichever_shard_holds_the_example():
    plan = PhasePlan(tasks=("a", "b"), local_tasks=(0, 1), total_steps=4, iterations=2)
    whole = list(PhaseBatchSampler(plan, [50, 70], 8, seed=5, draws=True))
    halves = [list(PhaseBatchSampler(plan, [50, 70], 8, seed=5, shard=(i, 2), draws=True)) for i in range(2)]
    assert [a + b for a, b in zip(*halves)] == whole
    plain = list(PhaseBatchSampler(plan, [50, 70], 8, seed=5))
    assert [[(slot, example) for slot, example, _ in batch] for batch in whole] == plain
    draws = [draw for batch in whole for _, _, draw in batch]
    assert len(set(draws)) == len(draws)


def _first_batches(data: TaskSuiteDataModule, size: int, count: int = 3) -> tuple[list, object]:
    from types import SimpleNamespace

    from mima.data.datamodule import TrainingSetup

    preprocess, preprocess_train = _transforms(size)
    process = data.connect(TrainingSetup(image_size=size, preprocess=preprocess, preprocess_train=preprocess_train,
                                         steps=4, iterations=2, layout=None, rank=0))
    data.trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    batches = []
    for batch in data.train_dataloader():
        batches.append(batch)
        if len(batches) == count:
            break
    return batches, process.prepare_batch


def test_cached_training_batches_of_a_suite_without_augmentation_equal_the_per_image_batches(tmp_path):
    settings = {"suite": "offline", "tasks": ["digits"], "batch_size": 8, "seed": 1}
    cached, prepare = _first_batches(TaskSuiteDataModule(**settings, cache=True, cache_dir=str(tmp_path)), 20)
    plain, none = _first_batches(TaskSuiteDataModule(**settings), 20)
    assert none is None
    for raw, (images, labels, slots) in zip(cached, plain):
        assert raw[0].dtype == torch.uint8 and not bool(raw[4].any())  # read as bytes, not augmented
        got_images, got_labels, got_slots = prepare(raw)
        assert torch.equal(got_labels, labels) and torch.equal(got_slots, slots)
        assert float((got_images - images).abs().max()) <= BOUND


def test_cached_training_batches_of_a_folder_task_are_cropped_on_the_device(tmp_path):
    _write_pngs(tmp_path / "pngs")
    data = TaskSuiteDataModule(suite=None, custom_tasks=[{"name": "pngs", "path": str(tmp_path / "pngs")}],
                               batch_size=8, seed=1, cache=True, cache_dir=str(tmp_path / "cache"))
    (raw,), prepare = _first_batches(data, 20, count=1)
    images, labels, slots, boxes, augmented = raw
    assert bool(augmented.all())
    heights, widths = boxes[:, 2].double(), boxes[:, 3].double()
    assert bool(((heights * widths >= 0.9 * 400 - 40) & (heights * widths <= 400)).all())
    assert bool((boxes[:, :2] >= 0).all()) and bool((boxes[:, 0] + boxes[:, 2] <= 20).all())
    prepared, _, _ = prepare(raw)
    # an independent computation of one row: crop, torch bicubic resize of the crop, clamp, normalise
    # (equal away from the crop's edges, where grid_sample also reads the pixels outside the crop)
    mean, std = torch.tensor(prepare.mean).view(3, 1, 1), torch.tensor(prepare.std).view(3, 1, 1)
    row = int(torch.argmin(heights * widths))
    top, left, height, width = boxes[row].tolist()
    crop = images[row:row + 1, :, top:top + height, left:left + width].float() / 255
    expected = (F.interpolate(crop, size=(20, 20), mode="bicubic", align_corners=False).clamp(0, 1)[0] - mean) / std
    assert float((prepared[row, :, 3:-3, 3:-3] - expected[:, 3:-3, 3:-3]).abs().max()) <= 1e-4


def _per_image_batches(tmp_path: Path, workers: int, start: int, device: str = "cpu"):
    """The per-image path (no cache) of a folder task with open_clip's training transform: the
    training loader from process step `start` on, read by `workers` workers."""
    from types import SimpleNamespace

    from mima.data.datamodule import TrainingSetup

    data = TaskSuiteDataModule(suite=None, custom_tasks=[{"name": "pngs", "path": str(tmp_path / "pngs")}],
                               batch_size=8, seed=1, num_workers=workers)
    preprocess, preprocess_train = _transforms(20)
    data.connect(TrainingSetup(image_size=20, preprocess=preprocess, preprocess_train=preprocess_train,
                               steps=6, iterations=2, layout=None, rank=0))
    data.trainer = SimpleNamespace(global_step=start, strategy=SimpleNamespace(root_device=torch.device(device)))
    return data.train_dataloader()


def test_per_image_augmented_batches_depend_on_the_step_not_on_workers_or_the_global_rng(tmp_path):
    """Each example's random resized crop is drawn from its draw seed (data seed, task, per-task step,
    position): the same batches with 0 or 2 workers, after other draws from the global RNG, and from a
    resumed step; the training transform does crop (two reads of one example at two steps differ)."""
    _write_pngs(tmp_path / "pngs")
    reference = [batch for batch in _per_image_batches(tmp_path, 0, 0)]
    assert len(reference) == 6
    torch.manual_seed(1234)
    torch.rand(17)
    for workers, start in ((2, 0), (0, 3), (1, 2)):
        batches = list(_per_image_batches(tmp_path, workers, start))
        assert len(batches) == 6 - start
        for (images, labels, slots), (want_images, want_labels, _) in zip(batches, reference[start:]):
            assert torch.equal(images, want_images) and torch.equal(labels, want_labels)
    # the transform is random: one example read with two draws differs; the global RNG is left as it was
    plain = TaskSuiteDataModule(suite=None, custom_tasks=[{"name": "pngs", "path": str(tmp_path / "pngs")}])
    dataset = plain.task_data("pngs", 20, _transforms(20)[0], _transforms(20)[1]).train
    from mima.data.sampler import MultiTaskDataset

    state = torch.get_rng_state()
    reads = [MultiTaskDataset([dataset])[(0, 0, draw)][0] for draw in (1, 2, 1)]
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(reads[0], reads[2]) and not torch.equal(reads[0], reads[1])


def test_training_loaders_pin_memory_on_a_cuda_device_only(tmp_path):
    _write_pngs(tmp_path / "pngs")
    assert _per_image_batches(tmp_path, 0, 0, "cuda").pin_memory
    assert not _per_image_batches(tmp_path, 0, 0, "cpu").pin_memory


# ---------------------------------------------------------------------------------- mima fit
def _fit(tmp_path: Path, clip: str, devices: int, name: str) -> dict:
    config = {
        "seed_everything": 0,
        "threads_per_process": 1,
        "model": {"clip": clip, "steps": 8, "iterations": 2, "lr": 1e-3, "warmup_steps": 1},
        "data": {"suite": None, "batch_size": 8, "seed": 3, "cache": True, "cache_dir": str(tmp_path / "cache"),
                 "custom_tasks": [{"name": "one", "path": str(tmp_path / "one")}, {"name": "two", "path": str(tmp_path / "two")}]},
        "trainer": {"accelerator": "cpu", "devices": devices, "enable_progress_bar": False,
                    "enable_model_summary": False},  # with mima's logger: data and model hparams merge
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    result = run_command(["fit", "--config", path, "--out", tmp_path / name], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return {task: load_state_dict(tmp_path / name / "final" / f"{task}.safetensors") for task in ("one", "two")}


@pytest.mark.slow
def test_fit_on_the_cache_writes_the_same_task_models_on_one_and_two_processes(tmp_path, small_clip):
    _write_pngs(tmp_path / "one", seed=1)
    _write_pngs(tmp_path / "two", seed=2)
    one, two = _fit(tmp_path, small_clip, 1, "w1"), _fit(tmp_path, small_clip, 2, "w2")
    for task in one:
        for key in one[task]:
            assert torch.equal(one[task][key], two[task][key]), (task, key)
    sidecar = json.loads(next((tmp_path / "cache").glob("one-*/train.json")).read_text())
    assert sidecar["count"] == len(sidecar["labels"]) and sidecar["image_size"] == 16


def test_a_cache_file_zeroed_in_place_is_found_and_decoded_again(tmp_path, capfd):
    """issue 41, item 7: a .npy changed after it was written (here its image bytes zeroed, the size and the
    sidecar untouched) no longer trains silently: its checksum says so, the split is decoded again."""
    size = 16
    settings, preprocess = _cached_pngs(tmp_path, size)
    (folder,) = (tmp_path / "cache").iterdir()
    train = folder / "train.npy"
    good = train.read_bytes()
    header = len(good) - int(np.load(train, mmap_mode="r").nbytes)
    train.write_bytes(good[:header] + bytes(len(good) - header))  # every image black, same size
    capfd.readouterr()
    data = TaskSuiteDataModule(**settings).task_data("pngs", size, preprocess)
    assert f"data.cache: {train} does not match the checksum it was written with" in capfd.readouterr().err
    assert train.read_bytes() == good  # decoded again: the same bytes as first written
    reference = TaskSuiteDataModule(**{k: v for k, v in settings.items() if not k.startswith("cache")}).task_data("pngs", size, preprocess)
    assert _max_difference(data.train, reference.train) <= BOUND
