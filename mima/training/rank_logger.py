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
from lightning.pytorch.loggers import CSVLogger, Logger


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


class RankTensorBoardLogger(Logger):
    """TensorBoard event files from every process (Lightning's TensorBoardLogger asserts rank 0), into
    the same per-process folder as the CSV log; used when the `tensorboard` extra is installed:
    `tensorboard --logdir RUN/logs` shows each process's tasks."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__()
        self._log_dir = Path(log_dir)
        self._writer = None

    @property
    def name(self) -> str:
        return "tensorboard"

    @property
    def version(self) -> str:
        return ""

    @property
    def log_dir(self) -> str:
        return str(self._log_dir)

    @property
    def experiment(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self._log_dir))
        return self._writer

    def log_metrics(self, metrics, step=None) -> None:
        for key, value in metrics.items():
            self.experiment.add_scalar(key, float(value), step)

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass  # config.yaml holds every value

    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def tensorboard_available() -> bool:
    from importlib.util import find_spec

    return find_spec("tensorboard") is not None


def rank_loggers(log_dir: Path) -> list[Logger]:
    """The per-process loggers of `mima fit`: CSV always, TensorBoard when it is installed."""
    loggers: list[Logger] = [RankCSVLogger(log_dir)]
    if tensorboard_available():
        loggers.append(RankTensorBoardLogger(log_dir))
    return loggers
