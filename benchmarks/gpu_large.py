"""The large-model rows of the GPU suite (benchmarks/gpu_suite.py, issue 36 item 7): ViT-L/14-sized work.

  * step       peak device memory and time of one training step of the image tower at batch 128
               in bf16 autocast (AdamW as `mima fit` builds it on CUDA), with and without gradient
               checkpointing, beside what `mima plan` predicts for the same step
               (mima.models.footprint: weights, gradients, moments and traced activations);
  * sync       one MIMA sync of L/14-sized task end weights held on the host
               (mima.training.averaging.average_phase, as `mima fit` runs it at a phase end);
  * merges     CART and TSV of L/14-sized task models on the CPU and on the GPU through `mima
               merge`'s file engine, with the largest relative difference between the two outputs.

Everything is measured on random weights (`pretrained: none`, nothing is downloaded); the sizes are
a parameter so that `--cpu-smoke` runs the same code on a small tower.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mima.core.layout import TaskLayout
from mima.models.clip import load_clip
from mima.models.footprint import measure_footprint
from mima.training.averaging import average_phase


@dataclass(frozen=True)
class LargeSize:
    clip: str  # an open_clip architecture, or a local-dir: folder (the smoke tower)
    batch: int
    timed_steps: int
    sync_tasks: int
    merge_tasks: int


L14 = LargeSize("ViT-L-14", batch=128, timed_steps=10, sync_tasks=4, merge_tasks=4)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def image_tower(clip: str, device: str) -> torch.nn.Module:
    """The image tower of `clip` with random weights, on `device`."""
    return load_clip(clip, "none").encoder.to(device)


def step_measurement(size: LargeSize, device: str, checkpointing: bool) -> dict:
    """Peak device memory and median seconds of a training step (forward, cross-entropy against a
    random frozen head, backward, AdamW) in bf16 autocast, after two warm-up steps; the plan's
    prediction of the same memory beside it."""
    torch.manual_seed(0)
    encoder = image_tower(size.clip, device).train()
    if checkpointing:
        encoder.set_grad_checkpointing(True)
    cuda = device == "cuda"
    optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-5, weight_decay=0.1, fused=True if cuda else None)
    image_side = int(encoder.image_size[0] if isinstance(encoder.image_size, (tuple, list)) else encoder.image_size)
    images = torch.randn(size.batch, 3, image_side, image_side, device=device)
    head = torch.randn(encoder.output_dim, 10, device=device)
    labels = torch.randint(0, 10, (size.batch,), device=device)

    def step() -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = F.cross_entropy((encoder(images) @ head).float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    synchronize()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(size.timed_steps):
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    footprint = measure_footprint(size.clip, "bf16-mixed", checkpointing)
    predicted = 4 * footprint.parameter_bytes + size.batch * footprint.activation_bytes_per_example \
        + footprint.activation_fixed_bytes  # weights, gradients, two moments, activations (no phase average)
    result = {"step_s": statistics.median(times), "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
              "plan_bytes": predicted}
    del encoder, optimizer, images
    if cuda:
        torch.cuda.empty_cache()
    return result


def sync_seconds(encoder: torch.nn.Module, tasks: int, device: str, repeats: int = 3) -> float:
    """Median seconds of one sync on one process, as `mima fit` runs it at a phase end: `tasks` end
    weights held on the host (perturbed copies of the encoder's), averaged and compared on `device`
    (the first of repeats + 1 syncs, a warm-up, not counted)."""
    theta_0 = {key: value.detach().to("cpu", copy=True) for key, value in encoder.state_dict().items()}
    keys = [key for key, value in theta_0.items() if value.is_floating_point()]
    diagnostic = {name for name, parameter in encoder.named_parameters() if parameter.requires_grad}
    generator = torch.Generator().manual_seed(0)
    states = [{key: value + 1e-3 * torch.randn(value.shape, generator=generator) if key in keys else value
               for key, value in theta_0.items()} for _ in range(tasks)]
    target = torch.device(device)
    previous = {key: theta_0[key].to(target) for key in keys}
    layout = TaskLayout(tasks, 1)
    times = [timed(lambda: average_phase(states, keys, layout, theta_0, previous, diagnostic, target))[0]
             for _ in range(repeats + 1)]
    return statistics.median(times[1:])


def sync_measurement(size: LargeSize, device: str) -> dict:
    """One sync of `sync_tasks` L/14-sized task end weights on one process."""
    encoder = image_tower(size.clip, "cpu")
    state_bytes = sum(value.numel() * value.element_size() for value in encoder.state_dict().values())
    return {"sync_s": sync_seconds(encoder, size.sync_tasks, device), "tasks": size.sync_tasks, "state_bytes": state_bytes}


def timed(run: Callable[[], object]) -> tuple[float, object]:
    synchronize()
    start = time.perf_counter()
    value = run()
    synchronize()
    return time.perf_counter() - start, value


def write_task_models(size: LargeSize, folder: Path) -> tuple[Path, list[Path]]:
    """theta_0 and `merge_tasks` perturbed copies of an L/14-sized image tower, as safetensors files."""
    from mima.core.safetensors_io import save_state_dict

    folder.mkdir(parents=True, exist_ok=True)
    theta_0 = {key: value.detach().contiguous() for key, value in image_tower(size.clip, "cpu").state_dict().items()}
    base = folder / "theta_0.safetensors"
    save_state_dict(base, theta_0)
    generator = torch.Generator().manual_seed(1)
    models = []
    for task in range(size.merge_tasks):
        models.append(folder / f"task_{task}.safetensors")
        save_state_dict(models[-1], {key: (value + 1e-3 * torch.randn(value.shape, generator=generator)
                                           if value.is_floating_point() else value) for key, value in theta_0.items()})
    return base, models


def large_rows(size: LargeSize, device: str, scratch: Path,
               progress: Callable[[str, object], None] = lambda label, value: None) -> dict:
    """Every large-model measurement on `device` (merges: the CPU against `device`); `progress` hears
    each one as it finishes."""
    step = {}
    for name in ("no_checkpointing", "checkpointing"):
        step[name] = step_measurement(size, device, checkpointing=name == "checkpointing")
        progress(f"large step, {name}", step[name])
    sync = sync_measurement(size, device)
    progress("large sync", sync)
    merges = merge_measurements(size, device, scratch, progress)
    progress("large merges", merges)
    return {"step": step, "sync": sync, "merges": merges}


def gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f} GiB"


def large_table(large: dict) -> list[tuple]:
    """Rows (measurement, value, reference, ratio) of the large-model results."""
    rows: list[tuple] = [("measurement", "value", "reference", "value / reference")]
    for name, label in (("no_checkpointing", "step, no checkpointing"), ("checkpointing", "step, checkpointing")):
        step = large["step"][name]
        ratio = f"{step['peak_bytes'] / step['plan_bytes']:.3f}" if step["peak_bytes"] else ""
        rows.append((f"{label} (s)", f"{step['step_s']:.3f}", "", ""))
        rows.append((f"{label}, peak memory vs plan", gib(step["peak_bytes"]), gib(step["plan_bytes"]), ratio))
    sync = large["sync"]
    rows.append((f"one sync, {sync['tasks']} tasks of {sync['state_bytes'] / 1e9:.2f} GB (s)", f"{sync['sync_s']:.3f}", "", ""))
    for method, merge in large["merges"].items():
        rows.append((f"{method}, {merge['tasks']} tasks: {merge['device']} vs cpu (s)", f"{merge['device_s']:.2f}",
                     f"{merge['cpu_s']:.2f}", f"{merge['device_s'] / merge['cpu_s']:.3f}"))
        rows.append((f"{method}: largest relative difference", f"{merge['max_relative_difference']:.2e}", "", ""))
    return rows


MERGE_METHODS = ("cart", "tsv")


def merge_measurements(size: LargeSize, device: str, scratch: Path,
                       progress: Callable[[str, object], None] = lambda label, value: None) -> dict:
    """CART and TSV (their default hyperparameters) of `merge_tasks` L/14-sized task models through the
    file engine on `device` and on the CPU (the CPU again in the smoke mode): seconds of each and the
    largest difference between the two outputs relative to the largest entry of its tensor. The
    device runs first (the CPU's SVDs take minutes at this size: a run cut off by a time limit keeps
    the device's times), and the CPU uses every core (an earlier `mima fit` in the same process
    lowers torch's thread count to its threads_per_process)."""
    from mima.core.safetensors_io import load_state_dict
    from mima.merging import get_method
    from mima.merging.engine import merge_to_file, open_inputs

    base, models = write_task_models(size, scratch / "models")
    outputs: dict[tuple[str, str], Path] = {}
    seconds: dict[tuple[str, str], float] = {}
    threads = torch.get_num_threads()
    for label, where in (("device", device), ("cpu", "cpu")):
        torch.set_num_threads(os.cpu_count() or threads if where == "cpu" else threads)
        for name in MERGE_METHODS:
            output = outputs[name, label] = scratch / f"{name}-{label}.safetensors"
            with open_inputs(models, base) as inputs:
                seconds[name, label], _ = timed(lambda: merge_to_file(get_method(name), inputs, output, {}, {"method": name},
                                                                      overwrite=True, device=torch.device(where)))
            progress(f"large merge {name} on {where} (s)", seconds[name, label])
    torch.set_num_threads(threads)
    results = {}
    for name in MERGE_METHODS:
        cpu, other = load_state_dict(outputs[name, "cpu"]), load_state_dict(outputs[name, "device"])
        worst = max(float((other[key].float() - cpu[key].float()).abs().max() / cpu[key].float().abs().max().clamp_min(1e-30))
                    for key in cpu)
        results[name] = {"tasks": size.merge_tasks, "device": device, "cpu_s": seconds[name, "cpu"],
                         "device_s": seconds[name, "device"], "max_relative_difference": worst}
    return results


def main() -> None:
    """Only the merge rows, on their own (the suite runs them last): `python benchmarks/gpu_large.py`."""
    import argparse
    import json
    import tempfile

    parser = argparse.ArgumentParser(description="CART and TSV of L/14-sized task models on the GPU and the CPU")
    parser.add_argument("--tasks", type=int, default=L14.merge_tasks)
    options = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = LargeSize(L14.clip, L14.batch, L14.timed_steps, L14.sync_tasks, options.tasks)
    with tempfile.TemporaryDirectory() as scratch:
        result = merge_measurements(size, device, Path(scratch), lambda label, value: print(f"{label}: {value}", flush=True))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
