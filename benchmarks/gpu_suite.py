"""The GPU suite: one command, one table, one JSON file (issue 23, item 6).

    python benchmarks/gpu_suite.py [--json gpu_suite.json] [--repeats 1] [--peak-tflops T]
    python benchmarks/gpu_suite.py --cpu-smoke        # the same measurements, reduced, on the CPU

What it measures, on one device (a ViT-B/32 image tower with random weights, bf16 autocast, batch
128, two tasks read from folders of random PNG images that this script writes; S steps per task,
N phases, one process):
  * fit, resident      `mima fit` steps/s against a bare PyTorch loop, both on the same batches
                       already on the device (benchmarks/trainer_overhead.py --inputs resident):
                       the trainer's own cost;
  * fit, data.cache    `mima fit` with the decoded-image cache (uint8 batches read from the
                       memory-mapped cache, crop and normalisation on the device) against the same
                       bare loop: how close a real run's input path gets to the model's compute;
  * MFU                model FLOPs utilisation: FLOPs of one training step (counted by
                       torch.utils.flop_counter on the real model and batch) x steps/s over the
                       device's dense bf16 peak (PEAK_BF16_TFLOPS, or --peak-tflops);
  * evaluation         images/s of mima's evaluation (TaskEvaluator over both tasks' test splits,
                       at most `workers` loader workers alive, mima.evaluation.loader_pool) against
                       a bare loop over one persistent DataLoader per task;
  * sync               seconds of one MIMA sync of the run's tasks on one process
                       (`mima.training.averaging.average_phase`: average and Gram matrices of the
                       task end weights held on the host, as `mima fit` holds them);
  * checkpoint stall   share of the resident fit's time that checkpointing costs: 1 - t(no
                       checkpoints) / t(a checkpoint at every segment end);
  * AdamW kernel       which AdamW implementation `mima fit` ran (fused, foreach or the per-tensor
                       loop), read from the optimiser of the resident fit (bf16-mixed, no clipping;
                       the paper configs clip gradients, with which Lightning's mixed precision
                       refuses the fused kernel: foreach there);
  * ViT-L/14           (benchmarks/gpu_large.py) peak memory and time of a batch-128 bf16 training
                       step with and without gradient checkpointing beside the plan's memory; one
                       L/14-sized sync; CART and TSV of L/14-sized task models on the CPU and on the
                       GPU, with the largest relative difference of their outputs.

--cpu-smoke runs every measurement on the CPU with a small CLIP and a few steps (no bf16 peak: no
MFU; the large rows on the small tower, CPU against CPU); tests/test_gpu_suite.py runs it. On one H100
the whole suite is meant to take under 9 minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import open_clip
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Subset
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trainer_overhead, and its StepTimer by class path

from gpu_large import L14, LargeSize, large_rows, large_table, sync_seconds  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from trainer_overhead import BareSetup, resident_training_data, run_bare, run_mima  # noqa: E402

from mima.core.safetensors_io import save_state_dict  # noqa: E402
from mima.models.classifier import classify  # noqa: E402
from mima.training.plan_choices import peak_bf16_tflops  # noqa: E402

# A small CLIP for --cpu-smoke: a ViT image tower of the same kind as ViT-B/32, 32x32 inputs.
SMOKE_CLIP = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16, "mlp_ratio": 2},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


@dataclass(frozen=True)
class Size:
    """The suite's scale: the GPU defaults, or the CPU smoke run's."""

    clip: str  # open_clip architecture, or "smoke" for SMOKE_CLIP
    batch: int
    steps: int  # S per task
    iterations: int  # N
    images_per_class: int
    image_side: int  # of the PNG files (resized by the model's transforms)
    workers: int
    eval_images: int


GPU = Size("ViT-B-32", batch=128, steps=100, iterations=2, images_per_class=64, image_side=256, workers=8,
           eval_images=4096)
SMOKE = Size("smoke", batch=8, steps=4, iterations=2, images_per_class=6, image_side=40, workers=0, eval_images=32)
SMOKE_LARGE = LargeSize("smoke", batch=8, timed_steps=3, sync_tasks=2, merge_tasks=2)  # the smoke tower
TASKS = ("noise_a", "noise_b")
CLASSES = 4


def write_image_tasks(root: Path, size: Size) -> list[dict]:
    """Two custom tasks of random RGB PNG files (flat layout, CLASSES class folders each): a real
    image input path, which the decoded-image cache applies to."""
    generator = np.random.default_rng(0)
    tasks = []
    for name in TASKS:
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


class AdamWKernel(Callback):
    """Writes which AdamW implementation the run's optimiser uses, as torch documents its choice:
    fused when asked for, else foreach unless refused (torch's default where every parameter is on
    CUDA), else the per-tensor loop."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        optimizer = trainer.optimizers[0]
        on_cuda = all(p.device.type == "cuda" for group in optimizer.param_groups for p in group["params"])
        fused, foreach = optimizer.defaults.get("fused"), optimizer.defaults.get("foreach")
        kernel = "fused" if fused else "foreach" if foreach or (foreach is None and on_cuda) else "for-loop"
        Path(self.path).write_text(json.dumps({"kernel": kernel, "fused": fused, "foreach": foreach}))


