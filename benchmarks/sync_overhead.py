"""What one MIMA synchronisation costs, with W = 2 processes on gloo (CPU).

For the demo encoder (tiny ViT, 109K parameters) and a ViT-B/32-sized image encoder (open_clip
ViT-B-32, random weights, 88M parameters), with T = 4 tasks (two per process), it times:
  * mima's sync: `mima.training.averaging.average_phase`, the function the sync callback runs
    (all-gather in task order, exact float64 sum, tau/delta Gram matrices);
  * baseline: a plain all-reduce of each process's partial sum (what most averaging code does;
    faster, but its rounding depends on the process layout);
  * a local memcpy of the same bytes (the T task copies of the encoder);
  * K training steps of the encoder (forward, backward, AdamW) at the given batch size.
and prints the ratios. Usage:  python benchmarks/sync_overhead.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import open_clip
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mima.models.embedded import TINY_DIGITS_RECIPE
from mima.training.averaging import average_phase
from mima.core.layout import TaskLayout

WORLD, TASKS = 2, 4
MODELS = {
    # name: (open_clip config or name, training batch, K steps per phase of the paper-style run)
    "demo encoder": (TINY_DIGITS_RECIPE["model_cfg"], 64, 80),  # configs/demo.yaml: S = 320, N = 4
    "ViT-B/32 encoder": ("ViT-B-32", 8, 100),  # paper: S = 2000, N = 20; batch measured at 8 on CPU
}


def build_encoder(spec) -> torch.nn.Module:
    torch.manual_seed(0)
    model = open_clip.CLIP(**spec) if isinstance(spec, dict) else open_clip.create_model(spec)
    return model.visual


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(rank: int, init_file: str, repeats: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    layout = TaskLayout(TASKS, WORLD)
    for name, (spec, batch, k_steps) in MODELS.items():
        encoder = build_encoder(spec)
        theta_0 = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
        keys = [k for k, v in theta_0.items() if v.is_floating_point()]
        params = {n for n, _ in encoder.named_parameters()}
        local = [{k: v + 0.01 * torch.randn_like(v) for k, v in theta_0.items()} for _ in layout.local_tasks(rank)]

        def mima_sync():
            average_phase(local, keys, layout, theta_0, theta_0, params, torch.device("cpu"))

        def all_reduce_baseline():
            for key in keys:
                partial = sum(state[key] for state in local)
                dist.all_reduce(partial)

        task_bytes = TASKS * sum(theta_0[k].numel() * theta_0[k].element_size() for k in keys)
        source = torch.empty(task_bytes, dtype=torch.uint8)
        target = torch.empty_like(source)

        size = encoder.image_size if isinstance(encoder.image_size, int) else encoder.image_size[0]
        images = torch.randn(batch, 3, size, size)
        optimizer = torch.optim.AdamW(encoder.parameters(), lr=1e-5)

        def train_step():
            loss = encoder(images).float().pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        dist.barrier()
        sync = median_time(mima_sync, repeats)
        dist.barrier()
        baseline = median_time(all_reduce_baseline, repeats)
        memcpy = median_time(lambda: target.copy_(source), repeats)
        train_step()  # warm-up
        step = median_time(train_step, max(2, repeats))
        if rank == 0:
            results[name] = dict(sync=sync, baseline=baseline, memcpy=memcpy, step=step, k=k_steps, batch=batch,
                                 params=sum(p.numel() for p in encoder.parameters()), megabytes=task_bytes / 2**20)
        dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        manager = mp.Manager()
        results = manager.dict()
        mp.spawn(worker, args=(os.path.join(folder, "init"), args.repeats, results), nprocs=WORLD, join=True)
        results = dict(results)
    print(f"W = {WORLD} processes (gloo, CPU, 1 thread each), T = {TASKS} tasks; medians of {args.repeats} runs\n")
    header = f"{'model':<18} {'params':>8} {'T copies':>9} {'mima sync':>10} {'all-reduce':>11} {'memcpy':>8} {'K steps':>16} | {'sync/memcpy':>11} {'sync/all-reduce':>15} {'sync/K steps':>12}"
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        k_time = r["k"] * r["step"]
        print(
            f"{name:<18} {r['params'] / 1e6:>7.2f}M {r['megabytes']:>7.1f}MB {r['sync']:>9.3f}s {r['baseline']:>10.3f}s "
            f"{r['memcpy']:>7.4f}s {k_time:>8.2f}s (K={r['k']},b={r['batch']}) | {r['sync'] / r['memcpy']:>11.1f} "
            f"{r['sync'] / r['baseline']:>15.2f} {r['sync'] / k_time:>12.4f}"
        )


if __name__ == "__main__":
    main()
