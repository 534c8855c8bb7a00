"""The large-model rows of the GPU suite (benchmarks/gpu_suite.py, issues 36 item 7 and 47 item 6): ViT-L/14-sized work.

  * step       peak device memory and time of one training step of the image tower at batch 128
               in bf16 autocast (AdamW as `mima fit` builds it on CUDA), with and without gradient
               checkpointing, measured from a clean allocator (what was still allocated when the peak
               was reset, after gc, is subtracted), beside what `mima plan` predicts for the same step
               (mima.models.footprint: weights, gradients, moments and traced activations);
  * sync       one MIMA sync of L/14-sized task end weights held on the host
               (mima.training.averaging.average_phase, as `mima fit` runs it at a phase end);
  * merges     CART and TSV of L/14-sized task models through `mima merge`'s file engine: every
               tensor on the device; and on the CPU against the device on fewer tensors (the first
               `cpu_merge_blocks` transformer blocks: the CPU's SVDs of a whole L/14 take minutes), with
               the largest relative difference between the two outputs.

Everything is measured on random weights (`pretrained: none`, nothing is downloaded); the sizes are
a parameter so that `--cpu-smoke` runs the same code on a small tower.
"""

from __future__ import annotations

import gc
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from mima.core.layout import TaskLayout
from mima.models.clip import load_clip
from mima.models.footprint import measure_footprint
from mima.training.averaging import average_phase
from mima.training.resource_plan import step_device_bytes

Progress = Callable[[str, object], None]


@dataclass(frozen=True)
class LargeSize:
    clip: str  # an open_clip architecture, or a local-dir: folder (the smoke tower)
    batch: int
    timed_steps: int
    sync_tasks: int
    merge_tasks: int  # task models merged on the device, every tensor
    cpu_merge_blocks: int = 2  # transformer blocks whose tensors the CPU merges (beside the device, same inputs)
    warmup_steps: int = 2
    sync_repeats: int = 3


L14 = LargeSize("ViT-L-14", batch=128, timed_steps=10, sync_tasks=4, merge_tasks=4, cpu_merge_blocks=4)
# --quick: the same model and batch; fewer timed steps, one timed sync, 2 task models on the device and
# one block's tensors on the CPU
L14_QUICK = LargeSize("ViT-L-14", batch=128, timed_steps=4, sync_tasks=4, merge_tasks=2, cpu_merge_blocks=1,
                      warmup_steps=2, sync_repeats=1)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def image_tower(clip: str, device: str) -> torch.nn.Module:
    """The image tower of `clip` with random weights, on `device`."""
    return load_clip(clip, "none").encoder.to(device)


def clean_allocator(device: str) -> int:
    """Frees what can be freed (gc, then the CUDA caching allocator's unused blocks), resets the peak
    statistics and returns what is still allocated: the baseline a peak is measured from (0 on the CPU,
    which has no device allocator to ask)."""
    gc.collect()
    if device != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def planned_step_bytes(clip: str, batch: int, checkpointing: bool) -> dict[str, int]:
    """The plan's device memory of one training step (the parts mima.training.resource_plan.make_plan
    adds for a process: weights, gradients, two AdamW moments, activations of the batch in bf16-mixed;
    its phase average and CUDA context reserve are left out, which this step does not hold)."""
    parts = step_device_bytes(measure_footprint(clip, "bf16-mixed", checkpointing), batch, mixed=True)
    return {**parts, "total": sum(parts.values())}


def step_measurement(size: LargeSize, device: str, checkpointing: bool) -> dict:
    """Peak device memory and median seconds of a training step (forward, cross-entropy against a
    random frozen head, backward, AdamW) in bf16 autocast, after `warmup_steps` warm-up steps; the
    plan's prediction of the same memory beside it. The peak is counted from a clean allocator: the
    statistics are reset before the tower is built, and what was allocated then (anything the caller
    still holds) is subtracted."""
    cuda = device == "cuda"
    baseline = clean_allocator(device)
    torch.manual_seed(0)
    encoder = image_tower(size.clip, device).train()
    if checkpointing:
        encoder.set_grad_checkpointing(True)
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

    for _ in range(size.warmup_steps):
        step()
    synchronize()
    times = []
    for _ in range(size.timed_steps):
        start = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - baseline if cuda else None
    del encoder, optimizer, images, head, labels
    clean_allocator(device)
    plan = planned_step_bytes(size.clip, size.batch, checkpointing)
    return {"step_s": statistics.median(times), "timed_steps": size.timed_steps, "baseline_bytes": baseline if cuda else None,
            "peak_bytes": peak, "plan_bytes": plan["total"], "plan_parts": plan,
            "peak_over_plan": peak / plan["total"] if peak is not None else None}


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


