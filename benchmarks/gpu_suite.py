"""The GPU suite: one command, one table, one JSON file (issue 23 item 6, issue 47 item 6).

    python benchmarks/gpu_suite.py [--quick] [--json PATH] [--overwrite] [--peak-tflops T]
    python benchmarks/gpu_suite.py --cpu-smoke --json PATH   # every row, reduced, on the CPU

Rows, on one device (a ViT-B/32 image tower with random weights, bf16 autocast, two tasks read from
folders of random PNG images that this script writes; S steps per task, N phases, one process):
  * bare anchors       a bare training step (encoder, frozen head, cross-entropy, fused AdamW on CUDA)
                       on resident random inputs: eager and compiled (the encoder compiled in place,
                       as `mima fit` compiles it), at batch 128 and 512; the compile time (the first
                       step) is reported apart, the rate is counted after warm-up steps;
  * mima fit           `mima fit` (batch 128, 2 tasks, a checkpoint at every segment end) on the same
                       device-resident batches for both (benchmarks/trainer_overhead.py), with
                       `--model.compile false` and `true`; and with `data.cache` (the real input path,
                       `model.compile: auto`). Rates from the fit's `fit_warmup`-th step to its end
                       (the first step, which compiles, timed apart);
  * batch_tasks        `mima fit` with `model.batch_tasks: true` on 8 tasks of one process (3 in the
                       smoke run), each step one batch of every task;
  * evaluation         images/s of TaskEvaluator over both tasks' test splits (cycled to
                       `eval_images` each) from the PNG files (`--cache off`: loader workers decode
                       them) and from the decoded-image cache (`--cache on`: whole uint8 batches made
                       on the device, the encoder compiled on CUDA), against a bare compiled
                       inference loop over the same images already on the device;
  * sync               seconds of one MIMA sync of the run's 2 tasks on one process;
  * checkpoint stall   the compiled fit's time in checkpoint code (its checkpoint callback's own
                       count) over its timed seconds; in the plain run also 1 - (its steps/s) /
                       (steps/s of the same fit with `checkpoint_every: 0`);
  * ViT-L/14           (benchmarks/gpu_large.py) time and peak memory of a batch-128 bf16 training
                       step with and without gradient checkpointing, from a clean allocator (every
                       ViT-B/32 tensor freed first), beside the plan's memory; one sync of 4 L/14-sized
                       tasks; CART and TSV of L/14-sized task models on the GPU (every tensor), and on
                       the CPU beside the GPU on the tensors of the first few transformer blocks.
Ratios (the issue's goals, side by side from one run): mima fit compiled / bare compiled images/s at
batch 128; evaluation from the cache / the bare compiled inference loop; L/14 measured peak / plan,
with and without gradient checkpointing.

Modes: the plain run keeps every row at full size; --quick runs every row scaled to fit 5 minutes on
one H100 or H200 (fewer steps, repeats, images and merge tensors: QUICK and L14_QUICK); --cpu-smoke
runs every row on the CPU with a small CLIP (tests/benchmarks/test_gpu_suite.py; the suite's own compiled loops
use torch.compile's "aot_eager" backend there, since TorchInductor's C++ compile of every shape would
take minutes on 2 cores; `mima fit`'s compiled row compiles as it always does).

Each row is printed as soon as it is measured and the JSON (default benchmarks/results/<device>-<date>
.json, -quick or -cpu-smoke added for those modes; never overwritten without --overwrite) is rewritten
after every row, with "complete": false until the end: a run cut by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import open_clip
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Subset
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trainer_overhead, gpu_large; FitProbe by class path

from gpu_large import L14, L14_QUICK, LargeSize, large_rows, large_table  # noqa: E402
from gpu_large import sync_seconds  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from trainer_overhead import BareSetup, resident_training_data  # noqa: E402

from mima.commands.fit.run import run_fit  # noqa: E402
from mima.core.safetensors_io import save_state_dict  # noqa: E402
from mima.models.classifier import classify  # noqa: E402
from mima.training.plan_choices import peak_bf16_tflops  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

# A small CLIP for --cpu-smoke: a ViT image tower of the same kind as ViT-B/32, 32x32 inputs.
SMOKE_CLIP = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16, "mlp_ratio": 2},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


@dataclass(frozen=True)
class Size:
    """The suite's scale: the plain run's, --quick's or the CPU smoke run's."""

    mode: str  # "gpu", "quick" or "cpu-smoke"
    clip: str  # open_clip architecture, or "smoke" for SMOKE_CLIP
    batch: int  # of every fit and the first bare anchors
    large_batch: int  # the second bare anchors
    steps: int  # S per task
    iterations: int  # N
    images_per_class: int
    image_side: int  # of the PNG files (resized by the model's transforms)
    workers: int
    eval_images: int  # per task; a multiple of the evaluation batch (2 x batch): one compiled shape
    anchor_warmup: int  # bare steps after the first (which compiles) before the clock starts
    anchor_steps: int  # timed bare steps
    fit_warmup: int  # fit steps before the clock starts (the first compiles)
    stall_by_rates: bool  # a second compiled fit without checkpoints, for the stall share by rates
    anchor_backend: str  # torch.compile backend of the suite's own compiled loops
    large: LargeSize
    batch_tasks: int = 8  # tasks of the batch_tasks row


GPU = Size("gpu", "ViT-B-32", batch=128, large_batch=512, steps=100, iterations=2, images_per_class=64, image_side=256,
           workers=8, eval_images=4096, anchor_warmup=5, anchor_steps=50, fit_warmup=3, stall_by_rates=True,
           anchor_backend="inductor", large=L14)
QUICK = dataclasses.replace(GPU, mode="quick", steps=40, images_per_class=32, eval_images=1024, anchor_warmup=3,
                            anchor_steps=20, stall_by_rates=False, large=L14_QUICK)
SMOKE_LARGE = LargeSize("smoke", batch=8, timed_steps=3, sync_tasks=2, merge_tasks=2, cpu_merge_blocks=1,
                        warmup_steps=1, sync_repeats=1)
SMOKE = Size("cpu-smoke", "smoke", batch=8, large_batch=16, steps=4, iterations=2, images_per_class=6, image_side=40,
             workers=0, eval_images=32, anchor_warmup=1, anchor_steps=3, fit_warmup=1, stall_by_rates=True,
             anchor_backend="aot_eager", large=SMOKE_LARGE, batch_tasks=3)
TASKS = ("noise_a", "noise_b")
CLASSES = 4


class Results:
    """The run's JSON, rewritten (atomically) after every row, and one printed line per row."""

    def __init__(self, path: Path, header: dict) -> None:
        self.path, self.data = path, {**header, "complete": False}

    def record(self, section: str, key: str | None, value: object) -> None:
        if key is None:
            self.data[section] = value
        else:
            self.data.setdefault(section, {})[key] = value
        label = section if key is None else f"{section}, {key}"
        print(f"[{time.strftime('%H:%M:%S')}] {label}: {value}", flush=True)
        self.flush()

    def attempt(self, section: str, key: str | None, run: Callable[[], object]) -> object | None:
        """Records what `run` measures; if it raises, records the row as failed (the error, its traceback
        printed) and returns None: the suite goes on to its other rows and exits non-zero at the end."""
        try:
            value = run()
        except Exception as error:
            self.failed(section, key, error)
            return None
        self.record(section, key, value)
        return value

    def failed(self, section: str, key: str | None, error: Exception) -> None:
        traceback.print_exc()
        self.data.setdefault("failed_rows", []).append(section if key is None else f"{section}, {key}")
        partial = self.data.get(section) if key is None else self.data.get(section, {}).get(key)
        kept = partial if isinstance(partial, dict) else {}  # what the row recorded before it failed
        self.record(section, key, {**kept, "failed": f"{type(error).__name__}: {error}"})

    def flush(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(self.data, indent=2))
        os.replace(partial, self.path)


