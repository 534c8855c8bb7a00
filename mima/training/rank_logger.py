"""Logs written by every process, not only rank 0.

Lightning's loggers write from global rank 0 alone, which suits data parallelism, where every
process trains the same model. Under MIMA each process trains its own tasks, so rank 0's log holds
the per-step losses of rank 0's tasks only. `RankCSVLogger` is a small CSV logger of mima's own
(Lightning's guards its methods with rank-zero wrappers): each process writes its own metrics.csv
into `RunFolder.rank_logs_dir(rank)` (logs/ for rank 0, logs/rank-RRRRR/ for the others), one row
per logged step, one column per metric (in sorted order, with `step`), as Lightning's CSVLogger.
A resumed run keeps the rows of the steps before it and replaces those from its own first step on.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

from lightning.pytorch.loggers import Logger

METRICS_FILE = "metrics.csv"


class RankLogger(Logger):
    """A logger of one process writing into its own folder (no versions: one run, one folder)."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__()
        self.folder = Path(log_dir)

    @property
    def version(self) -> str:
        return ""

    @property
    def log_dir(self) -> str:
        return str(self.folder)

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass  # config.yaml holds every value


class RankCSVLogger(RankLogger):
    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir)
        self.pending: list[dict[str, object]] = []  # rows logged since the last save
        self.columns: list[str] = []
        self.started = False  # whether this attempt has written the file yet

    @property
    def name(self) -> str:
        return "csv"

    @property
    def file(self) -> Path:
        return self.folder / METRICS_FILE

    def log_metrics(self, metrics, step=None) -> None:
        self.pending.append({**{key: float(value) for key, value in metrics.items()}, "step": step})

    def save(self) -> None:
        if not self.pending:
            return
        rows, self.pending = self.pending, []
        new_columns = sorted(set(self.columns).union(*rows))
        if not self.started:  # an earlier attempt's rows up to this attempt's first step stay
            first_step = min((row["step"] for row in rows if row["step"] is not None), default=None)
            earlier = [row for row in self._read() if first_step is None or int(row.get("step") or 0) < first_step]
            new_columns = sorted(set(new_columns).union(*earlier))
            self._write_all(new_columns, earlier + rows)
            self.started = True
        elif new_columns != self.columns:  # a new metric: the header changes, so the file is rewritten
            self._write_all(new_columns, self._read() + rows)
        else:
            with self.file.open("a", newline="") as handle:
                csv.DictWriter(handle, fieldnames=self.columns).writerows(rows)
        self.columns = new_columns

    def finalize(self, status: str) -> None:
        self.save()

    def _read(self) -> list[dict[str, str]]:
        return read_metrics_csv(self.file)

    def _write_all(self, columns: list[str], rows: list[dict]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        temporary = self.file.with_name(f".{METRICS_FILE}.{os.getpid()}.tmp")
        with temporary.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(temporary, self.file)


def read_metrics_csv(file: Path) -> list[dict[str, str]]:
    """The rows of a process's metrics.csv, each without its empty cells ([] when there is none)."""
    if not file.is_file():
        return []
    with file.open(newline="") as handle:
        return [{key: value for key, value in row.items() if value not in ("", None)} for row in csv.DictReader(handle)]


class RankTensorBoardLogger(RankLogger):
    """TensorBoard event files from every process (Lightning's TensorBoardLogger asserts rank 0), into
    the same per-process folder as the CSV log; used when the `tensorboard` extra is installed:
    `tensorboard --logdir RUN/logs` shows each process's tasks."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir)
        self.writer = None

    @property
    def name(self) -> str:
        return "tensorboard"

    @property
    def experiment(self):
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(self.folder))
        return self.writer

    def log_metrics(self, metrics, step=None) -> None:
        for key, value in metrics.items():
            self.experiment.add_scalar(key, float(value), step)

    def save(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def finalize(self, status: str) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def tensorboard_available() -> bool:
    from importlib.util import find_spec

    return find_spec("tensorboard") is not None


def rank_loggers(log_dir: Path) -> list[Logger]:
    """The per-process loggers of `mima fit`: CSV always, TensorBoard when it is installed."""
    loggers: list[Logger] = [RankCSVLogger(log_dir)]
    if tensorboard_available():
        loggers.append(RankTensorBoardLogger(log_dir))
    return loggers
