"""What the Lightning trainer costs: steps per second of `mima fit` against a bare PyTorch loop that
does the same optimiser steps on the same model and batches, run side by side.

Two presets (--preset):
  cpu   (default) the offline suite's MobileNetV2 on the CPU, described below;
  gpu   a ViT-B/32 architecture with random weights (`--model.pretrained none`) on the synthetic
        suite's random 224x224 images (mima.data.synthetic), one CUDA device, bf16 autocast
        (Lightning precision "bf16-mixed" / torch.autocast in the bare loop), batch 128, 8 loader
        workers; reported as images per second.

In the cpu preset both run the offline suite's model (ImageNet MobileNetV2 image tower, 48x48 inputs, frozen
BatchNorm statistics, linear-probe heads) on two of its tasks with MIMA (S steps per task, N
phases), on the CPU with the same thread count:
  * mima: `mima fit` with configs/offline.yaml cut to the benchmark's size: Lightning loop, sync
    callback with its cosine diagnostics, metrics, progress bar, and a checkpoint at the end of every
    task segment (mima's defaults);
  * bare: a `for` loop over the same DataLoader (mima's PhaseBatchSampler: identical batches), the
    same AdamW and learning-rate factor, each task's own optimiser (fresh per segment under
    `optimizer_state: reset`), the phase average at each phase end; no checkpoints, no diagnostics.
Time is counted from the start of the second step to the end of training (setup, the probes and
the first step's allocations are excluded from both); the runs alternate and the median of the
repeats is reported. Both end with the same final weights (printed: max |difference|), which
shows that they did the same work.

Inputs (--inputs):
  loader    (default) both loops read their batches through the DataLoader (per-image decoding and
            transforms in the loader's workers), as a run without `data.cache` does;
  resident  the trainer alone: every batch of the run is built once before either loop starts and
            kept on the device; both loops read these same tensors (mima's data module hands them
            to Lightning in place of its loader). A third run, `mima fit` with `data.cache: true`
            (the real run's input path: uint8 batches from the memory-mapped cache, crop and
            normalisation on the device), is reported against the bare loop on resident inputs:
            how close to the model's compute limit a real run gets. (Its weights differ: the cached
            path draws its own crops.)

    python benchmarks/trainer_overhead.py [--repeats 3] [--steps 40] [--iterations 2] [--preset cpu|gpu] [--skip-cached] [--threads N]
                                          [--inputs loader|resident]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

from mima.data.datamodule import TaskSuiteDataModule
from mima.data.sampler import MultiTaskDataset, PhaseBatchSampler
from mima.models.batchnorm import train_with_frozen_batchnorm
from mima.models.classifier import classify
from mima.core.cache_dir import default_cache_dir
from mima.models.clip import load_clip
from mima.models.heads import task_heads
from mima.core.run_folder import RunFolder
from mima.training.lr_schedule import lr_factor
from mima.core.plan import PhasePlan
from mima.config.run_config import load_run_config
from mima.commands.fit.run import run_fit

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {
    "cpu": {"tasks": ["mnist", "fashion_mnist"]},
    "gpu": {
        "tasks": ["synthetic_a", "synthetic_b"],
        "model": {"clip": "ViT-B-32", "pretrained": "none", "heads": "zero_shot", "lr": 1e-5},
        "data": {"suite": "synthetic", "batch_size": 128, "num_workers": 8},
        "trainer": {"accelerator": "gpu", "precision": "bf16-mixed"},
        "threads_per_process": 4,
    },
}


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimer(Callback):
    """Writes the time from the start of the second optimiser step to the end of training."""

    def __init__(self, path: str) -> None:
        self.path, self.start = path, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 1 and self.start is None:
            _synchronize()
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        _synchronize()
        elapsed = time.perf_counter() - self.start
        Path(self.path).write_text(json.dumps({"seconds": elapsed, "steps": trainer.global_step - 1}))


def benchmark_config(
    steps: int, iterations: int, out: Path, timer_file: Path, preset: str = "cpu", checkpoint_every: int | None = None
) -> dict:
    config = yaml.safe_load((ROOT / "configs" / "offline.yaml").read_text())
    chosen = PRESETS[preset]
    config["model"].update(steps=steps, iterations=iterations, warmup_steps=steps // 10, **chosen.get("model", {}))
    config["data"].update(tasks=chosen["tasks"], **chosen.get("data", {}))
    config["trainer"].update(chosen.get("trainer", {}))
    config["threads_per_process"] = chosen.get("threads_per_process", config["threads_per_process"])
    config["trainer"].update(
        enable_model_summary=False,
        callbacks=[{"class_path": "trainer_overhead.StepTimer", "init_args": {"path": str(timer_file)}}],
    )
    config.update(out=str(out), overwrite=True)
    if checkpoint_every is not None:
        config["checkpoint_every"] = checkpoint_every
    return config


def run_mima(config: dict, timer_file: Path) -> tuple[float, int, list[dict]]:
    run = RunFolder(run_fit(config).run_dir)
    timing = json.loads(timer_file.read_text())
    return timing["seconds"], timing["steps"], [run.final(task) for task in run.task_order()]


def _average(states: list[dict]) -> dict:
    """Task-ordered sum in float32 (at least), divided by the count, cast back: mima's rounding."""
    average = {}
    for key, first in states[0].items():
        total = first.to(torch.promote_types(first.dtype, torch.float32), copy=True)
        for state in states[1:]:
            total += state[key]
        average[key] = (total / len(states)).to(first.dtype)
    return average


