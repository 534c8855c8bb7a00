"""Experiment trackers (Weights & Biases, MLflow, any Lightning logger): one tracker run per mima run,
fed with every process's metrics.

A tracker is a Lightning logger named in `trainer.logger` (`--trainer.logger WandbLogger`,
`MLFlowLogger`, ...). Lightning's loggers write from global rank 0 only, which suits data
parallelism; under MIMA each process trains its own tasks, so rank 0 alone would see a fraction of
the task losses. Here:

  * every process keeps the rows it logs (`TrackerRelay`, one of its loggers beside the CSV and
    TensorBoard files, which stay);
  * after each sync and at the end of training (`TrackerForwarding`), one `all_gather_object` brings
    every process's kept rows to rank 0, which sends them to the trackers in step order: a task's
    metrics (train/loss/<task>, train/lr/<task>) from the process that trains it (replicas of a task
    averaged), a process's own metrics (sync/wait_s) under its rank (sync/wait_s/rank-R), the
    phase diagnostics (mima/mean_cos_tau, mima/mean_cos_delta) once. The trackers therefore lag the
    CSV files by at most one phase;
  * the tracker run's id and the last step sent of each metric are kept in the run folder
    (RunFolder.tracker_file): a resumed run continues the same tracker run (W&B: the same id with
    resume "allow"; MLflow: the same run_id) and sends no step twice (a resume repeats the steps after
    its checkpoint bit for bit, so a step already sent holds the value it would send again);
  * W&B's service keeps the rows it is sent in memory until the run finishes, so a SIGKILL of the job
    loses them: rows sent to it are also kept in an outbox in the run folder until its run has been
    finished, and a resume sends again those of a killed attempt;
  * a tracker that cannot be made (its class refuses the config's arguments: a tracking URI of an
    unknown scheme, a store path that is a file, MLflow 3's file store without its switch) refuses the
    run before training, in one line naming trainer.logger, the class and the library's message;
    mima's own default MLflow store (RUN/mlruns) is made with that switch on;
  * a tracker that fails once made (no network, a bad key, a full disk) costs one warning line and is
    dropped for the rest of the run; training, the checkpoints and the CSV logs go on untouched.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from typing_extensions import override

from mima.config.parse_errors import construction_refusal
from mima.core.bounded_json import read_text_bounded
from mima.core.run_folder import RunFolder
from mima.training.averaging import distributed_world
from mima.training.phase_view import PhaseView
from mima.training.rank_logger import METRICS_FILE, read_metrics_csv

MAX_OUTBOX_BYTES = 1 << 30  # a run's rows since its trackers last finished (tens of MB for a long run)
MLFLOW_FILE_STORE_SWITCH = "MLFLOW_ALLOW_FILE_STORE"  # MLflow 3 refuses a file store without it
PER_PROCESS_PREFIX = "sync/"  # metrics each process logs of itself: sent under the process's rank
Row = tuple[int, int, dict[str, float]]  # (step, rank, metrics)


class TrackerRelay(Logger):
    """Keeps every row this process logs (on every rank, unlike Lightning's tracker loggers), for
    `TrackerForwarding` to send on."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "mima-tracker-relay"

    @property
    def version(self) -> str:
        return ""

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if step is not None:  # Lightning adds the epoch, which is 0 throughout a mima run
            self.rows.append((int(step), {key: float(value) for key, value in metrics.items() if key != "epoch"}))

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass  # the trackers get the run's config from TrackerForwarding, once

    def put_back(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        """Rows logged before the ones kept now (an earlier attempt's, read back on resume)."""
        self.rows[:0] = rows

    def take(self) -> list[tuple[int, dict[str, float]]]:
        rows, self.rows = self.rows, []
        return rows


def tracker_key(logger: Logger) -> str:
    """The name a tracker's record goes under in tracker.json (its class: one tracker per kind)."""
    return type(logger).__name__


def resume_arguments(class_name: str, record: Mapping[str, Any]) -> dict[str, Any]:
    """The constructor arguments that make a tracker continue the run `record` names."""
    run_id = record.get("run_id")
    if not isinstance(run_id, str) or not run_id:
        return {}
    if class_name == "WandbLogger":
        return {"id": run_id, "resume": "allow"}
    if class_name == "MLFlowLogger":
        return {"run_id": run_id}
    return {}


def run_local_defaults(class_name: str, init_args: Mapping[str, Any], run_dir: Path) -> dict[str, Any]:
    """Where a tracker keeps its local files when the config leaves Lightning's default (the working
    directory): inside the run folder, so that runs do not share them."""
    if class_name == "WandbLogger" and init_args.get("save_dir") in (None, ".") and not init_args.get("dir"):
        return {"save_dir": str(run_dir)}
    if class_name == "MLFlowLogger" and init_args.get("save_dir") in (None, "./mlruns") and not init_args.get("tracking_uri"):
        return {"save_dir": str(RunFolder(run_dir).mlflow_store)}
    return {}


def build_trackers(entries: Sequence[Mapping[str, Any]], run_dir: Path, record: Mapping[str, Mapping]) -> list[Logger]:
    """The trackers `trainer.logger` names (class_path and init_args, already held to the config's
    trust boundary), built to keep their files in the run folder and to continue the runs `record`
    names."""
    trackers = []
    for entry in entries:
        module, _, name = str(entry["class_path"]).rpartition(".")
        init_args = dict(entry.get("init_args") or {})
        local = run_local_defaults(name, init_args, run_dir)
        if name == "MLFlowLogger" and "save_dir" in local:
            # mima's own default store is a file store, which MLflow 3 keeps behind a switch (its database
            # stores need the full `mlflow` package); a store the config names is left to the user's switch
            os.environ.setdefault(MLFLOW_FILE_STORE_SWITCH, "true")
        arguments = {**init_args, **local, **resume_arguments(name, record.get(name, {}))}
        try:
            trackers.append(getattr(importlib.import_module(module), name)(**arguments))
        except Exception as exc:  # the tracker's own refusal of its arguments, whatever its type
            raise construction_refusal("trainer.logger", str(entry["class_path"]), exc) from None
    return trackers


def tracker_entries(logger_setting: Any) -> list[dict[str, Any]]:
    """`trainer.logger` as written in a config (a class path, a class_path mapping, a list of them,
    or a bool) as a list of class_path mappings."""
    if logger_setting in (None, True, False):
        return []
    entries = logger_setting if isinstance(logger_setting, list) else [logger_setting]
    return [{"class_path": entry} if isinstance(entry, str) else dict(entry) for entry in entries]


def log_to_run_trackers(run_dir: Path, logger_setting: Any, metrics: Mapping[str, float], command: str) -> list[str]:
    """Send `metrics` to the tracker runs a finished run recorded (mima evaluate, mima merge); returns
    the lines to print. Logged at the step after the run's last one, so that they follow its curves."""
    record = RunFolder(run_dir).tracker_record()
    entries = [entry for entry in tracker_entries(logger_setting) if str(entry["class_path"]).rpartition(".")[2] in record]
    if not entries:
        return [f"{command}: {run_dir} logged to no experiment tracker (trainer.logger, {RunFolder(run_dir).tracker_file.name}); nothing sent"]
    lines = []
    for one in entries:
        name = str(one["class_path"]).rpartition(".")[2]
        entry = record[name]
        step = max(entry.get("logged_through", {}).values(), default=-1) + 1
        try:
            tracker, = build_trackers([one], run_dir, record)
            tracker.log_metrics(dict(metrics), step=step)
            tracker.save()
            tracker.finalize("success")
            finish = getattr(tracker.experiment, "finish", None)  # W&B: end this process's run (the next may be another's)
            if callable(finish):
                finish()
        except Exception as exc:  # the results are written already; the tracker is a copy
            reason = " ".join(str(exc).split())[:300] or type(exc).__name__
            lines.append(f"{command}: warning: the {name} tracker failed to take the results ({reason})")
            continue
        lines.append(f"{command}: logged {len(metrics)} values to {name} run {entry['run_id']} of {run_dir}")
    return lines


def append_outbox(path: Path, merged: Mapping[int, Mapping[str, float]]) -> None:
    """Add rows (one JSON line per step) to the outbox, in one write."""
    text = "".join(json.dumps({"step": step, "metrics": dict(metrics)}) + "\n" for step, metrics in merged.items())
    with path.open("a") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def read_outbox(path: Path) -> list[tuple[int, dict[str, float]]]:
    """The outbox's rows; a last line cut short by a kill mid-write is left out (its rows were not sent)."""
    if not path.is_file():
        return []
    rows = []
    for line in read_text_bounded(path, "JSON lines", limit=MAX_OUTBOX_BYTES).splitlines():
        try:
            record = json.loads(line)
            rows.append((int(record["step"]), {str(k): float(v) for k, v in dict(record["metrics"]).items()}))
        except (ValueError, KeyError, TypeError):
            continue
    return rows


def merge_rows(gathered: Sequence[Sequence[Row]]) -> dict[int, dict[str, float]]:
    """step -> metrics, from every process's rows: per-process metrics under their rank, the same
    metric of the same step from several processes (a task's replicas, the phase diagnostics)
    averaged (equal values stay exactly as they are)."""
    values: dict[int, dict[str, list[float]]] = {}
    for rows in gathered:
        for step, rank, metrics in rows:
            for key, value in metrics.items():
                name = f"{key}/rank-{rank}" if key.startswith(PER_PROCESS_PREFIX) else key
                values.setdefault(step, {}).setdefault(name, []).append(value)
    merged: dict[int, dict[str, float]] = {}
    for step in sorted(values):
        merged[step] = {key: seen[0] if all(v == seen[0] for v in seen) else sum(seen) / len(seen)
                        for key, seen in sorted(values[step].items())}
    return merged


# Trackers whose client keeps the rows in memory until the run finishes (W&B's service): what they were
# sent counts as theirs ("confirmed") only once their run has been finished. MLflow's client writes as
# it is called, so what it was sent is confirmed at once.
BUFFERED_TRACKERS = frozenset({"WandbLogger"})


class TrackerForwarding(Callback):
    """Sends every process's rows to the trackers from rank 0, after each sync and at the end.
    `phases`: the sync callback's view of the phase state (a sync has happened when its avg_phase
    moves; None: the joint baseline, no syncs). It comes after the sync callback, so that a phase's
    rows go once its sync has taken place and the run's last rows once it has logged them (checked
    in `setup`)."""

    def __init__(self, trackers: Sequence[Logger], relay: TrackerRelay, phases: PhaseView | None, run_dir: Path,
                 hyperparameters: Mapping[str, Any]) -> None:
        self.trackers = list(trackers)
        self.relay = relay
        self.phases = phases
        self.run = RunFolder(run_dir)
        self.hyperparameters = dict(hyperparameters)
        self.forwarded_phase = -1
        self.record: dict[str, dict[str, Any]] = {}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.phases is not None:
            self.phases.check_order(trainer.callbacks, self)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.forwarded_phase = self.phases.avg_phase if self.phases is not None else -1
        if trainer.global_rank != 0:
            return
        self.record = self.run.tracker_record()
        for tracker in list(self.trackers):
            self._guarded(tracker, "start its run", lambda: self._start(tracker))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A resumed process hands on the rows its earlier attempt logged before this attempt's first
        step (from its metrics.csv): those logged after that attempt's last sync never reached rank 0.
        Rank 0 leaves out the steps it has sent already."""
        if trainer.global_step > 0:
            file = self.run.rank_logs_dir(trainer.global_rank) / METRICS_FILE
            earlier = []
            for row in read_metrics_csv(file):
                step = int(float(row.pop("step", -1)))
                if 0 <= step < trainer.global_step:
                    earlier.append((step, {key: float(value) for key, value in row.items() if key != "epoch"}))
            self.relay.put_back(earlier)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        if self.phases is not None and self.phases.avg_phase > self.forwarded_phase:
            self.forwarded_phase = self.phases.avg_phase
            self._forward(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._forward(trainer)
        if trainer.global_rank != 0:
            return
        finished = not trainer.should_stop  # a stopped run's tracker run is continued by its resume
        for tracker in list(self.trackers):
            self._guarded(tracker, "finish its run", lambda: self._finish(tracker, finished))
        entries = [self.record.get(tracker_key(t), {}) for t in self.trackers]
        if all(entry.get("confirmed_through") == entry.get("logged_through") for entry in entries):
            self.run.tracker_outbox_file.unlink(missing_ok=True)  # every tracker holds every row

    def _start(self, tracker: Logger) -> None:
        entry = self.record.setdefault(tracker_key(tracker), {})
        if "run_id" not in entry:  # a new tracker run (MLflow refuses a parameter logged again with a new value)
            tracker.log_hyperparams(self.hyperparameters)
        else:  # a resume: what an earlier attempt sent but the tracker may not have kept goes again
            confirmed = entry.get("confirmed_through", {})
            for step, metrics in read_outbox(self.run.tracker_outbox_file):
                again = {key: value for key, value in metrics.items() if step > confirmed.get(key, -1)}
                if again:
                    tracker.log_metrics(again, step=step)
        entry["run_id"] = str(tracker.version)
        entry.setdefault("logged_through", {})
        entry.setdefault("confirmed_through", {})
        self.run.write_tracker_record(self.record)

    def _finish(self, tracker: Logger, finished: bool) -> None:
        if finished:
            tracker.finalize("success")
        if tracker_key(tracker) in BUFFERED_TRACKERS:
            finish = getattr(tracker.experiment, "finish", None)  # W&B: its service writes the rows it holds
            if callable(finish):
                finish()
        entry = self.record[tracker_key(tracker)]
        entry["confirmed_through"] = dict(entry["logged_through"])
        self.run.write_tracker_record(self.record)

    def _forward(self, trainer: pl.Trainer) -> None:
        """One collective on every process (the same point of each one's sequence of collectives);
        rank 0 sends what is new."""
        rows: list[Row] = [(step, trainer.global_rank, metrics) for step, metrics in self.relay.take()]
        if distributed_world() > 1:
            gathered: list[list[Row]] = [[] for _ in range(distributed_world())]
            dist.all_gather_object(gathered, rows)
        else:
            gathered = [rows]
        if trainer.global_rank != 0 or not self.trackers:
            return
        merged = merge_rows(gathered)
        if any(tracker_key(t) in BUFFERED_TRACKERS for t in self.trackers) and merged:
            append_outbox(self.run.tracker_outbox_file, merged)  # before any is sent: a kill cannot lose them
        for tracker in list(self.trackers):
            self._guarded(tracker, "take the metrics", lambda: self._send(tracker, merged))

    def _send(self, tracker: Logger, merged: Mapping[int, Mapping[str, float]]) -> None:
        entry = self.record.setdefault(tracker_key(tracker), {})
        sent = entry.setdefault("logged_through", {})
        for step, metrics in merged.items():
            new = {key: value for key, value in metrics.items() if step > sent.get(key, -1)}
            if new:
                tracker.log_metrics(new, step=step)
                sent.update(dict.fromkeys(new, step))
        tracker.save()
        if tracker_key(tracker) not in BUFFERED_TRACKERS:
            entry["confirmed_through"] = dict(sent)
        self.run.write_tracker_record(self.record)

    def _guarded(self, tracker: Logger, doing: str, action) -> None:
        try:
            action()
        except Exception as exc:  # a tracker must never stop training: said once, then left out
            self.trackers.remove(tracker)
            reason = " ".join(str(exc).split())[:300] or type(exc).__name__
            sys.stderr.write(f"mima fit: warning: the {tracker_key(tracker)} tracker failed to {doing} ({reason}); "
                             "it is left out for the rest of the run, training and the CSV logs go on\n")
            sys.stderr.flush()
