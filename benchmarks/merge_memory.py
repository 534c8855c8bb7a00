"""Memory and time of merging T = 8 ViT-B/32-sized image encoders: `mima merge` vs a naive merge.

Writes T + 1 random models with the real open_clip ViT-B-32 image-encoder keys and shapes (about
88M parameters, 335 MiB each in float32), then runs each merge (task_arithmetic, ties, cart) in its
own process, twice: `mima merge` (streams tensor by tensor) and a naive implementation that does
the same merge with plain torch, every model loaded, as the reference codebases do (TIES on the
stacked flattened task vectors, as the official code). The naive run's time is the work any merge
of these files must do (read every model, compute, write one), so mima's time over it is what
streaming costs.

Memory is peak *anonymous* memory (RssAnon: tensors and heap), sampled every 2 ms from
/proc/PID/statm (resident minus file-backed and shared pages) by a sampler at real-time priority
(so a busy machine does not make it miss peaks), minus the same program's peak on a
tiny merge (the cost of importing torch and friends: the floor). Pages of the input files that a
process maps (safetensors.safe_open memory-maps them) are clean page cache the kernel can drop at
any time, so they are left out; the total peak RSS (ru_maxrss, file pages included) is printed
beside it. A sampled peak can miss an allocation that lives less than 2 ms; the merges' large
buffers live far longer. Wall times on a shared machine move with its load: the CPU time (user +
system, all threads) of each run is printed too.

    python benchmarks/merge_memory.py [--tasks 8] [--folder DIR] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

METHODS = ("task_arithmetic", "ties", "cart")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
SAMPLE_SECONDS = 0.002


# ----------------------------------------------------------------------- the naive merges
def naive_merge(method: str, base_path: str, model_paths: list[str], output: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from mima.merging.cart import DEFAULT_MATRIX_KEYS, cart_rank, is_matrix

    base = load_file(base_path)
    models = [load_file(path) for path in model_paths]
    keys = [k for k, v in base.items() if v.is_floating_point()]
    merged = dict(base)
    if method == "task_arithmetic":
        for key in keys:
            merged[key] = base[key] + 0.4 * sum(m[key] - base[key] for m in models)
    elif method == "ties":
        flat = torch.stack([torch.cat([(m[k] - base[k]).reshape(-1) for k in keys]) for m in models])
        kth = flat.shape[1] - int(flat.shape[1] * 0.2)
        thresholds = flat.abs().kthvalue(kth, dim=1, keepdim=True).values
        trimmed = flat * (flat.abs() >= thresholds)
        sign = torch.sign(trimmed.sum(0))
        sign[sign == 0] = torch.sign(sign.sum())
        selected = trimmed * torch.where(sign > 0, trimmed > 0, trimmed < 0)
        vector = selected.sum(0) / (selected != 0).sum(0).clamp(min=1)
        offset = 0
        for key in keys:
            size = base[key].numel()
            merged[key] = base[key] + vector[offset : offset + size].reshape(base[key].shape)
            offset += size
    else:
        for key in keys:
            average = torch.stack([m[key] for m in models]).mean(0)
            merged[key] = average
            if is_matrix(key, average, DEFAULT_MATRIX_KEYS):
                rank = cart_rank(average.shape, 0.08)
                for m in models:
                    u, s, vh = torch.linalg.svd(m[key] - average, full_matrices=False)
                    merged[key] = merged[key] + (u[:, :rank] * s[:rank]) @ vh[:rank]
    save_file({k: v.contiguous() for k, v in merged.items()}, output)


# ------------------------------------------------------------------------- model files
def model_folder(folder: Path | None, prefix: str) -> Path:
    """Where the models go: `folder`, or a new temporary folder named with `prefix`."""
    folder = folder or Path(tempfile.mkdtemp(prefix=prefix))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_models(folder: Path, tasks: int, model_name: str) -> tuple[Path, list[Path], int]:
    import open_clip
    import torch

    from mima.core.tensor_files import SafetensorsWriter

    shapes = {k: (v.shape, v.dtype) for k, v in open_clip.create_model(model_name).visual.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    paths = [folder / "base.safetensors"] + [folder / f"task{t}.safetensors" for t in range(tasks)]
    for index, path in enumerate(paths):
        specs = [(key, shape, dtype) for key, (shape, dtype) in shapes.items()]
        with SafetensorsWriter(path, specs, overwrite=True) as writer:
            for key, (shape, dtype) in shapes.items():
                base = torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))
                tensor = base if index == 0 else base + 0.01 * torch.randn(shape, generator=generator)
                writer.write(key, tensor.to(dtype))
    model_bytes = sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in shapes.values())
    return paths[0], paths[1:], model_bytes


@dataclass(frozen=True)
class Measured:
    seconds: float
    cpu_seconds: float  # user + system, all threads: less sensitive than wall time to a busy machine
    peak_anonymous: int  # bytes, sampled
    peak_resident: int  # bytes, ru_maxrss (file pages included)


def run_measured(command: list[str]) -> Measured:
    """Wall seconds, peak anonymous memory and peak resident set of `command`.

    A child forked from this (large) process would start with this process's resident pages and
    Linux keeps that high-water mark across exec, so a small stdlib-only wrapper does the fork."""
    result = subprocess.run([sys.executable, __file__, "--measure", *command], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    seconds, cpu_seconds, anonymous, resident = result.stdout.split()[-4:]
    return Measured(float(seconds), float(cpu_seconds), int(anonymous), int(resident))


def anonymous_bytes(pid: int) -> int:
    """RssAnon of `pid` from /proc/PID/statm: resident pages minus shared ones (file-backed and shmem)."""
    with open(f"/proc/{pid}/statm") as statm:
        fields = statm.read().split()
    return (int(fields[1]) - int(fields[2])) * PAGE_SIZE


def measure(command: list[str]) -> None:
    """Run `command` from this small process; print its wall time, peak RssAnon and peak RSS (bytes)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sample_promptly()
    peak_anonymous = 0
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid != 0:
            break
        try:
            peak_anonymous = max(peak_anonymous, anonymous_bytes(process.pid))
        except (OSError, IndexError, ValueError):  # exiting between wait4 and the read
            pass
        time.sleep(SAMPLE_SECONDS)
    elapsed = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.stderr.write(process.stderr.read().decode())
        sys.exit(1)
    cpu_seconds = usage.ru_utime + usage.ru_stime
    print(f"{elapsed} {cpu_seconds} {peak_anonymous} {usage.ru_maxrss * 1024}")  # ru_maxrss is in KiB on Linux