class BareSetup:
    """What the bare loop trains: the encoder, task heads, phase plan and the DataLoader of mima's
    batches (mima's PhaseBatchSampler over the same datasets and transforms)."""

    def __init__(self, config: dict) -> None:
        run_config = load_run_config(config)  # the values (and defaults) `mima fit` uses
        self.model_cfg, data_cfg = run_config.model_args(), run_config.data_args()
        torch.manual_seed(run_config.seed)
        self.device = "cuda" if config["trainer"]["accelerator"] == "gpu" else "cpu"
        self.bf16 = config["trainer"].get("precision") == "bf16-mixed"
        loaded = load_clip(self.model_cfg["clip"], self.model_cfg["pretrained"])
        self.encoder = loaded.encoder.to(self.device)
        data = run_config.datamodule()  # the run's tasks, custom image folders included
        splits = {name: data.task_data(name, loaded.image_size, loaded.preprocess) for name in data.task_names}
        self.splits = splits  # every task's train / val / test sets (evaluation transform)
        self.data, self.image_size, self.preprocess = data, loaded.image_size, loaded.preprocess  # for cached splits
        heads = task_heads(loaded, self.model_cfg["heads"], data.task_specs, {n: s.train for n, s in splits.items()},
                           default_cache_dir(), data.data_key, self.model_cfg["probe_shots"])
        self.heads = [heads[name].to(self.device) for name in data.task_names]
        self.plan = PhasePlan(tuple(data.task_names), tuple(range(len(data.task_names))), self.model_cfg["steps"],
                              self.model_cfg["iterations"])
        train_sets = [splits[name].train for name in data.task_names]
        sampler = PhaseBatchSampler(self.plan, [len(s) for s in train_sets], data_cfg["batch_size"], data_cfg["seed"], 0,
                                    (0, 1))
        workers = data_cfg.get("num_workers", 0)
        self.loader = DataLoader(MultiTaskDataset(train_sets), batch_sampler=sampler, num_workers=workers,
                                 persistent_workers=workers > 0)

    def resident_batches(self) -> list[tuple[torch.Tensor, ...]]:
        """Every batch of the run, read once through the loader and moved to the device."""
        return [tuple(t.to(self.device) for t in batch) for batch in self.loader]