def write_image_tasks(root: Path, size: Size, names: tuple[str, ...] = TASKS) -> list[dict]:
    """Custom tasks of random RGB PNG files (flat layout, CLASSES class folders each): a real image input
    path, which the decoded-image cache applies to."""
    generator = np.random.default_rng(0)
    tasks = []
    for name in names:
        for label in range(CLASSES):
            folder = root / name / f"class_{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(size.images_per_class):
                pixels = generator.integers(0, 256, (size.image_side, size.image_side, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{index}.png")
        tasks.append({"name": name, "path": str(root / name)})
    return tasks


def smoke_clip(root: Path) -> str:
    """SMOKE_CLIP with random weights, written as an open_clip model folder (`local-dir:`)."""
    torch.manual_seed(0)
    model = open_clip.CLIP(**SMOKE_CLIP)
    root.mkdir(parents=True, exist_ok=True)
    (root / "open_clip_config.json").write_text(json.dumps({"model_cfg": SMOKE_CLIP, "preprocess_cfg": {}}))
    save_state_dict(root / "open_clip_model.safetensors", model.state_dict())
    return f"local-dir:{root}"


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def adamw_kernel(optimizer: torch.optim.Optimizer) -> dict:
    """Which AdamW implementation `optimizer` runs, as torch documents its choice: fused when asked
    for, else foreach unless refused (torch's default where every parameter is on CUDA), else the
    per-tensor loop."""
    on_cuda = all(p.device.type == "cuda" for group in optimizer.param_groups for p in group["params"])
    fused, foreach = optimizer.defaults.get("fused"), optimizer.defaults.get("foreach")
    kernel = "fused" if fused else "foreach" if foreach or (foreach is None and on_cuda) else "for-loop"
    return {"kernel": kernel, "fused": fused, "foreach": foreach}


class FitProbe(Callback):
    """What the suite reads of a `mima fit`, written to `path` at the end: the first step's seconds
    (where a compiled encoder compiles), the seconds from the start of step `skip` to the end of
    training and the steps in them, the AdamW kernel, whether the encoder was compiled, and the seconds
    the run's checkpoint callback says checkpoints held up training (its `stall_s`)."""

    def __init__(self, path: str, skip: int = 1) -> None:
        self.path, self.skip = path, skip
        self.first = self.first_step_s = self.start = None
        self.adamw: dict | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.adamw = adamw_kernel(trainer.optimizers[0])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 0 and self.first is None:
            synchronize()
            self.first = time.perf_counter()
        if trainer.global_step == self.skip and self.start is None:
            synchronize()
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 1 and self.first_step_s is None:
            synchronize()
            self.first_step_s = time.perf_counter() - self.first

    def on_train_end(self, trainer, pl_module) -> None:
        synchronize()
        stall = [callback.stall_s for callback in trainer.callbacks if hasattr(callback, "stall_s")]
        Path(self.path).write_text(json.dumps({
            "seconds": time.perf_counter() - self.start, "steps": trainer.global_step - self.skip,
            "first_step_s": self.first_step_s, "adamw": self.adamw, "compiled": getattr(pl_module, "compiled", None),
            "stall_s": stall[0] if stall else None}))


def fit_config(size: Size, clip: str, tasks: list[dict], out: Path, probe_file: Path, cuda: bool,
               compile_setting: bool | str, checkpoint_every: str | int = "segment") -> dict:
    """The `mima fit` config of every fit of the suite (its own copies of `tasks`: loading a config
    turns the custom tasks it holds into namespaces in place)."""
    return {
        "seed_everything": 0,
        "threads_per_process": 4 if cuda else 2,
        "checkpoint_every": checkpoint_every,
        "model": {"clip": clip, "pretrained": "none", "heads": "zero_shot", "steps": size.steps,
                  "iterations": size.iterations, "lr": 1e-5, "warmup_steps": max(1, size.steps // 10),
                  "lr_schedule": "constant", "compile": compile_setting},
        "data": {"suite": None, "tasks": [task["name"] for task in tasks], "custom_tasks": [dict(task) for task in tasks],
                 "batch_size": size.batch, "seed": 0, "num_workers": size.workers},
        "trainer": {"accelerator": "gpu" if cuda else "cpu", "devices": 1, "precision": "bf16-mixed",
                    "enable_model_summary": False, "enable_progress_bar": False,
                    "callbacks": [{"class_path": "gpu_suite.FitProbe",
                                   "init_args": {"path": str(probe_file), "skip": size.fit_warmup}}]},
        "out": str(out),
        "overwrite": True,
    }


def rate_row(steps: int, seconds: float, batch: int, flops_per_image: float, peak: float | None) -> dict:
    """steps/s, images/s and MFU (None where the device's bf16 peak is unknown) of `steps` in `seconds`."""
    images_per_s = steps * batch / seconds
    return {"steps_per_s": steps / seconds, "images_per_s": images_per_s, "timed_steps": steps, "seconds": seconds,
            "mfu": images_per_s * flops_per_image / (peak * 1e12) if peak else None}


def fit_row(config: dict, probe_file: Path, flops_per_image: float, peak: float | None) -> dict:
    """One `mima fit` of `config`, as read by its FitProbe."""
    if config["model"]["compile"] is not False:
        torch.compiler.reset()  # nothing compiled earlier in this process counts against torch's recompile limit
    run_fit(config)
    facts = json.loads(probe_file.read_text())
    row = rate_row(facts["steps"], facts["seconds"], config["data"]["batch_size"], flops_per_image, peak)
    return {**row, **{key: facts[key] for key in ("first_step_s", "compiled", "stall_s", "adamw")}}


def step_flops(setup: BareSetup, batch: int) -> int:
    """FLOPs of one training step's forward and backward pass at `batch` (the optimiser's few
    element-wise FLOPs per parameter left out), counted on the real model."""
    images, labels = random_batch(setup, batch, 0)
    counter = FlopCounterMode(display=False)
    with counter, torch.autocast(setup.device, dtype=torch.bfloat16, enabled=setup.bf16):
        loss = F.cross_entropy(classify(setup.encoder, setup.heads[0], images).float(), labels)
        loss.backward()
    setup.encoder.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def random_batch(setup: BareSetup, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, setup.image_size, setup.image_size, generator=generator)
    labels = torch.randint(0, CLASSES, (batch,), generator=generator)
    return images.to(setup.device), labels.to(setup.device)


def bare_anchor(setup: BareSetup, size: Size, batch: int, compiled: bool, flops_per_image: float,
                peak: float | None) -> dict:
    """A bare training loop on two resident random batches taking turns: a copy of the encoder
    (compiled in place, as `mima fit` compiles it, when `compiled`), the first task's frozen head,
    cross-entropy, AdamW (fused on CUDA) in bf16 autocast. The first step (the compile) is timed
    apart; the clock runs over `anchor_steps` steps after `anchor_warmup` more."""
    if compiled:
        torch.compiler.reset()
    torch.manual_seed(0)
    encoder = copy.deepcopy(setup.encoder).train()
    if compiled:
        encoder.compile(backend=size.anchor_backend)
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-5, weight_decay=0.1,
                                  fused=True if setup.device == "cuda" else None)
    head = setup.heads[0]
    batches = [random_batch(setup, batch, seed) for seed in (1, 2)]

    def step(index: int) -> None:
        images, labels = batches[index % 2]
        with torch.autocast(setup.device, dtype=torch.bfloat16, enabled=setup.bf16):
            loss = F.cross_entropy(classify(encoder, head, images).float(), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    synchronize()
    start = time.perf_counter()
    step(0)
    synchronize()
    first_step_s = time.perf_counter() - start
    for index in range(size.anchor_warmup):
        step(index + 1)
    synchronize()
    start = time.perf_counter()
    for index in range(size.anchor_steps):
        step(index)
    synchronize()
    row = rate_row(size.anchor_steps, time.perf_counter() - start, batch, flops_per_image, peak)
    row.update(batch=batch, compiled=compiled, backend=size.anchor_backend if compiled else None,
               first_step_s=first_step_s)
    del encoder, optimizer, batches
    gc.collect()
    return row


def batch_tasks_row(size: Size, clip: str, scratch: Path, cuda: bool, flops_per_image: float,
                    peak: float | None) -> dict:
    """The batch_tasks row: `mima fit` with `model.batch_tasks: true` on `size.batch_tasks` tasks of one
    process, from the decoded-image cache: each optimiser step takes one batch of every task (the
    stacked forward is not compiled yet: `model.compile: auto` stays eager when batched)."""
    names = tuple(f"batch_task_{index}" for index in range(size.batch_tasks))
    tasks = write_image_tasks(scratch / "batch_tasks", size, names)
    probe_file = scratch / "probe-batch-tasks.json"
    config = fit_config(size, clip, tasks, scratch / "run-batch-tasks", probe_file, cuda, "auto")
    config["model"]["batch_tasks"] = True
    config["data"]["cache"] = True
    row = fit_row(config, probe_file, flops_per_image * size.batch_tasks, peak)
    images_per_step = size.batch * size.batch_tasks
    row.update(tasks=size.batch_tasks, images_per_step=images_per_step, images_per_s=row["steps_per_s"] * images_per_step)
    return row


def evaluation_rows(setup: BareSetup, size: Size, results: Results) -> None:
    """Images/s of TaskEvaluator over both tasks' test splits (each cycled to `eval_images` images) from
    the PNG files and from the decoded-image cache, and of a bare compiled inference loop over the same
    images already on the device; each timed on its second pass (the first warms up and compiles).
    Correct counts are recorded beside the rates (on the CPU the two evaluator paths agree exactly)."""
    from mima.evaluation.accuracy import EvalSettings, TaskEvaluator, default_precision
    from mima.evaluation.cache_use import CacheUse
    from mima.evaluation.cached_batches import cached_eval_splits

    device = torch.device(setup.device)
    cuda = device.type == "cuda"
    precision = default_precision(device)
    batch = 2 * size.batch
    heads = dict(zip(setup.plan.tasks, setup.heads))
    state = {key: value.detach().clone() for key, value in setup.encoder.state_dict().items()}
    cached_splits = cached_eval_splits(setup.data, setup.splits, setup.image_size, setup.preprocess,
                                       CacheUse.EVERY_TASK)

    def cycled(split) -> Subset:
        return Subset(split, [index % len(split) for index in range(size.eval_images)])

    images = size.eval_images * len(heads)

    def timed_passes(run: Callable[[], dict]) -> dict:
        synchronize()
        start = time.perf_counter()
        run()
        synchronize()
        first_pass_s = time.perf_counter() - start
        start = time.perf_counter()
        counts = run()
        synchronize()
        seconds = time.perf_counter() - start
        return {"images_per_s": images / seconds, "images": images, "seconds": seconds, "first_pass_s": first_pass_s,
                "correct": counts, "batch": batch, "precision": precision}

    for label, cache, datasets in (("png", CacheUse.OFF, {name: cycled(setup.splits[name].test) for name in heads}),
                                   ("cache", CacheUse.EVERY_TASK,
                                    {name: cycled(cached_splits[name].test) for name in heads})):
        settings = EvalSettings(precision=precision, batch_size=batch, num_workers=size.workers if cache == CacheUse.OFF
                                else 0, pin_memory=cuda, cache=cache)
        evaluator = TaskEvaluator(setup.encoder, heads, datasets, settings=settings)
        row = timed_passes(lambda: {name: correct for name, (correct, _) in evaluator.counts(state).items()})
        results.record("evaluation", label, {**row, "cache": cache.value, "workers": settings.num_workers})
        if cache == CacheUse.OFF:
            evaluator.loaders.close()
        else:  # the same images, made once on the device: the bare loop's resident inputs
            resident = {name: list(evaluator.loader(name)) for name in heads}
        del evaluator

    torch.compiler.reset()
    encoder = copy.deepcopy(setup.encoder).eval()
    compiled = torch.compile(encoder, dynamic=False, backend=size.anchor_backend)
    autocast_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    compile_s = []

    @torch.no_grad()
    def bare() -> dict:
        correct = {}
        for name, batches in resident.items():
            total = torch.zeros((), dtype=torch.long, device=device)
            for images_, labels in batches:
                start = time.perf_counter() if not compile_s else None
                with (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()):
                    features = compiled(images_)
                logits = classify(torch.nn.Identity(), heads[name].to(device), features.float())
                total += (logits.argmax(1) == labels).sum()
                if start is not None:
                    synchronize()
                    compile_s.append(time.perf_counter() - start)
            correct[name] = int(total.item())
        return correct

    row = timed_passes(bare)
    results.record("evaluation", "bare_resident",
                   {**row, "compiled": True, "backend": size.anchor_backend, "compile_s": compile_s[0]})
    del resident, compiled, encoder
    gc.collect()


def b32_rows(size: Size, clip: str, scratch: Path, cuda: bool, peak_given: float | None, results: Results) -> None:
    """Every ViT-B/32 row (the small tower's in the smoke mode); nothing it allocates outlives it. A row
    that fails is recorded as failed (`Results.attempt`) and the suite goes on."""
    tasks = write_image_tasks(scratch / "tasks", size)
    probe_file = scratch / "probe.json"
    config = fit_config(size, clip, tasks, scratch / "run", probe_file, cuda, False)
    setup = BareSetup(config)
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_given if peak_given is not None else peak_bf16_tflops(device_name) if cuda else None
    flops = step_flops(setup, size.batch)
    flops_per_image = flops / size.batch
    results.record("flops_per_step", None, flops)
    results.record("peak_bf16_tflops", None, peak)

    for batch in (size.batch, size.large_batch):
        for compiled in (False, True):
            results.attempt("bare_anchor", f"{'compiled' if compiled else 'eager'}_{batch}",
                            lambda: bare_anchor(setup, size, batch, compiled, flops_per_image, peak))

    def fit(compile_setting: bool | str, checkpoint_every: str | int = "segment", cache: bool = False) -> dict:
        config = fit_config(size, clip, tasks, scratch / "run", probe_file, cuda, compile_setting, checkpoint_every)
        config["data"]["cache"] = cache
        return fit_row(config, probe_file, flops_per_image, peak)

    batches = setup.resident_batches()
    with resident_training_data(batches):
        results.attempt("fit", "eager", lambda: fit(False))
        results.attempt("fit", "compiled", lambda: fit(True))
        if size.stall_by_rates:
            results.attempt("fit", "compiled_no_checkpoints", lambda: fit(True, checkpoint_every=0))
    del batches
    gc.collect()
    results.attempt("fit", "cached", lambda: fit("auto", cache=True))
    results.attempt("batch_tasks", None, lambda: batch_tasks_row(size, clip, scratch, cuda, flops_per_image, peak))
    results.attempt("checkpoint_stall", None, lambda: checkpoint_stall(results.data["fit"]))
    try:
        evaluation_rows(setup, size, results)
    except Exception as error:  # the rows measured before it are kept
        results.failed("evaluation", "failed", error)
    results.attempt("sync", None, lambda: {"sync_s": sync_seconds(setup.encoder, len(setup.plan.tasks), setup.device),
                                           "tasks": len(setup.plan.tasks)})
    del setup


def checkpoint_stall(fits: dict) -> dict:
    """The compiled fit's time in checkpoint code over its timed time; and 1 - its steps/s over those
    of the same fit without checkpoints, where that was run."""
    fit = fits["compiled"]
    stall = {"stall_s": fit["stall_s"], "timed_s": fit["seconds"], "share_of_fit": (fit["stall_s"] or 0.0) / fit["seconds"]}
    if "compiled_no_checkpoints" in fits:
        stall["share_by_rates"] = max(0.0, 1.0 - fit["steps_per_s"] / fits["compiled_no_checkpoints"]["steps_per_s"])
    return stall


def ratios(data: dict) -> dict:
    """The issue's goals and their neighbours, each the quotient of two rates recorded in `data`
    (None where either is missing: a failed or cut row)."""
    anchors, fits, evaluation = data.get("bare_anchor", {}), data.get("fit", {}), data.get("evaluation", {})
    batch = data["batch"]

    def quotient(first: dict, first_key: str, second: dict, second_key: str) -> float | None:
        a, b = (first.get(first_key) or {}).get("images_per_s"), (second.get(second_key) or {}).get("images_per_s")
        return a / b if a is not None and b else None

    cached_compiled = (fits.get("cached") or {}).get("compiled")
    found = {
        "fit_compiled_over_bare_compiled": quotient(fits, "compiled", anchors, f"compiled_{batch}"),
        "fit_eager_over_bare_eager": quotient(fits, "eager", anchors, f"eager_{batch}"),
        "fit_cached_over_bare": quotient(fits, "cached", anchors, f"{'compiled' if cached_compiled else 'eager'}_{batch}"),
        "bare_compiled_over_eager": {str(b): quotient(anchors, f"compiled_{b}", anchors, f"eager_{b}")
                                     for b in (batch, data["large_batch"])},
        "eval_cache_over_bare_resident": quotient(evaluation, "cache", evaluation, "bare_resident"),
        "eval_cache_over_png": quotient(evaluation, "cache", evaluation, "png"),
    }
    steps = (data.get("large") or {}).get("step", {})
    found["large_peak_over_plan"] = {name: step.get("peak_over_plan") for name, step in steps.items()}
    return found


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def default_json(mode: str, device_name: str) -> Path:
    suffix = "" if mode == "gpu" else f"-{mode}"
    return RESULTS / f"{device_slug(device_name)}-{time.strftime('%Y-%m-%d', time.gmtime())}{suffix}.json"


def fmt(value: object, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def table(data: dict) -> str:
    """The run's table: one line per row; a row missing from a cut run is left out, a failed or absent
    row says so."""
    anchors, fits, evaluation = data.get("bare_anchor", {}), data.get("fit", {}), data.get("evaluation", {})
    ratio = data.get("ratios", {})
    rows: list[tuple] = [("measurement", "images/s", "steps/s", "MFU", "first step / compile (s)")]

    def share(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.1f} %"

    def cells(label: str, row: dict) -> tuple:
        if "images_per_s" not in row:  # failed, or absent
            return (label, row.get("failed") or row.get("absent") or "n/a", "", "", "")
        compile_s = row.get("first_step_s", row.get("compile_s", row.get("first_pass_s")))
        return (label, f"{row['images_per_s']:.0f}", fmt(row.get("steps_per_s")), share(row.get("mfu")),
                fmt(compile_s, ".1f"))

    for key, row in anchors.items():
        rows.append(cells(f"bare loop, {key.replace('_', ', batch ')}", row))
    for key, row in fits.items():
        rows.append(cells(f"mima fit, {key.replace('_', ' ')}", row))
    if "batch_tasks" in data:
        rows.append(cells(f"mima fit, batch_tasks, {data['size']['batch_tasks']} tasks", data["batch_tasks"]))
    for key, label in (("png", "evaluation from PNGs"), ("cache", "evaluation from the cache"),
                       ("bare_resident", "bare compiled inference, resident inputs"), ("failed", "evaluation")):
        if key in evaluation:
            rows.append(cells(label, evaluation[key]))
    lines = [f"{data['mode']} on {data['device']} ({data['date']}; {data['model']}, batch {data['batch']} / "
             f"{data['large_batch']}, S = {data['steps_per_task']}, N = {data['iterations']}, T = {data['tasks']}, "
             f"{fmt((data.get('flops_per_step') or 0) / 1e9)} GFLOP per step at batch {data['batch']}, "
             f"peak {data.get('peak_bf16_tflops') or 'unknown'} TFLOP/s)"]
    lines += aligned(rows)
    others = []
    sync, stall = data.get("sync", {}), data.get("checkpoint_stall", {})
    if sync:
        others.append(("one sync, 2 tasks (s)", fmt(sync.get("sync_s"), ".4f") if "failed" not in sync else sync["failed"]))
    if stall:
        others.append(("checkpoint stall, share of the compiled fit",
                       share(stall.get("share_of_fit")) if "failed" not in stall else stall["failed"]))
        if "share_by_rates" in stall:
            others.append(("checkpoint stall, 1 - rate / rate without checkpoints", share(stall["share_by_rates"])))
    if "adamw" in fits.get("compiled", {}):
        others.append(("AdamW kernel (compiled fit)", fits["compiled"]["adamw"]["kernel"]))
    for key, label in (("fit_compiled_over_bare_compiled", "goal: mima fit compiled / bare compiled, images/s"),
                       ("fit_eager_over_bare_eager", "mima fit eager / bare eager"),
                       ("fit_cached_over_bare", "mima fit data.cache / bare (same compile setting)"),
                       ("eval_cache_over_bare_resident", "goal: evaluation from the cache / bare resident inference"),
                       ("eval_cache_over_png", "evaluation from the cache / from PNGs")):
        if key in ratio:
            others.append((label, fmt(ratio[key], ".3f")))
    for name, value in ratio.get("large_peak_over_plan", {}).items():
        others.append((f"goal: L/14 peak / plan, {name.replace('_', ' ')}", fmt(value, ".3f")))
    if data.get("failed_rows"):
        others.append(("failed rows", "; ".join(data["failed_rows"])))
    if others:
        lines += aligned([("measurement", "value")] + others)
    large = data.get("large")
    if large:
        lines.append(f"{large['model']}, batch {large['batch']}:" + (f" (failed: {large['failed']})" if "failed" in large else ""))
        lines += aligned(large_table(large))
    return "\n".join(lines)


def aligned(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return [" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in rows]


def free_device() -> int:
    """After the ViT-B/32 rows: everything they compiled and allocated released (torch.compile's caches
    hold the compiled encoders), so that the L/14 peaks are measured from a clean allocator; returns
    what is still allocated."""
    torch.compiler.reset()
    gc.collect()
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--quick", action="store_true", help="every row, scaled to fit 5 minutes on one H100 or H200")
    modes.add_argument("--cpu-smoke", action="store_true", help="every row, reduced, on the CPU (what the test runs)")
    parser.add_argument("--json", default=None,
                        help="where the results are written (default benchmarks/results/<device>-<date>[-mode].json)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing results file")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak (default: PEAK_BF16_TFLOPS by device name)")
    options = parser.parse_args()
    size = SMOKE if options.cpu_smoke else QUICK if options.quick else GPU
    cuda = torch.cuda.is_available() and size is not SMOKE
    if size is not SMOKE and not cuda:
        parser.error("no CUDA device: run on a GPU, or --cpu-smoke for the reduced CPU mode")
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    path = Path(options.json) if options.json else default_json(size.mode, device_name)
    if path.exists() and not options.overwrite:
        parser.error(f"{path} exists: give --overwrite to replace it, or --json PATH")
    if size is SMOKE:
        torch.set_num_threads(2)
    started = time.perf_counter()
    results = Results(path, {
        "mode": size.mode, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device_name,
        "torch": torch.__version__, "size": dataclasses.asdict(size),
        "model": size.clip if size is not SMOKE else "smoke CLIP (ViT tower, width 32, 2 layers, 32x32)",
        "batch": size.batch, "large_batch": size.large_batch, "steps_per_task": size.steps,
        "iterations": size.iterations, "tasks": len(TASKS)})
    results.flush()
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        clip = smoke_clip(scratch / "clip") if size is SMOKE else size.clip
        try:
            b32_rows(size, clip, scratch, cuda, options.peak_tflops, results)
        except Exception as error:  # its setup failed: the L/14 rows can still run
            results.failed("b32_rows", None, error)
        results.record("ratios", None, ratios(results.data))
        results.record("allocated_before_large_bytes", None, free_device())
        large = size.large if size is not SMOKE else dataclasses.replace(size.large, clip=clip)

        def hear(label: str, value: object) -> None:
            print(f"[{time.strftime('%H:%M:%S')}] {label}: {value}", flush=True)
            partial = results.data.setdefault("large", {"model": "smoke CLIP" if size is SMOKE else large.clip,
                                                         "batch": large.batch})
            if label.startswith("large step, "):
                partial.setdefault("step", {})[label.removeprefix("large step, ")] = value
            elif label in ("large sync", "large merges"):
                partial[label.removeprefix("large ")] = value
            results.flush()

        def large_part() -> dict:
            found = large_rows(large, "cuda" if cuda else "cpu", scratch / "large", hear)
            return {**found, "model": "smoke CLIP"} if size is SMOKE else found

        results.attempt("large", None, large_part)
    results.record("ratios", None, ratios(results.data))
    results.data["seconds"] = time.perf_counter() - started
    results.data["complete"] = True
    results.flush()
    print(table(results.data))
    print(f"wrote {path} ({results.data['seconds']:.0f} s)")
    if results.data.get("failed_rows"):
        sys.exit(f"gpu_suite: failed rows: {'; '.join(results.data['failed_rows'])}")


if __name__ == "__main__":
    main()
