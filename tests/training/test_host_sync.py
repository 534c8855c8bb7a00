"""The training step path reads device values on the host only at segment ends, phase ends and
logging intervals (issue 23, item 5).

Reading a device tensor on the host (`Tensor.item`, `float(tensor)`, `Tensor.tolist`, `.cpu()`)
waits for every kernel queued before it; done per step, it keeps the host from queueing step t + 1
while the device computes step t. On the CPU there is no queue, but the calls are the same ones, so
counting them during a short `mima fit` on the CPU finds every such read a GPU run would make.
"""

from __future__ import annotations

import csv
import inspect
import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from mima.core.plan import PhasePlan
from mima.core.run_folder import RunFolder
from mima.commands.fit.run import run_fit
from tests.helpers import fit_config

READS = ("item", "__float__", "tolist", "cpu")
# The optimiser reads its own step counters (`torch.optim` keeps them as CPU tensors unless the
# kernels are fused or capturable; on CUDA mima uses fused AdamW, whose counters stay on the device
# and are never read): CPU-to-CPU reads that synchronise nothing, left out of the count.
# The batch samplers' permutations (mima.data.sampler) are CPU tensors from a CPU generator on every
# machine: turning a batch of them into indices reads no device either.
NOT_HOST_DEVICE = (os.sep + os.path.join("torch", "optim") + os.sep, os.path.join("mima", "data", "sampler.py"))

# What each synchronisation point may read, and why:
#   a segment end: the pending step losses, one stacked tensor (`tolist`), and the finite checks of
#     mima.training.divergence, one read each: the task's weights and kept moments before they are
#     kept, and again before the checkpoint that segment end writes (`tolist`, at most 4);
#   a phase end: the two Gram matrices to the CPU (`cpu`), their mean cosines (`float`, 2) and
#     cosine matrices (`tolist`, 2) for metrics.jsonl: 6;
#   a logging interval: the pending step losses (1) and each metric the sync logged through
#     Lightning (mean_cos_tau, mean_cos_delta), which Lightning converts with `item` when it writes: 3.
READS_PER_SEGMENT_END = 1 + 4
READS_PER_PHASE_END = 6
READS_PER_LOGGING_INTERVAL = 3


class HostReadCounter(Callback):
    """Counts the calls of READS from the first optimiser step's start to the end of training (not
    setup or teardown), by wrapping the Tensor methods; writes {"method file:line": count} to `path`."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.counts: Counter[str] = Counter()
        self.originals: dict[str, object] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        for name in READS:
            original = getattr(torch.Tensor, name)
            self.originals[name] = original
            setattr(torch.Tensor, name, self._counting(name, original))

    def on_train_end(self, trainer, pl_module) -> None:
        for name, original in self.originals.items():
            setattr(torch.Tensor, name, original)
        Path(self.path).write_text(json.dumps(self.counts))

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.on_train_end(trainer, pl_module)

    def _counting(self, name: str, original):
        counts = self.counts

        def wrapper(tensor, *args, **kwargs):
            caller = inspect.currentframe().f_back
            if not any(part in caller.f_code.co_filename for part in NOT_HOST_DEVICE):
                counts[f"{name} {caller.f_code.co_filename}:{caller.f_lineno}"] += 1
            return original(tensor, *args, **kwargs)

        return wrapper


def allowed_reads(steps: int, iterations: int, tasks: int, log_every_n_steps: int) -> int:
    """The reads the sync points of a one-process run of `tasks` tasks may make (see above)."""
    plan = PhasePlan(tuple(f"t{i}" for i in range(tasks)), tuple(range(tasks)), steps, iterations)
    process_steps = range(plan.local_steps)
    segment_ends = sum(plan.ends_segment(step) for step in process_steps)
    phase_ends = sum(plan.ends_phase(step) for step in process_steps)
    logging_intervals = plan.local_steps // log_every_n_steps
    return (READS_PER_SEGMENT_END * segment_ends + READS_PER_PHASE_END * phase_ends
            + READS_PER_LOGGING_INTERVAL * logging_intervals)


@pytest.mark.slow  # a short `mima fit`: ~25-45 s on 2 shared cores
def test_the_step_path_reads_device_values_only_at_sync_points(tmp_path, small_clip):
    steps, iterations, tasks, every = 24, 2, ["rot90", "mirror"], 10
    counts_file = tmp_path / "reads.json"
    config = fit_config(tmp_path / "run", small_clip, tasks, steps=steps, iterations=iterations)
    # the progress bar, the loggers and checkpoints on, as in a real run (fit_config turns the first two off)
    config["trainer"].update(enable_progress_bar=True, log_every_n_steps=every,
                             callbacks=[{"class_path": "tests.training.test_host_sync.HostReadCounter",
                                         "init_args": {"path": str(counts_file)}}])
    del config["trainer"]["logger"]
    run_fit(config)
    counts = Counter(json.loads(counts_file.read_text()))
    allowance = allowed_reads(steps, iterations, len(tasks), every)
    process_steps = steps * len(tasks)
    assert allowance < process_steps, "a read per step must not fit in the allowance"
    assert sum(counts.values()) <= allowance, f"{sum(counts.values())} reads > {allowance}: {counts.most_common(5)}"
    # the losses read in batches are still one row per step, and each phase's mean loss in
    # metrics.jsonl is the mean of that phase's rows
    run = RunFolder(tmp_path / "run")
    with (run.rank_logs_dir(0) / "metrics.csv").open(newline="") as handle:
        losses = {int(row["step"]): [float(value) for key, value in row.items() if key.startswith("train/loss/") and value]
                  for row in csv.DictReader(handle) if any(key.startswith("train/loss/") and value for key, value in row.items())}
    assert sorted(losses) == list(range(process_steps)) and all(len(values) == 1 for values in losses.values())
    plan = PhasePlan(tuple(tasks), tuple(range(len(tasks))), steps, iterations)
    for record in run.phase_records():
        for slot, task in enumerate(tasks):
            phase_steps = [step for step in losses
                           if plan.position(step).phase == record["phase"] - 1 and plan.position(step).slot == slot]
            assert record["loss"][task] == pytest.approx(sum(losses[step][0] for step in phase_steps) / len(phase_steps),
                                                         rel=1e-12)
