"""Memory and time of merging T = 8 ViT-B/32-sized image encoders: `mima merge` vs a naive merge.

Writes T + 1 random models with the real open_clip ViT-B-32 image-encoder keys and shapes (about
88M parameters, 350 MB each in float32), then runs each merge (task_arithmetic, ties, cart) in its
own process, twice: `mima merge` (streams tensor by tensor) and a naive implementation that loads
every model and merges in memory as the reference codebases do (TIES on the stacked flattened task
vectors, as the official code). Peak RSS is read per process from os.wait4; the same process's
peak on a tiny merge (the cost of importing torch and friends) is subtracted. Prints wall time and
peak RSS of both, mima / naive ratios, and mima's peak as a multiple of one model's size.

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
from pathlib import Path

METHODS = ("task_arithmetic", "ties", "cart")


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


def run_measured(command: list[str]) -> tuple[float, int]:
    """Wall seconds and peak resident set (bytes) of `command`.

    A child forked from this (large) process would start with this process's resident pages and
    Linux keeps that high-water mark across exec, so a small stdlib-only wrapper does the fork."""
    result = subprocess.run([sys.executable, __file__, "--measure", *command], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    seconds, peak = result.stdout.split()[-2:]
    return float(seconds), int(peak)


def measure(command: list[str]) -> None:
    """Run `command` from this small process; print its wall time and peak RSS (bytes)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        sys.stderr.write(process.stderr.read().decode())
        sys.exit(1)
    print(f"{elapsed} {usage.ru_maxrss * 1024}")  # ru_maxrss is in KiB on Linux


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

    folder = args.folder or Path(tempfile.mkdtemp(prefix="mima-merge-memory-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        print(f"writing {args.tasks + 1} random {args.model} image encoders to {folder} ...", flush=True)
        base, models, model_bytes = write_models(folder, args.tasks, args.model)
        tiny = folder / "tiny"
        tiny.mkdir(exist_ok=True)
        tiny_base, tiny_models, _ = _tiny_models(tiny)
        print(f"one model: {model_bytes / 2**20:.0f} MiB; T = {args.tasks}\n", flush=True)
        rows = []
        for method in METHODS:
            for name, build in (("mima", mima_command), ("naive", naive_command)):
                _, floor = run_measured(build(method, tiny_base, tiny_models, tiny / f"{name}-{method}.safetensors"))
                seconds, peak = run_measured(build(method, base, models, folder / f"{name}-{method}.safetensors"))
                rows.append((method, name, seconds, peak, floor))
                print(f"  {method:<16} {name:<6} {seconds:7.1f} s  peak RSS {peak / 2**20:8.0f} MiB "
                      f"({(peak - floor) / model_bytes:5.2f} models above the tiny-merge {floor / 2**20:.0f} MiB)", flush=True)
        print()
        print(f"{'method':<16} {'mima s':>8} {'naive s':>8} {'time ratio':>10} {'mima MiB':>9} {'naive MiB':>10} "
              f"{'mima - tiny':>12} {'naive - tiny':>13} {'RSS ratio':>10}")
        for method in METHODS:
            (_, _, ms, mp, mf), (_, _, ns, np_, nf) = [r for r in rows if r[0] == method]
            print(f"{method:<16} {ms:8.1f} {ns:8.1f} {ms / ns:10.2f} {mp / 2**20:9.0f} {np_ / 2**20:10.0f} "
                  f"{(mp - mf) / model_bytes:10.2f} x {(np_ - nf) / model_bytes:11.2f} x {(mp - mf) / (np_ - nf):10.2f}")
        print("\n(x = multiples of one model's size, after subtracting the same program's peak on a tiny merge)")
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