def sync_measurement(size: LargeSize, device: str, encoder: torch.nn.Module | None = None) -> dict:
    """One sync of `sync_tasks` L/14-sized task end weights on one process."""
    encoder = encoder if encoder is not None else image_tower(size.clip, "cpu")
    state_bytes = sum(value.numel() * value.element_size() for value in encoder.state_dict().values())
    return {"sync_s": sync_seconds(encoder, size.sync_tasks, device, size.sync_repeats), "tasks": size.sync_tasks,
            "state_bytes": state_bytes}


def timed(run: Callable[[], object]) -> tuple[float, object]:
    synchronize()
    start = time.perf_counter()
    value = run()
    synchronize()
    return time.perf_counter() - start, value


BLOCK = re.compile(r"(?:^|\.)resblocks\.(\d+)\.")


def block_keys(state: dict[str, torch.Tensor], blocks: int) -> list[str]:
    """The keys of the first `blocks` transformer blocks (open_clip's `transformer.resblocks.<i>.`); every
    key where the tower has no such blocks."""
    chosen = [key for key in state if (found := BLOCK.search(key)) and int(found.group(1)) < blocks]
    return chosen or list(state)


def write_task_models(size: LargeSize, folder: Path, tasks: int, keys: list[str] | None = None,
                      theta_0: dict[str, torch.Tensor] | None = None) -> tuple[Path, list[Path]]:
    """theta_0 and `tasks` perturbed copies of an L/14-sized image tower (only `keys`, when given), as
    safetensors files."""
    from mima.core.safetensors_io import save_state_dict

    folder.mkdir(parents=True, exist_ok=True)
    if theta_0 is None:
        theta_0 = {key: value.detach().contiguous() for key, value in image_tower(size.clip, "cpu").state_dict().items()}
    if keys is not None:
        theta_0 = {key: theta_0[key] for key in keys}
    base = folder / "theta_0.safetensors"
    save_state_dict(base, theta_0)
    generator = torch.Generator().manual_seed(1)
    models = []
    for task in range(tasks):
        models.append(folder / f"task_{task}.safetensors")
        save_state_dict(models[-1], {key: (value + 1e-3 * torch.randn(value.shape, generator=generator)
                                           if value.is_floating_point() else value) for key, value in theta_0.items()})
    return base, models


def large_rows(size: LargeSize, device: str, scratch: Path, progress: Progress = lambda label, value: None) -> dict:
    """Every large-model measurement on `device` (merges: the CPU against `device` on fewer tensors);
    `progress` hears each one as it finishes (and the partial result, under "large", through
    `progress("large (partial)", result)`)."""
    result: dict = {"model": size.clip, "batch": size.batch, "step": {}}
    for name in ("no_checkpointing", "checkpointing"):
        result["step"][name] = step_measurement(size, device, checkpointing=name == "checkpointing")
        progress(f"large step, {name}", result["step"][name])
    encoder = image_tower(size.clip, "cpu")
    result["sync"] = sync_measurement(size, device, encoder)
    progress("large sync", result["sync"])
    theta_0 = {key: value.detach().contiguous() for key, value in encoder.state_dict().items()}
    del encoder
    result["merges"] = merge_measurements(size, device, scratch, progress, theta_0)
    progress("large merges", result["merges"])
    return result


def gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f} GiB"


def large_table(large: dict) -> list[tuple]:
    """Rows (measurement, value, reference, ratio) of the large-model results."""
    rows: list[tuple] = [("measurement", "value", "reference", "value / reference")]
    for name, label in (("no_checkpointing", "step, no checkpointing"), ("checkpointing", "step, checkpointing")):
        step = large.get("step", {}).get(name)
        if step is None:
            continue
        ratio = f"{step['peak_over_plan']:.3f}" if step["peak_over_plan"] is not None else ""
        rows.append((f"{label} (s)", f"{step['step_s']:.3f}", "", ""))
        rows.append((f"{label}, peak memory above baseline vs plan", gib(step["peak_bytes"]), gib(step["plan_bytes"]),
                     ratio))
    sync = large.get("sync")
    if sync:
        rows.append((f"one sync, {sync['tasks']} tasks of {sync['state_bytes'] / 1e9:.2f} GB (s)", f"{sync['sync_s']:.3f}",
                     "", ""))
    for method, merge in (large.get("merges") or {}).items():
        rows.append((f"{method}, {merge['tasks']} tasks, every tensor, on {merge['device']} (s)", f"{merge['full_device_s']:.2f}",
                     "", ""))
        rows.append((f"{method}, {merge['tasks']} tasks, {merge['subset_share']:.1%} of the elements: "
                     f"{merge['device']} vs cpu (s)", f"{merge['device_s']:.2f}", f"{merge['cpu_s']:.2f}",
                     f"{merge['device_s'] / merge['cpu_s']:.3f}"))
        rows.append((f"{method}: largest relative difference ({merge['device']} vs cpu)",
                     f"{merge['max_relative_difference']:.2e}", "", ""))
    return rows


