"""The fine-tuning recipe of paper 001 / task_vectors, checked against independent computations:
gradient clipping at norm 1.0 (a `mima fit` run against two hand-written AdamW steps), open_clip's
training transform (crop statistics decoded from the pixels), which splits use it, and the
FW-Merging iteration defaults per mode."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from PIL import Image

from mima.core.safetensors_io import load_state_dict
from mima.data import digits
from mima.data.clip_tasks import TASKS as CLIP_TASKS
from mima.data.image_folder import FolderTask, folder_task_spec
from mima.data.tasks import LoadOptions
from mima.merging import get_method
from mima.core.cache_dir import default_cache_dir
from mima.models.clip import load_clip
from mima.models.heads import task_heads
from mima.commands.fit.run import run_fit
from tests.helpers import SMALL_CLIP_CFG, fit_config, save_local_dir_clip

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------- gradient clipping
def _batch_indices(seed: int, task: str, size: int, step: int, batch_size: int) -> list[int]:
    """The documented stream rule (mima.data.sampler), written out: per-task step s reads positions
    [s*B, (s+1)*B) of an endless stream of permutations, epoch e seeded by sha256("mima/seed/task/e")."""
    indices = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, size)
        digest = hashlib.sha256(f"mima/{seed}/{task}/{epoch}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        indices.append(int(torch.randperm(size, generator=generator)[offset]))
    return indices


def _hand_fine_tune(clip: str, pretrained: dict, head: torch.Tensor, batches, lrs, weight_decay, clip_norm):
    """task_vectors' finetune.py loop: loss of normalised features against the frozen head,
    backward, clip_grad_norm_, AdamW step at the schedule's rate. Returns the weights and the
    gradient norms seen before clipping."""
    encoder = load_clip(clip).encoder
    encoder.load_state_dict(pretrained)
    encoder.train()
    params = [p for p in encoder.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lrs[0], weight_decay=weight_decay)
    norms = []
    for (images, labels), lr in zip(batches, lrs):
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        features = encoder(images)
        logits = (features / features.norm(dim=-1, keepdim=True)) @ head.T
        F.cross_entropy(logits, labels).backward()
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))))
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, clip_norm)
        optimizer.step()
    return {key: value.detach().clone() for key, value in encoder.state_dict().items()}, norms


def test_gradient_clipping_changes_the_step_exactly_as_clip_grad_norm(tmp_path, small_clip):
    task, steps, lr, batch_size, data_seed = "rot90", 2, 0.05, 16, 3
    config = fit_config(tmp_path / "run", small_clip, [task], steps=steps, iterations=1, lr=lr, warmup_steps=0)
    config["trainer"]["gradient_clip_val"] = 1.0
    config["data"]["seed"], config["data"]["batch_size"] = data_seed, batch_size
    run = run_fit(config).run_dir
    assert yaml.safe_load((run / "config.yaml").read_text())["trainer"]["gradient_clip_val"] == 1.0

    train = digits.TASKS[task].load(LoadOptions(image_size=16)).train
    batches = []
    for step in range(steps):
        items = [train[i] for i in _batch_indices(data_seed, task, len(train), step, batch_size)]
        batches.append((torch.stack([image for image, _ in items]), torch.stack([label for _, label in items])))
    # task_vectors' cosine_lr with no warm-up over S = 2 steps: factor 0.5 (1 + cos(pi s / S))
    lrs = [lr * 0.5 * (1 + math.cos(math.pi * s / steps)) for s in range(steps)]
    loaded = load_clip(small_clip)
    head = task_heads(loaded, "zero_shot", [digits.TASKS[task]], None, default_cache_dir())[task]
    pretrained = load_state_dict(run / "pretrained.safetensors")

    clipped, norms = _hand_fine_tune(small_clip, pretrained, head, batches, lrs, 0.1, clip_norm=1.0)
    unclipped, _ = _hand_fine_tune(small_clip, pretrained, head, batches, lrs, 0.1, clip_norm=None)
    # clipping bites at the first step (norm about 4.2 here); the second AdamW step mixes the clipped
    # first gradient into its moments, so the final weights depend on the clipping either way
    assert norms[0] > 1.5, norms
    fitted = load_state_dict(run / "final" / f"{task}.safetensors")
    assert set(fitted) == set(clipped)
    for key in clipped:
        torch.testing.assert_close(fitted[key], clipped[key], rtol=0, atol=1e-6, msg=key)
    # ... and the test can tell: without clipping the second AdamW step differs far beyond the tolerance
    assert max(float((unclipped[k] - clipped[k]).abs().max()) for k in clipped) > 1e-3


# ------------------------------------------------------------------------- the train transform
RAMP = 192  # the synthetic image's side; pixel (x, y) holds R = x, G = y


def _ramp_image() -> Image.Image:
    x, y = np.meshgrid(np.arange(RAMP), np.arange(RAMP))
    return Image.fromarray(np.stack([x, y, np.zeros_like(x)], axis=-1).astype(np.uint8))


@pytest.fixture(scope="module")
def clip64(tmp_path_factory):
    """A small open_clip CLIP with a 64-pixel input, loaded like a downloaded checkpoint."""
    cfg = {**SMALL_CLIP_CFG, "vision_cfg": {**SMALL_CLIP_CFG["vision_cfg"], "image_size": 64, "patch_size": 16}}
    return load_clip(f"local-dir:{save_local_dir_clip(tmp_path_factory.mktemp('clip64'), cfg, seed=3)}")


def _crop_box(tensor: torch.Tensor, loaded) -> tuple[float, float, float, float]:
    """(x0, y0, w, h) of the source region a transformed ramp image shows, from its pixels: after
    undoing the normalisation, output column j holds x0 + (j + 0.5) w / size - 0.5 (a resampling
    filter reproduces a linear ramp away from the borders); least squares over interior columns."""
    cfg = loaded.model.visual.preprocess_cfg
    mean, std = torch.tensor(cfg["mean"]).view(3, 1, 1), torch.tensor(cfg["std"]).view(3, 1, 1)
    pixels = (tensor * std + mean) * 255
    size = pixels.shape[-1]
    inner = torch.arange(6, size - 6, dtype=torch.float64)
    box = []
    for profile in (pixels[0].double().mean(0)[6:-6], pixels[1].double().mean(1)[6:-6]):
        slope, intercept = np.polyfit((inner + 0.5).numpy(), profile.numpy(), 1)
        box.append((intercept + 0.5, slope * size))
    (x0, w), (y0, h) = box
    return x0, y0, w, h


def test_train_transform_crops_between_90_and_100_percent_of_the_image(clip64):
    image = _ramp_image()
    evaluation = clip64.preprocess(image)
    assert torch.equal(evaluation, clip64.preprocess(image))  # deterministic
    x0, y0, w, h = _crop_box(evaluation, clip64)
    assert abs(w * h / RAMP**2 - 1) < 0.01 and abs(x0) < 0.5 and abs(y0) < 0.5  # the whole image
    torch.manual_seed(0)
    boxes = [_crop_box(clip64.preprocess_train(image), clip64) for _ in range(200)]
    areas = np.array([w * h / RAMP**2 for _, _, w, h in boxes])
    ratios = np.array([w / h for _, _, w, h in boxes])
    # RandomResizedCrop(scale=(0.9, 1.0), ratio=(3/4, 4/3)); the crop's sides are whole pixels and
    # the decoding is good to a few tenths of a pixel, hence the 1% tolerance
    assert areas.min() > 0.89 and areas.max() < 1.01, (areas.min(), areas.max())
    assert areas.min() < 0.92 and areas.max() > 0.98  # it varies over the whole range
    assert ratios.min() > 0.75 - 0.01 and ratios.max() < 4 / 3 + 0.01
    assert len({round(x0) for x0, _, _, _ in boxes}) > 5  # and so does the position
    for x0, y0, w, h in boxes:  # inside the image
        assert x0 > -0.5 and y0 > -0.5 and x0 + w < RAMP + 0.5 and y0 + h < RAMP + 0.5


def _differ(dataset, index: int, draws: int = 6) -> bool:
    first = dataset[index][0]
    return any(not torch.equal(first, dataset[index][0]) for _ in range(draws))


def _write_tree(folder: Path, classes: tuple[str, ...], per_class: int, size: int = 40) -> None:
    rng = np.random.default_rng(0)
    for name in classes:
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / name / f"{i:03d}.png")


def _check_splits(data, clip64, val_file: Path | None = None) -> None:
    assert _differ(data.train, 0)  # augmented: the same image twice differs
    for split in (data.val, data.test):
        assert not _differ(split, 0)  # evaluation transform: deterministic
    assert data.train[0][0].shape == data.val[0][0].shape == (3, 64, 64)
    if val_file is not None:
        with Image.open(val_file) as image:
            assert torch.equal(data.val[0][0], clip64.preprocess(image.convert("RGB")))


def test_image_folder_train_split_is_augmented_and_val_and_test_are_not(tmp_path, clip64):
    _write_tree(tmp_path / "shapes", ("circle", "square", "triangle"), 20)  # flat: test and val carved
    spec = folder_task_spec(FolderTask("shapes", str(tmp_path / "shapes")))
    options = LoadOptions(image_size=64, preprocess=clip64.preprocess, preprocess_train=clip64.preprocess_train)
    data = spec.load(options)
    _check_splits(data, clip64)
    # val is carved from the very images train reads: one of them, through the evaluation transform
    source = data.val.dataset  # Subset of the train+val images
    path = source.dataset.samples[source.indices[data.val.indices[0]]][0]
    with Image.open(path) as image:
        assert torch.equal(data.val[0][0], clip64.preprocess(image.convert("RGB")))
    # without a training transform, every split is the evaluation transform, as before
    plain = spec.load(LoadOptions(image_size=64, preprocess=clip64.preprocess))
    assert not _differ(plain.train, 0)


def test_clip_suite_train_split_is_augmented_and_val_and_test_are_not(tmp_path, clip64):
    from mima.data import clip_text

    root = tmp_path / "data"
    _write_tree(root / "EuroSAT_splits" / "train", tuple(clip_text.EUROSAT_FOLDERS), 2)  # own val folder
    _write_tree(root / "EuroSAT_splits" / "val", tuple(clip_text.EUROSAT_FOLDERS), 1)
    _write_tree(root / "EuroSAT_splits" / "test", tuple(clip_text.EUROSAT_FOLDERS), 1)
    # MNIST is read by torchvision; validation is carved from its training images
    rng = np.random.default_rng(1)
    for split, n in (("train", 40), ("t10k", 10)):
        for kind, array in (("images-idx3", rng.integers(0, 256, (n, 28, 28))), ("labels-idx1", np.arange(n) % 10)):
            path = root / "MNIST" / "raw" / f"{split}-{kind}-ubyte"
            path.parent.mkdir(parents=True, exist_ok=True)
            header = (0x800 + array.ndim).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
            path.write_bytes(header + array.astype(np.uint8).tobytes())
    options = LoadOptions(root=str(root), image_size=64, preprocess=clip64.preprocess,
                          preprocess_train=clip64.preprocess_train)
    eurosat = CLIP_TASKS["EuroSAT"].load(options)
    first_val = sorted((root / "EuroSAT_splits" / "val" / sorted(clip_text.EUROSAT_FOLDERS)[0]).iterdir())[0]
    _check_splits(eurosat, clip64, first_val)
    mnist = CLIP_TASKS["MNIST"].load(options)
    _check_splits(mnist, clip64)
    assert mnist.val.dataset is not mnist.train.dataset  # the same arrays under another transform
    assert mnist.val.dataset.data is mnist.train.dataset.data


# ------------------------------------------------------------------------------ FW-Merging
def test_fw_merging_iterations_default_to_3_hard_and_15_soft():
    method = get_method("fw_merging")
    assert method.hyperparameters({})["iterations"] == 3
    assert method.hyperparameters({"mode": "hard"})["iterations"] == 3
    assert method.hyperparameters({"mode": "soft"})["iterations"] == 15
    assert method.hyperparameters({"mode": "soft", "iterations": 4})["iterations"] == 4
    assert method.hyperparameters({"iterations": 7})["iterations"] == 7


# ---------------------------------------------------------------------- what results.md states
def test_results_state_the_schedule_precision_and_clipping(tmp_path):
    from types import SimpleNamespace

    from mima.evaluation.results import ModelResult, training_setup
    from mima.evaluation.results_files import write_results

    def model(n, schedule="cosine"):
        return SimpleNamespace(lr=1e-5, lr_schedule=schedule, schedule_scope="run", warmup_steps=200, iterations=n)

    paper = {"precision": "bf16-mixed", "gradient_clip_val": 1.0}
    same = training_setup([(model(1), paper), (model(20), paper)])
    assert same == {"lr": 1e-5, "lr_schedule": "cosine", "schedule_scope": "run", "warmup_steps": 200,
                    "precision": "bf16-mixed", "gradient_clip_val": 1.0}
    results = [ModelResult(1, "fine_tuned", {"a": 0.5}, mean_cos_tau=0.1), ModelResult(1, "uniform", {"a": 0.25})]
    write_results(tmp_path / "one", results, extra={"training": same})
    text = (tmp_path / "one" / "results.md").read_text()
    assert ("Training: lr 1e-05, 200 linear warm-up steps, then cosine decay to zero over each task's whole "
            "budget S (schedule_scope: run); precision bf16-mixed; gradient clipping at norm 1.0.") in text
    rows = (tmp_path / "one" / "results.json").read_text()
    assert "training" not in rows and "bf16" not in rows  # results.json keeps its format

    mixed = training_setup([(model(1), {}), (model(8, "constant"), paper)])
    assert [setup["N"] for setup in mixed] == [1, 8] and mixed[0]["precision"] == "32-true"
    write_results(tmp_path / "two", results, extra={"training": mixed})
    text = (tmp_path / "two" / "results.md").read_text()
    assert "- N = 1: lr 1e-05, 200 linear warm-up steps, then cosine decay" in text and "no gradient clipping" in text
    assert "- N = 8: lr 1e-05, 200 linear warm-up steps, then a constant rate" in text


# --------------------------------------- docs/configuration.md's note on the cosine schedule
def _task_vectors_cosine_lr(step: int, warmup: int, steps: int) -> float:
    """task_vectors src/utils.py cosine_lr with base_lr 1."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))


@pytest.mark.parametrize("total, warmup, expected", [
    (2000, 200, {1: 100.0, 2: 21.79, 4: 3.060, 8: 0.3948, 16: 0.0500, 20: 0.0257}),
    (320, 32, {1: 100.0, 2: 21.83, 4: 3.091, 8: 0.4051, 16: 0.0529, 20: 0.0276}),
])
def test_last_phase_share_of_the_cosine_schedule(total, warmup, expected):
    """docs/configuration.md, "The learning-rate schedule and the last phases": the last phase's share (%)
    of the summed rate under warm-up + cosine over S depends on N, hardly on S (0.03% at N = 20)."""
    from mima.core.plan import PhasePlan
    from mima.training.lr_schedule import lr_factor

    factors = [_task_vectors_cosine_lr(s, warmup, total) for s in range(total)]
    for n, share in expected.items():
        plan = PhasePlan(tasks=("t",), local_tasks=(0,), total_steps=total, iterations=n)
        assert [lr_factor(plan, s, "cosine", "run", warmup) for s in range(total)] == pytest.approx(factors, abs=1e-12)
        last = sum(factors[total - total // n:]) / sum(factors)
        assert 100 * last == pytest.approx(share, rel=2e-3), n
