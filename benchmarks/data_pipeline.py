"""What the decoded-image cache (`data.cache: true`, mima.data.cache_store) buys: training images per
second of the cached path against the per-image transform path, at the same DataLoader worker
count, and `mima fit` steps per second with and without the cache.

Loader part (no model forward; what a training loop would wait for):
  * transform path: `TaskSuiteDataModule.train_dataloader()` with the cache off: each image decoded
    (PIL from arrays or PNG files), resized/cropped and normalised by open_clip's transform;
  * cached path: the same loader with the cache on (uint8 batches read by index from the .npy
    files) plus `BatchPreparer` (mima.data.cache_augment: random resized crop where the task is
    augmented, normalisation), which runs on the device in training and here on the CPU (one
    thread), so it is counted.
Both read the same PhaseBatchSampler batches (batch 128); the first batch (worker start-up) is not
timed. Sources:
  * offline: the offline suite's mnist and fashion_mnist through the offline model's transform
    (embedded:mobilenetv2-imagenet, 48 x 48, no augmentation);
  * folder: a custom task of PNG files (--folder-images, 160-400 px, smooth colour fields with
    noise) through ViT-B/32's transform (224 x 224; training split augmented by RandomResizedCrop).
The cache build (decode once, in parallel) is timed too.

Fit part: `mima fit` of configs/offline.yaml cut to --fit-steps per task and 2 phases (its 4 tasks,
batch 32, its num_workers 0), with and without the cache; steps per second from the start of the
second step to the end of training (the cache is built before the cached run and not counted).

    python benchmarks/data_pipeline.py [--batches 30] [--workers 0 2] [--fit-steps 24] [--folder-images 1500]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from open_clip.transform import PreprocessCfg, image_transform_v2
from PIL import Image

from mima.data.datamodule import TaskSuiteDataModule, TrainingSetup
from mima.models.clip import load_clip
from mima.commands.fit.run import run_fit

ROOT = Path(__file__).resolve().parents[1]
BATCH = 128


class StepTimer(Callback):
    """Writes the time from the start of the second optimiser step to the end of training."""

    def __init__(self, path: str) -> None:
        self.path, self.start = path, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 1 and self.start is None:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        elapsed = time.perf_counter() - self.start
        Path(self.path).write_text(json.dumps({"seconds": elapsed, "steps": trainer.global_step - 1}))


def write_folder_task(root: Path, count: int, seed: int = 0) -> None:
    """`count` PNGs in 4 class folders: smooth colour fields plus pixel noise, 160-400 px per side."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        folder = root / f"class_{i % 4}"
        folder.mkdir(parents=True, exist_ok=True)
        height, width = (int(side) for side in rng.integers(160, 400, 2))
        y, x = np.mgrid[0:height, 0:width] / max(height, width)
        base = 127 + 100 * np.sin(6 * x[..., None] * rng.uniform(0.5, 2, 3) + 6 * y[..., None] * rng.uniform(0.5, 2, 3))
        pixels = np.clip(base + rng.normal(0, 12, (height, width, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:05d}.png")


def data_module(settings: dict, cache_dir: Path | None, workers: int) -> TaskSuiteDataModule:
    extra = {"cache": True, "cache_dir": str(cache_dir)} if cache_dir is not None else {}
    return TaskSuiteDataModule(**settings, batch_size=BATCH, num_workers=workers, seed=0, **extra)


def images_per_second(data: TaskSuiteDataModule, size: int, preprocess, preprocess_train, batches: int, steps: int,
                      prepare_too: bool = True) -> float:
    """Images/s of `data`'s training loader (plus, with `prepare_too`, the cached path's batch
    preparation), batch 2 onwards."""
    process = data.connect(TrainingSetup(image_size=size, preprocess=preprocess, preprocess_train=preprocess_train,
                                         steps=steps, iterations=1, layout=None, rank=0))
    data.trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    prepare = (process.prepare_batch if prepare_too else None) or (lambda batch: batch)
    start, seen = None, 0
    for index, batch in enumerate(data.train_dataloader()):
        images = prepare(batch)[0]
        if index == 0:
            start = time.perf_counter()
        else:
            seen += len(images)
        if index == batches:
            break
    return seen / (time.perf_counter() - start)


def loader_benchmark(name: str, settings: dict, size: int, preprocess, preprocess_train, scratch: Path,
                     batches: int, workers: list[int]) -> list[dict]:
    cache_dir = scratch / f"cache-{name}"
    builder = data_module(settings, cache_dir, max(workers))
    builder.cache_progress = False
    start = time.perf_counter()
    tasks = builder.build_cache(size, preprocess)
    build_seconds = time.perf_counter() - start
    built = sum(len(split) for task in tasks for split in task.splits.values())
    print(f"{name}: cache built in {build_seconds:.1f} s ({built} images, {built / build_seconds:.0f} images/s, "
          f"{max(workers)} workers)", flush=True)
    steps = batches + 1
    rows = []
    for count in workers:
        plain = images_per_second(data_module(settings, None, count), size, preprocess, preprocess_train, batches, steps)
        cached = images_per_second(data_module(settings, cache_dir, count), size, preprocess, preprocess_train, batches, steps)
        read = images_per_second(data_module(settings, cache_dir, count), size, preprocess, preprocess_train, batches, steps,
                                 prepare_too=False)
        rows.append({"source": name, "workers": count, "transform_images_per_s": plain, "cached_images_per_s": cached,
                     "cached_read_only_images_per_s": read, "ratio": cached / plain, "read_ratio": read / plain,
                     "build_seconds": build_seconds, "built_images": built})
        print(f"{name}: workers {count}: transform path {plain:8.0f} images/s, cached path {cached:8.0f} images/s "
              f"(ratio {cached / plain:.1f}x); cached reads alone {read:8.0f} images/s (ratio {read / plain:.1f}x: "
              "what the loader must deliver when the preparation runs on a GPU)", flush=True)
    return rows


def fit_steps_per_second(scratch: Path, steps: int, cache_dir: Path | None, tag: str) -> float:
    config = yaml.safe_load((ROOT / "configs" / "offline.yaml").read_text())
    config["model"].update(steps=steps, iterations=2, warmup_steps=max(1, steps // 10))
    if cache_dir is not None:
        config["data"].update(cache=True, cache_dir=str(cache_dir))
    timer_file = scratch / f"timer-{tag}.json"
    config["trainer"].update(enable_model_summary=False, enable_progress_bar=False,
                             callbacks=[{"class_path": "data_pipeline.StepTimer", "init_args": {"path": str(timer_file)}}])
    config.update(out=str(scratch / f"run-{tag}"), overwrite=True)
    run_fit(config)
    timing = json.loads(timer_file.read_text())
    return timing["steps"] / timing["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=30, help="timed batches of 128 per loader measurement")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="DataLoader worker counts")
    parser.add_argument("--folder-images", type=int, default=1500, help="PNG files of the folder task")
    parser.add_argument("--fit-steps", type=int, default=24, help="S per task of the cut offline.yaml fits (0: skip)")
    parser.add_argument("--sources", nargs="+", default=["offline", "folder"], choices=["offline", "folder"],
                        help="loader measurements to run")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    options = parser.parse_args()
    # One intra-op thread for the loader measurements (both paths): on 2 shared cores, element-wise ops
    # on a batch ran ~10x slower with 2 threads than with 1 (thread hand-offs under load); on a GPU
    # the cached path's batch preparation does not run on the CPU at all. The fits use the config's.
    torch.set_num_threads(1)
    results: dict = {"loaders": []}
    with tempfile.TemporaryDirectory(prefix="mima-data-pipeline-") as folder:
        scratch = Path(folder)
        offline = load_clip("embedded:mobilenetv2-imagenet")
        results["loaders"] += [] if "offline" not in options.sources else loader_benchmark(
            "offline", {"suite": "offline", "tasks": ["mnist", "fashion_mnist"]}, offline.image_size,
            offline.preprocess, offline.preprocess_train, scratch, options.batches, options.workers)
        if "folder" in options.sources:
            start = time.perf_counter()
            write_folder_task(scratch / "pngs", options.folder_images)
            print(f"folder: {options.folder_images} PNGs written in {time.perf_counter() - start:.1f} s", flush=True)
            vit = PreprocessCfg(size=(224, 224))  # ViT-B/32's input size and open_clip's default (OpenAI) normalisation
            results["loaders"] += loader_benchmark(
                "folder", {"suite": None, "custom_tasks": [{"name": "pngs", "path": str(scratch / "pngs")}]}, 224,
                image_transform_v2(vit, is_train=False), image_transform_v2(vit, is_train=True), scratch,
                options.batches, options.workers)
        if options.fit_steps > 0:
            cache_dir = scratch / "cache-fit"
            builder = TaskSuiteDataModule(**yaml.safe_load((ROOT / "configs" / "offline.yaml").read_text())["data"],
                                          cache=True, cache_dir=str(cache_dir))
            builder.cache_progress = False
            start = time.perf_counter()
            builder.build_cache(offline.image_size, offline.preprocess)
            print(f"fit: offline.yaml's 4 tasks cached in {time.perf_counter() - start:.1f} s", flush=True)
            plain = fit_steps_per_second(scratch, options.fit_steps, None, "transform")
            cached = fit_steps_per_second(scratch, options.fit_steps, cache_dir, "cached")
            results["fit"] = {"steps_per_task": options.fit_steps, "transform_steps_per_s": plain,
                              "cached_steps_per_s": cached, "ratio": cached / plain}
            print(f"fit (configs/offline.yaml, S={options.fit_steps}, N=2, batch 32, num_workers 0): transform path "
                  f"{plain:.2f} steps/s, cached path {cached:.2f} steps/s, ratio {cached / plain:.2f}x", flush=True)
    if options.json:
        options.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
