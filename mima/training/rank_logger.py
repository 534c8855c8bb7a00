"""A CSV log written by every process, not only rank 0.

Lightning's loggers write from global rank 0 alone, which suits data parallelism, where every
process trains the same model. Under MIMA each process trains its own tasks, so rank 0's log holds
the per-step losses of rank 0's tasks only. `RankCSVLogger` is Lightning's CSVLogger with its
rank-0 guards taken off: each process writes its own metrics.csv into
`RunFolder.rank_logs_dir(rank)` (logs/ for rank 0, logs/rank-RRRRR/ for the others).
"""

from __future__ import annotations

from pathlib import Path

from lightning.fabric.loggers.csv_logs import CSVLogger as FabricCSVLogger
from lightning.pytorch.loggers import CSVLogger


class RankCSVLogger(CSVLogger):
    def __init__(self, log_dir: Path) -> None:
        super().__init__(save_dir=str(log_dir.parent), name=log_dir.name, version="")

    # Lightning's own bodies, without the rank_zero_only / rank_zero_experiment wrappers.
    @property
    def experiment(self):
        return CSVLogger.experiment.fget.__wrapped__(self)

    def log_metrics(self, metrics, step=None) -> None:
        FabricCSVLogger.log_metrics.__wrapped__(self, metrics, step)

    def save(self) -> None:
        FabricCSVLogger.save.__wrapped__(self)

    def finalize(self, status: str) -> None:
        FabricCSVLogger.finalize.__wrapped__(self, status)