MERGE_METHODS = ("cart", "tsv")


def merge_measurements(size: LargeSize, device: str, scratch: Path, progress: Progress = lambda label, value: None,
                       theta_0: dict[str, torch.Tensor] | None = None) -> dict:
    """CART and TSV (their default hyperparameters) through `mima merge`'s file engine: `merge_tasks`
    L/14-sized task models, every tensor, on `device` (timed only); then the same methods on the tensors
    of the first `cpu_merge_blocks` blocks of the same models, on `device` and on the CPU, with the
    largest difference between the two outputs relative to the largest entry of its tensor (the CPU
    against itself in the smoke mode: 0). The CPU uses every core (an earlier `mima fit` in the same
    process lowers torch's thread count to its threads_per_process)."""
    from mima.core.safetensors_io import load_state_dict
    from mima.merging import get_method
    from mima.merging.engine import merge_to_file, open_inputs

    if theta_0 is None:
        theta_0 = {key: value.detach().contiguous() for key, value in image_tower(size.clip, "cpu").state_dict().items()}
    keys = block_keys(theta_0, size.cpu_merge_blocks)
    share = sum(theta_0[key].numel() for key in keys) / sum(value.numel() for value in theta_0.values())
    threads = torch.get_num_threads()

    def run(name: str, base: Path, models: list[Path], where: str, output: Path) -> float:
        torch.set_num_threads(os.cpu_count() or threads if where == "cpu" else threads)
        try:
            with open_inputs(models, base) as inputs:
                seconds, _ = timed(lambda: merge_to_file(get_method(name), inputs, output, {}, {"method": name},
                                                         overwrite=True, device=torch.device(where)))
        finally:
            torch.set_num_threads(threads)
        return seconds

    results: dict[str, dict] = {}
    full_base, full_models = write_task_models(size, scratch / "full", size.merge_tasks, theta_0=theta_0)
    full_s = {}
    for name in MERGE_METHODS:
        full_s[name] = run(name, full_base, full_models, device, scratch / f"{name}-full.safetensors")
        progress(f"large merge {name}, {size.merge_tasks} tasks, every tensor, on {device} (s)", full_s[name])
        (scratch / f"{name}-full.safetensors").unlink()
    for path in (full_base, *full_models):
        path.unlink()
    base, models = write_task_models(size, scratch / "subset", size.merge_tasks, keys=keys, theta_0=theta_0)
    for name in MERGE_METHODS:
        seconds = {}
        for label, where in (("device", device), ("cpu", "cpu")):
            output = scratch / f"{name}-{label}.safetensors"
            seconds[label] = run(name, base, models, where, output)
            progress(f"large merge {name}, {share:.1%} of the elements, on {where} (s)", seconds[label])
        cpu = load_state_dict(scratch / f"{name}-cpu.safetensors")
        other = load_state_dict(scratch / f"{name}-device.safetensors")
        worst = max(float((other[key].float() - cpu[key].float()).abs().max() / cpu[key].float().abs().max().clamp_min(1e-30))
                    for key in cpu)
        results[name] = {"tasks": size.merge_tasks, "device": device, "full_device_s": full_s[name],
                         "subset_keys": len(keys), "subset_share": share,
                         "cpu_s": seconds["cpu"], "device_s": seconds["device"],
                         "cpu_s_scaled_to_every_tensor": seconds["cpu"] / share, "max_relative_difference": worst}
    return results


def main() -> None:
    """Only the merge rows, on their own: `python benchmarks/gpu_large.py [--tasks 4] [--cpu-blocks 4]`."""
    import argparse
    import json
    import tempfile

    parser = argparse.ArgumentParser(description="CART and TSV of L/14-sized task models on the GPU and the CPU")
    parser.add_argument("--tasks", type=int, default=L14.merge_tasks)
    parser.add_argument("--cpu-blocks", type=int, default=L14.cpu_merge_blocks,
                        help="transformer blocks whose tensors the CPU merges beside the device")
    options = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = replace(L14, merge_tasks=options.tasks, cpu_merge_blocks=options.cpu_blocks)
    with tempfile.TemporaryDirectory() as scratch:
        result = merge_measurements(size, device, Path(scratch), lambda label, value: print(f"{label}: {value}", flush=True))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