def fit_config(size: Size, clip: str, tasks: list[dict], out: Path, timer_file: Path, cuda: bool,
               checkpoint_every: str | int = "segment") -> dict:
    """The `mima fit` config of every fit run of the suite."""
    return {
        "seed_everything": 0,
        "threads_per_process": 4 if cuda else 2,
        "checkpoint_every": checkpoint_every,
        "model": {"clip": clip, "pretrained": "none", "heads": "zero_shot", "steps": size.steps,
                  "iterations": size.iterations, "lr": 1e-5, "warmup_steps": max(1, size.steps // 10),
                  "lr_schedule": "constant"},
        "data": {"suite": None, "tasks": list(TASKS), "custom_tasks": tasks, "batch_size": size.batch, "seed": 0,
                 "num_workers": size.workers},
        "trainer": {"accelerator": "gpu" if cuda else "cpu", "devices": 1, "precision": "bf16-mixed",
                    "enable_model_summary": False, "enable_progress_bar": False,
                    "callbacks": [{"class_path": "trainer_overhead.StepTimer", "init_args": {"path": str(timer_file)}},
                                  {"class_path": "gpu_suite.AdamWKernel",
                                   "init_args": {"path": str(timer_file.with_name("adamw.json"))}}]},
        "out": str(out),
        "overwrite": True,
    }


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_flops(setup: BareSetup, batch: tuple[torch.Tensor, ...]) -> int:
    """FLOPs of one training step's forward and backward pass (the optimiser's few element-wise
    FLOPs per parameter left out), counted on the real model and batch."""
    images, labels, _ = batch
    counter = FlopCounterMode(display=False)
    with counter, torch.autocast(setup.device, dtype=torch.bfloat16, enabled=setup.bf16):
        loss = F.cross_entropy(classify(setup.encoder, setup.heads[0], images).float(), labels)
        loss.backward()
    setup.encoder.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


def evaluation_rates(setup: BareSetup, size: Size) -> dict[str, float]:
    """Images/s of mima's evaluation (TaskEvaluator: every task's test split, cycled up to
    `eval_images` per task, through the process's one bounded set of loader workers,
    mima.evaluation.loader_pool) and of a bare loop over one persistent DataLoader per task (what
    mima did before the workers were bounded); each timed on its second pass (the first warms up).
    Their correct counts must agree."""
    from mima.evaluation.accuracy import EvalSettings, TaskEvaluator

    datasets = {}
    for name in setup.plan.tasks:
        test = setup.splits[name].test
        datasets[name] = Subset(test, [index % len(test) for index in range(size.eval_images)])
    heads = dict(zip(setup.plan.tasks, setup.heads))
    cuda = setup.device == "cuda"
    settings = EvalSettings(batch_size=size.batch * 2, num_workers=size.workers, pin_memory=cuda)
    evaluator = TaskEvaluator(setup.encoder, heads, datasets, settings=settings)
    state = {key: value.detach().clone() for key, value in setup.encoder.state_dict().items()}
    loaders = {name: DataLoader(dataset, batch_size=size.batch * 2, num_workers=size.workers, pin_memory=cuda,
                                persistent_workers=size.workers > 0) for name, dataset in datasets.items()}
    encoder = setup.encoder

    @torch.inference_mode()
    def bare() -> dict[str, int]:
        encoder.eval()  # as the evaluator does
        correct = {}
        for name, loader in loaders.items():
            total = torch.zeros((), dtype=torch.long, device=setup.device)
            for images, labels in loader:
                logits = classify(encoder, heads[name], images.to(setup.device, non_blocking=True))
                total += (logits.argmax(1) == labels.to(setup.device, non_blocking=True)).sum()
            correct[name] = int(total.item())
        return correct

    def mima() -> dict[str, int]:
        return {name: correct for name, (correct, _) in evaluator.counts(state).items()}

    rates, counts = {}, {}
    images = sum(len(dataset) for dataset in datasets.values())
    for label, run in (("mima", mima), ("bare", bare)):
        run()
        synchronize()
        start = time.perf_counter()
        counts[label] = run()
        synchronize()
        rates[label] = images / (time.perf_counter() - start)
    if counts["mima"] != counts["bare"]:
        raise RuntimeError(f"evaluation: mima and the bare loop disagree ({counts})")
    evaluator.loaders.close()
    return rates


def peak_tflops(device: str, given: float | None) -> float | None:
    if given is not None:
        return given
    return peak_bf16_tflops(torch.cuda.get_device_name()) if device == "cuda" else None


def progress(label: str, value: object) -> None:
    """One line per finished measurement, flushed: a run cut off by a time limit keeps what it measured."""
    print(f"[{time.strftime('%H:%M:%S')}] {label}: {value}", flush=True)


def measure(size: Size, large: LargeSize, repeats: int, peak_given: float | None, scratch: Path) -> dict:
    cuda = torch.cuda.is_available() and size is not SMOKE
    clip = smoke_clip(scratch / "clip") if size is SMOKE else size.clip
    tasks = write_image_tasks(scratch / "tasks", size)
    timer_file = scratch / "timer.json"
    rates: dict[str, list[float]] = {"mima": [], "bare": [], "cached": [], "no_checkpoints": []}
    setup = None
    for _ in range(repeats):
        config = fit_config(size, clip, tasks, scratch / "run", timer_file, cuda)
        setup = BareSetup(config)
        batches = setup.resident_batches()
        with resident_training_data(batches):
            seconds, steps, _ = run_mima(config, timer_file)
            rates["mima"].append(steps / seconds)
            progress("fit, resident inputs (steps/s)", rates["mima"][-1])
            quiet = fit_config(size, clip, tasks, scratch / "run", timer_file, cuda, checkpoint_every=0)
            seconds, steps, _ = run_mima(quiet, timer_file)
            rates["no_checkpoints"].append(steps / seconds)
            progress("fit, resident inputs, no checkpoints (steps/s)", rates["no_checkpoints"][-1])
        seconds, steps, _ = run_bare(setup, batches)
        rates["bare"].append(steps / seconds)
        progress("bare loop (steps/s)", rates["bare"][-1])
        flops = step_flops(setup, batches[0])
        del batches
        config["data"]["cache"] = True
        seconds, steps, _ = run_mima(config, timer_file)
        rates["cached"].append(steps / seconds)
        progress("fit, data.cache (steps/s)", rates["cached"][-1])
    median = {key: statistics.median(values) for key, values in rates.items()}
    peak = peak_tflops(setup.device, peak_given)
    evaluation = evaluation_rates(setup, size)
    progress("evaluation (images/s)", evaluation)
    adamw = json.loads(timer_file.with_name("adamw.json").read_text())
    progress("AdamW kernel", adamw)
    sync_s = sync_seconds(setup.encoder, len(setup.plan.tasks), setup.device)
    progress("one sync (s)", sync_s)
    device_name = torch.cuda.get_device_name() if setup.device == "cuda" else "cpu"
    del setup  # the B/32 tower and its batches, before the large rows
    large_clip = smoke_clip(scratch / "clip") if size is SMOKE else large.clip
    large_result = large_rows(LargeSize(large_clip, large.batch, large.timed_steps, large.sync_tasks, large.merge_tasks),
                              "cuda" if cuda else "cpu", scratch / "large", progress)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": device_name,
        "torch": torch.__version__,
        "mode": "cpu-smoke" if size is SMOKE else "gpu",
        "model": size.clip if size is not SMOKE else "smoke CLIP (ViT tower, width 32, 2 layers, 32x32)",
        "batch": size.batch, "steps_per_task": size.steps, "iterations": size.iterations, "tasks": len(TASKS),
        "repeats": repeats,
        "steps_per_s": {key: values for key, values in rates.items()},
        "median_steps_per_s": median,
        "fit_over_bare_resident": median["mima"] / median["bare"],
        "cached_over_bare_resident": median["cached"] / median["bare"],
        "flops_per_step": flops,
        "peak_bf16_tflops": peak,
        "mfu": {key: median[key] * flops / (peak * 1e12) for key in ("mima", "bare", "cached")} if peak else None,
        "eval_images_per_s": evaluation,
        "eval_over_bare": evaluation["mima"] / evaluation["bare"],
        "sync_s": sync_s,
        "checkpoint_stall_share": max(0.0, 1.0 - median["mima"] / median["no_checkpoints"]),
        "adamw": adamw,
        "large": {"model": large.clip if size is not SMOKE else "smoke CLIP", "batch": large.batch, **large_result},
    }