class ResidentBatches(Dataset):
    """Whole batches already on the device, handed out in order (a DataLoader with batch_size=None)."""

    def __init__(self, batches: list[tuple[torch.Tensor, ...]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.batches[index]


@contextmanager
def resident_training_data(batches: list[tuple[torch.Tensor, ...]]) -> Iterator[None]:
    """`mima fit` reads `batches` in place of its training DataLoader (a benchmark-only patch of the
    data module: the rest of the run, its checkpoints and syncs, is untouched)."""
    original = TaskSuiteDataModule.train_dataloader

    def train_dataloader(self) -> DataLoader:
        return DataLoader(ResidentBatches(batches), batch_size=None)

    TaskSuiteDataModule.train_dataloader = train_dataloader
    try:
        yield
    finally:
        TaskSuiteDataModule.train_dataloader = original


def run_bare(setup: BareSetup, batches: list | None = None) -> tuple[float, int, list[dict]]:
    """MIMA as a plain loop: same model, heads, batches, optimiser and schedule; nothing else. With
    `batches` (resident inputs) it reads those instead of the loader."""
    model_cfg, plan, encoder, device = setup.model_cfg, setup.plan, setup.encoder, setup.device
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=setup.bf16)
    train_with_frozen_batchnorm(encoder)
    phase_start = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
    segment_ends: list[dict] = []
    optimizers: dict[int, torch.optim.Optimizer] = {}  # per task slot: its moments survive phases under "keep"
    start = None
    source = batches if batches is not None else setup.loader
    steps = 0
    for step, (images, labels, _) in enumerate(source):
        if step == 1:
            _synchronize()
            start = time.perf_counter()
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        position = plan.position(step)
        if position.starts_segment:
            encoder.load_state_dict(phase_start)
            if model_cfg["optimizer_state"] == "reset" or position.slot not in optimizers:
                # fused on CUDA, as mima's optimiser (MimaModule.configure_optimizers)
                optimizers[position.slot] = torch.optim.AdamW(encoder.parameters(), lr=model_cfg["lr"],
                                                              weight_decay=model_cfg["weight_decay"],
                                                              fused=True if device == "cuda" else None)
            optimizer = optimizers[position.slot]
        factor = lr_factor(plan, step, model_cfg["lr_schedule"], model_cfg["schedule_scope"], model_cfg["warmup_steps"],
                           model_cfg["segment_warmup_steps"])
        for group in optimizer.param_groups:
            group["lr"] = model_cfg["lr"] * factor
        with autocast:
            loss = F.cross_entropy(classify(encoder, setup.heads[position.slot], images).float(), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        steps = step
        if plan.ends_segment(step):
            segment_ends.append({k: v.detach().clone() for k, v in encoder.state_dict().items()})
            if plan.ends_phase(step):
                final = segment_ends
                phase_start, segment_ends = _average(segment_ends), []
    _synchronize()
    final = [{k: v.cpu() for k, v in state.items()} for state in final]
    return time.perf_counter() - start, steps, final


def _max_difference(first: list[dict], second: list[dict]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for a, b in zip(first, second) for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="S, steps per task")
    parser.add_argument("--iterations", type=int, default=2, help="N")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="mima fit's checkpoint_every (default: K, every task segment; 0: no checkpoints, like the bare loop)")
    parser.add_argument("--preset", choices=tuple(PRESETS), default="cpu", help="cpu: offline MobileNetV2; gpu: ViT-B/32 bf16")
    parser.add_argument("--inputs", choices=("loader", "resident"), default="loader",
                        help="loader: both loops read through the DataLoader; resident: both read the same batches "
                             "already on the device (the trainer alone), plus mima fit with data.cache")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of both loops (default: the preset's threads_per_process); 1 keeps a "
                             "loaded machine's OpenMP barriers from stalling either loop")
    parser.add_argument("--skip-cached", action="store_true",
                        help="with --inputs resident: leave out the third run (mima fit with data.cache)")
    options = parser.parse_args()
    if options.preset == "gpu" and not torch.cuda.is_available():
        parser.error("--preset gpu needs a CUDA device")
    threads = options.threads or PRESETS[options.preset].get("threads_per_process", 2)
    torch.set_num_threads(threads)  # as mima fit's threads_per_process
    resident = options.inputs == "resident"
    # the decoded-image cache is for image files and arrays; the gpu preset's synthetic suite is
    # made of tensors (mima.data.datamodule: "not for tensor suites")
    with_cache = resident and not options.skip_cached and PRESETS[options.preset].get("data", {}).get("suite") != "synthetic"
    if resident and not with_cache and not options.skip_cached:
        print("--preset gpu: the synthetic suite has no decoded-image cache; the data.cache run is left out")
    rates: dict[str, list[float]] = {"mima": [], "bare": [], "mima_cached": []}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(options.repeats):
            timer_file = Path(scratch) / "timer.json"
            config = benchmark_config(options.steps, options.iterations, Path(scratch) / "run", timer_file, options.preset,
                                      options.checkpoint_every)
            config["threads_per_process"] = threads
            setup = BareSetup(config)
            batches = setup.resident_batches() if resident else None
            if resident:
                with resident_training_data(batches):
                    mima_seconds, mima_steps, mima_final = run_mima(config, timer_file)
            else:
                mima_seconds, mima_steps, mima_final = run_mima(config, timer_file)
            bare_seconds, bare_steps, bare_final = run_bare(setup, batches)
            assert mima_steps == bare_steps, (mima_steps, bare_steps)
            rates["mima"].append(mima_steps / mima_seconds)
            rates["bare"].append(bare_steps / bare_seconds)
            line = (f"repeat {repeat + 1}: mima {rates['mima'][-1]:.2f} steps/s, bare {rates['bare'][-1]:.2f} steps/s, "
                    f"{mima_steps} timed steps, final weights max |mima - bare| = {_max_difference(mima_final, bare_final):.2e}")
            if with_cache:
                config["data"]["cache"] = True
                cached_seconds, cached_steps, _ = run_mima(config, timer_file)
                rates["mima_cached"].append(cached_steps / cached_seconds)
                line += f"; mima fit with data.cache {rates['mima_cached'][-1]:.2f} steps/s"
            print(line)
    mima_rate, bare_rate = statistics.median(rates["mima"]), statistics.median(rates["bare"])
    batch = config["data"]["batch_size"]
    where = "on resident inputs" if resident else "through the DataLoader"
    print(f"\nmedian steps/s {where}: mima fit {mima_rate:.2f}, bare PyTorch loop {bare_rate:.2f}; "
          f"ratio mima/bare = {mima_rate / bare_rate:.3f}")
    if with_cache:
        cached_rate = statistics.median(rates["mima_cached"])
        print(f"mima fit with data.cache {cached_rate:.2f} steps/s; ratio to the bare loop on resident inputs = "
              f"{cached_rate / bare_rate:.3f}")
    print(f"images/s (batch {batch}): mima fit {batch * mima_rate:.0f}, bare {batch * bare_rate:.0f}"
          + (f" on {torch.cuda.get_device_name()}" if options.preset == "gpu" else ""))


if __name__ == "__main__":
    main()