def sample_promptly() -> None:
    """Have this sampler woken on time on a busy machine, where an ordinary process can wait tens of
    milliseconds for a core and miss a peak. It sleeps between reads, so real-time priority costs
    the machine little; the merge was started before, with the ordinary policy."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    except (AttributeError, OSError):  # not allowed here: the best ordinary priority, or none
        try:
            os.nice(-20)
        except OSError:
            pass


def mima_command(method: str, base: Path, models: list[Path], output: Path) -> list[str]:
    command = [sys.executable, "-m", "mima", "merge", "--method", method, "--models", *map(str, models),
               "--output", str(output), "--overwrite"]
    return command + (["--base", str(base)] if method != "cart" else [])


def naive_command(method: str, base: Path, models: list[Path], output: Path) -> list[str]:
    return [sys.executable, __file__, "--naive", method, str(base), *map(str, models), str(output)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--model", default="ViT-B-32", help="open_clip architecture whose image encoder shapes to use")
    parser.add_argument("--folder", type=Path, help="where to write the models (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the model files")
    parser.add_argument("--naive", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--measure", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure)
        return
    if args.naive:
        method, base, *models, output = args.naive
        naive_merge(method, base, models, output)
        return

    folder = model_folder(args.folder, "mima-merge-memory-")
    try:
        print(f"writing {args.tasks + 1} random {args.model} image encoders to {folder} ...", flush=True)
        base, models, model_bytes = write_models(folder, args.tasks, args.model)
        tiny = folder / "tiny"
        tiny.mkdir(exist_ok=True)
        tiny_base, tiny_models, _ = _tiny_models(tiny)
        print(f"one model: {model_bytes / 2**20:.0f} MiB; T = {args.tasks}\n", flush=True)
        rows: dict[tuple[str, str], tuple[Measured, Measured]] = {}
        for method in METHODS:
            for name, build in (("mima", mima_command), ("naive", naive_command)):
                floor = run_measured(build(method, tiny_base, tiny_models, tiny / f"{name}-{method}.safetensors"))
                run = run_measured(build(method, base, models, folder / f"{name}-{method}.safetensors"))
                rows[method, name] = run, floor
                print(f"  {method:<16} {name:<6} {run.seconds:7.1f} s ({run.cpu_seconds:.1f} s CPU)  peak anonymous {run.peak_anonymous / 2**20:7.0f} MiB "
                      f"({(run.peak_anonymous - floor.peak_anonymous) / model_bytes:5.2f} models above the tiny merge's "
                      f"{floor.peak_anonymous / 2**20:.0f} MiB); peak RSS with file pages {run.peak_resident / 2**20:.0f} MiB",
                      flush=True)
        print()
        print(f"{'method':<16} {'mima s':>7} {'naive s':>8} {'ratio':>6} {'CPU ratio':>9} {'mima anon':>10} {'naive anon':>11} "
              f"{'mima RSS MiB':>13} {'naive RSS MiB':>14}")
        for method in METHODS:
            (mima, _), (naive, _) = rows[method, "mima"], rows[method, "naive"]
            above = [(run.peak_anonymous - floor.peak_anonymous) / model_bytes
                     for run, floor in (rows[method, "mima"], rows[method, "naive"])]
            print(f"{method:<16} {mima.seconds:7.1f} {naive.seconds:8.1f} {mima.seconds / naive.seconds:6.2f} "
                  f"{mima.cpu_seconds / naive.cpu_seconds:9.2f} "
                  f"{above[0]:8.2f} x {above[1]:9.2f} x {mima.peak_resident / 2**20:13.0f} {naive.peak_resident / 2**20:14.0f}")
        print("\n(anon: peak RssAnon above the same program's peak on a tiny merge, in multiples of one model's size;"
              "\n RSS: peak resident set with the inputs' mapped file pages, which the kernel may drop)")
    finally:
        if not args.keep and args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)


def _tiny_models(folder: Path) -> tuple[Path, list[Path], int]:
    """Two small models with ViT key names, for measuring each program's baseline RSS."""
    import torch

    from mima.core.safetensors_io import save_state_dict

    shapes = {"transformer.resblocks.0.mlp.c_fc.weight": (16, 8), "transformer.resblocks.0.mlp.c_fc.bias": (16,)}
    paths = [folder / "base.safetensors", folder / "t0.safetensors", folder / "t1.safetensors"]
    for index, path in enumerate(paths):
        save_state_dict(path, {k: torch.randn(s) + index for k, s in shapes.items()})
    return paths[0], paths[1:], 0


if __name__ == "__main__":
    main()
