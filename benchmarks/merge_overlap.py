"""Does a streamed merge overlap reading with arithmetic? Task arithmetic over T = 8 ViT-B/32-sized
image encoders against reading the same inputs and writing one model-sized output alone.

Writes T + 1 random models with the real open_clip ViT-B-32 image-encoder keys and shapes (as
benchmarks/merge_memory.py does, about 335 MiB each in float32), then times, side by side (the
variants alternate, each repeated, medians reported):

  read + write      every tensor of the T + 1 inputs read key by key in the merge's order
                    (SafetensorsReader) and one model-sized file written (SafetensorsWriter): the I/O
                    any merge of these files must do, with no arithmetic at all;
  mima              `mima merge --method task_arithmetic` through the engine (open_inputs +
                    merge_to_file): a background thread reads the next key's tensors while the current
                    key is computed, on one intra-op thread fewer than torch's;
  no read-ahead     the same merge reading its inputs directly (open_inputs(prefetch=False)), as the
                    engine did before it read ahead: reads and arithmetic one after the other, on
                    torch's intra-op threads;
  ..., N-1 threads  the same on one thread fewer, as mima computes: what reading ahead brings by itself.

Each run is a process of its own, timed from inside (torch already imported), so that every variant
starts from a fresh memory allocator: how much of the freed memory the C library hands back to the
system, and so how many page faults the next tensors cost, depends on everything the process did
before, and moved a variant's CPU time by 2x within one process. The three merges must write the same
bytes (checked). Wall and CPU time (every thread) and minor page faults are printed with the load
average: on a shared machine wall times move with the other programs. `--cold` drops the page cache
before each run (`echo 3 > /proc/sys/vm/drop_caches`, root only); by default the inputs are warm (in
the page cache). `--steady-allocator` runs every variant with glibc's malloc told to keep freed
memory (GLIBC_TUNABLES: no trimming, no mmap below 32 MiB), which removes the page faults, most of
the reading's cost and all of its variation, and leaves the arithmetic and the overlap to compare.

    python benchmarks/merge_overlap.py [--tasks 8] [--repeats 5] [--cold] [--steady-allocator] [--folder DIR] [--keep]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from merge_memory import model_folder, write_models  # the same random ViT-B/32-sized models (run from benchmarks/ or the root)

TARGET = 1.3  # the merge may take at most this many times the read + write alone
STEADY_ALLOCATOR = "glibc.malloc.trim_threshold=4294967295:glibc.malloc.mmap_threshold=33554432"
VARIANTS = ("read + write", "mima", "no read-ahead", "fewer threads")


def read_and_write(base: Path, models: list[Path], output: Path) -> None:
    """Every input tensor read, key by key across the inputs, and a model-sized file written: no arithmetic."""
    from mima.core.tensor_files import SafetensorsReader, SafetensorsWriter

    readers = [SafetensorsReader(path) for path in [base, *models]]
    try:
        specs = [(key, info.shape, info.dtype) for key, info in readers[0].infos.items()]
        with SafetensorsWriter(output, specs, overwrite=True) as writer:
            for key, _, _ in specs:
                tensors = [reader[key] for reader in readers]
                writer.write(key, tensors[0])
    finally:
        for reader in readers:
            reader.close()


def merge(base: Path, models: list[Path], output: Path, prefetch: bool, threads: int | None = None) -> None:
    """`mima merge --method task_arithmetic` as the command runs it, with or without reading ahead (and
    on `threads` intra-op threads where given)."""
    from mima.merging import get_method
    from mima.core.threads import intra_op_threads
    from mima.merging.engine import merge_to_file, open_inputs

    method = get_method("task_arithmetic")
    with open_inputs(models, base, prefetch=prefetch) as inputs, intra_op_threads(threads):
        merge_to_file(method, inputs, output, {}, {"method": method.name}, overwrite=True)


def run_variant(variant: str, folder: Path, tasks: int) -> None:
    """In a process of its own: one run of `variant`; prints {"wall": s, "cpu": s, "faults": page faults}
    on its last line."""
    import resource

    import torch

    base, models = folder / "base.safetensors", [folder / f"task{t}.safetensors" for t in range(tasks)]
    output = folder / f"{variant.replace(' ', '-').replace('+', 'and')}.safetensors"
    fewer = max(1, torch.get_num_threads() - 1)
    runs = {
        "read + write": lambda: read_and_write(base, models, output),
        "mima": lambda: merge(base, models, output, prefetch=True),
        "no read-ahead": lambda: merge(base, models, output, prefetch=False),
        "fewer threads": lambda: merge(base, models, output, prefetch=False, threads=fewer),
    }
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    wall, cpu = time.perf_counter(), time.process_time()
    runs[variant]()
    print(json.dumps({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu,
                      "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}))


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as control:
        control.write("3\n")


def timed(variant: str, folder: Path, tasks: int, cold: bool, steady: bool) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of every thread, minor page faults) of one run of `variant`, in a new process."""
    if cold:
        drop_page_cache()
    environment = {**os.environ, "GLIBC_TUNABLES": STEADY_ALLOCATOR} if steady else None
    done = subprocess.run([sys.executable, __file__, "--run", variant, "--folder", str(folder), "--tasks", str(tasks)],
                          capture_output=True, text=True, env=environment)
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{done.stderr[-2000:]}")
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    return measured["wall"], measured["cpu"], measured["faults"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--model", default="ViT-B-32", help="open_clip architecture whose image encoder shapes to use")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant (alternating)")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each run (root)")
    parser.add_argument("--steady-allocator", action="store_true", help="keep freed memory in every run (no page faults)")
    parser.add_argument("--folder", type=Path, help="where to write the models (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the model files")
    parser.add_argument("--run", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_variant(args.run, args.folder, args.tasks)
        return

    import torch

    folder = model_folder(args.folder, "mima-merge-overlap-")
    try:
        print(f"writing {args.tasks + 1} random {args.model} image encoders to {folder} ...", flush=True)
        model_bytes = write_models(folder, args.tasks, args.model)[2]
        fewer = max(1, torch.get_num_threads() - 1)
        print(f"{platform.node()}: {os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} "
              f"intra-op threads ('fewer threads': {fewer}); one model {model_bytes / 2**20:.0f} MiB, T = {args.tasks}; "
              f"{'cold' if args.cold else 'warm'} reads, {'steady' if args.steady_allocator else 'default'} allocator\n",
              flush=True)
        walls: dict[str, list[float]] = {name: [] for name in VARIANTS}
        cpus: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for repeat in range(args.repeats):
            line = []
            for name in VARIANTS:
                wall, cpu, faults = timed(name, folder, args.tasks, args.cold, args.steady_allocator)
                walls[name].append(wall)
                cpus[name].append(cpu)
                line.append(f"{name} {wall:.2f} s ({cpu:.2f} CPU, {faults / 1000:.0f}k faults)")
            print(f"  run {repeat + 1}: {'; '.join(line)}; load average {os.getloadavg()[0]:.1f}", flush=True)
        merged = [folder / f"{name.replace(' ', '-')}.safetensors" for name in VARIANTS[1:]]
        if not all(filecmp.cmp(merged[0], other, shallow=False) for other in merged[1:]):
            raise SystemExit("the three merges wrote different files")
        reference = statistics.median(walls["read + write"])
        print(f"\n{'variant':<14} {'median s':>9} {'CPU s':>7} {'/ read + write':>15}")
        for name in VARIANTS:
            median = statistics.median(walls[name])
            print(f"{name:<14} {median:9.2f} {statistics.median(cpus[name]):7.2f} {median / reference:15.2f}")
        ratio = statistics.median(walls["mima"]) / reference
        print(f"\nmima / read + write = {ratio:.2f} (target <= {TARGET}); the three merges wrote the same bytes")
    finally:
        if not args.keep and args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