def table(result: dict) -> str:
    median, mfu = result["median_steps_per_s"], result["mfu"] or {}

    def share(key: str) -> str:
        return f"{100 * mfu[key]:.1f} %" if key in mfu else "n/a"

    rows = [
        ("fit, resident inputs (steps/s)", f"{median['mima']:.2f}", f"{median['bare']:.2f}",
         f"{result['fit_over_bare_resident']:.3f}", share("mima")),
        ("fit, data.cache (steps/s)", f"{median['cached']:.2f}", f"{median['bare']:.2f}",
         f"{result['cached_over_bare_resident']:.3f}", share("cached")),
        ("bare loop MFU", "", "", "", share("bare")),
        ("evaluation (images/s)", f"{result['eval_images_per_s']['mima']:.0f}",
         f"{result['eval_images_per_s']['bare']:.0f}", f"{result['eval_over_bare']:.3f}", ""),
        ("one sync (s)", f"{result['sync_s']:.4f}", "", "", ""),
        ("checkpoint stall share", f"{100 * result['checkpoint_stall_share']:.1f} %", "", "", ""),
    ]
    rows.append(("AdamW kernel", result["adamw"]["kernel"], "", "", ""))
    header = ("measurement", "mima", "bare", "mima / bare", "MFU")
    lines = [f"{result['mode']} on {result['device']} ({result['date']}; {result['model']}, batch {result['batch']}, "
             f"S = {result['steps_per_task']}, N = {result['iterations']}, T = {result['tasks']}, "
             f"{result['flops_per_step'] / 1e9:.2f} GFLOP per step, peak {result['peak_bf16_tflops'] or 'unknown'} TFLOP/s)"]
    lines += aligned([header] + rows)
    large = result["large"]
    lines.append(f"{large['model']}, batch {large['batch']}:")
    lines += aligned(large_table(large))
    return "\n".join(lines)


def aligned(rows: list[tuple]) -> list[str]:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return [" | ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="reduced mode on the CPU (what the test runs)")
    parser.add_argument("--json", default="gpu_suite.json", help="where the results are written")
    parser.add_argument("--repeats", type=int, default=1, help="fit runs of each kind (the median is reported)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak (default: PEAK_BF16_TFLOPS by device name)")
    options = parser.parse_args()
    if not options.cpu_smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or --cpu-smoke for the reduced CPU mode")
    size, large = (SMOKE, SMOKE_LARGE) if options.cpu_smoke else (GPU, L14)
    if options.cpu_smoke:
        torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as scratch:
        result = measure(size, large, options.repeats, options.peak_tflops, Path(scratch))
    print(table(result))
    Path(options.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {options.json}")


if __name__ == "__main__":
    main()
