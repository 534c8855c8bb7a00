"""Where mima fit's time goes, step by step: the wall time of every optimiser step of `mima fit` (a
callback that synchronises the GPU at each step start) split into regular steps and the steps that
end a task segment (CPU copy of the task weights; at phase ends the average and the cosine Gram
matrices), next to the bare loop of trainer_overhead.py on the same config.

    python benchmarks/step_profile.py [--preset gpu|cpu] [--steps 200] [--iterations 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from trainer_overhead import PRESETS, _synchronize, benchmark_config, run_bare
from mima.commands.fit.run import run_fit


class StepClock(Callback):
    """Writes the duration of every step (from its start to the next step's start) as JSON."""

    def __init__(self, path: str) -> None:
        self.path, self.times, self.last = path, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        _synchronize()
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now

    def on_train_end(self, trainer, pl_module) -> None:
        _synchronize()
        self.times.append(time.perf_counter() - self.last)
        Path(self.path).write_text(json.dumps(self.times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=tuple(PRESETS), default="gpu")
    parser.add_argument("--steps", type=int, default=200, help="S, steps per task")
    parser.add_argument("--iterations", type=int, default=4, help="N")
    options = parser.parse_args()
    torch.set_num_threads(PRESETS[options.preset].get("threads_per_process", 2))
    with tempfile.TemporaryDirectory() as scratch:
        clock = Path(scratch) / "clock.json"
        config = benchmark_config(options.steps, options.iterations, Path(scratch) / "run", Path(scratch) / "timer.json",
                                  options.preset, checkpoint_every=0)
        config["trainer"]["callbacks"] = [{"class_path": "step_profile.StepClock", "init_args": {"path": str(clock)}}]
        run_fit(config)
        times = json.loads(clock.read_text())
        tasks = len(config["data"]["tasks"])
        k = options.steps // options.iterations
        ends = {i for i in range(len(times)) if (i + 1) % k == 0}
        regular = [t for i, t in enumerate(times) if i not in ends and i > 0]
        print(f"mima fit: {len(times)} steps ({tasks} tasks), {sum(times[1:]):.2f} s after the first step; regular steps "
              f"median {1000 * statistics.median(regular):.1f} ms; segment-end steps (ms): "
              f"{[round(1000 * times[i]) for i in sorted(ends)]}")
        seconds, steps, _ = run_bare(config)
        print(f"bare loop: {steps} steps in {seconds:.2f} s, {1000 * seconds / steps:.1f} ms per step")


if __name__ == "__main__":
    main()
