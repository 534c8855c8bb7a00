"""The run-folder contract: the one module that knows the file names a run or a sweep consists of.

A run folder, written by `mima fit` (and read by merge, evaluate, analyze, report):

    config.yaml                 the full config of the run (every value, defaults included); it reproduces
                                the weights: a resume that would change a value that shapes them is refused
    config_changes.jsonl        one JSON object per resume that changed keys which cannot change the weights
                                (progress bar, workers, ...): {"time", "changes": {key: [old, new]}}
    LOCK                        held by the one job working on the folder (mima.core.run_lock)
    data_listing.json           tasks read from folders: each split folder's listing fingerprint when the run
                                started ({task: {split: {files, sha256}}}, mima.data.listing)
    pretrained.safetensors      theta_0, the image encoder before fine-tuning
    final/<task>.safetensors    each task's image encoder after the last phase (+ <task>.json metadata);
                                a joint multi-task run (model.mode: joint) has final/joint.safetensors
    metrics.jsonl               one JSON object per phase: phase, step, mean_cos_tau, cos_tau, loss, ...
    checkpoints/                per-process resumable checkpoints while the run is under way (layout:
                                mima.training.checkpoint_callback); removed when it finishes (--keep_checkpoints)
    STOP                        `touch RUN/STOP` asks a running job to save its state and stop
    diverged.json               written when the fit stopped because it diverged ({"report": "task T diverged:
                                loss nan at process step 1621"}); removed when a later attempt finishes the run.
                                A sweep or study leaves such a run out instead of fitting it again
    logs/                       Lightning's CSV logger
    analysis/<name>/            outputs of `mima analyze <name>`
    evaluation/                 this run's own results files, written by `mima evaluate --resume`
                                (slurm/evaluate_sweep.sbatch) and reused while the run is unchanged
    report.md, report.html      `mima report`

A sweep folder, written by `mima demo`, `mima evaluate --out` and benchmarks/offline_suite.py:

    runs/N<n>/                  one run folder per N (the demo and offline sweeps)
    runs/N<n>-seed<s>/          one per (N, seed) in a sweep over seeds (benchmarks/offline_suite.py --seeds)
    runs/joint/                 the joint multi-task baseline's run (model.mode: joint)
    results.json .csv .md       the Table-1 rows; selection.json: the chosen merge hyperparameters
    merged_accuracy_vs_N.png, cosine_vs_N.png
    analysis/<name>/, report.md, report.html

Every other module reads and writes these files through RunFolder and SweepFolder.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from mima.core.bounded_yaml import read_bounded_yaml
from mima.core.errors import MimaError
from mima.core.bounded_json import read_json, read_json_lines, short_json
from mima.core.files import refuse_overwrite, write_json_atomic, write_text_atomic
from mima.core.names import JOINT  # the joint baseline's one final model: final/joint.safetensors
from mima.core.run_lock import LOCK_NAME
from mima.core.safetensors_io import load_state_dict, save_state_dict

StateDict = dict[str, torch.Tensor]

REPORT_FILES = ("report.md", "report.html")
REPLACED_PREFIX = ".replaced-"  # an earlier run moved aside by `mima fit --overwrite`
# Names a task may not take (in any case): final/joint.* is the joint baseline's; "mean" is the task
# average's column in the results tables (mima.evaluation.results).
RESERVED_TASK_NAMES = (JOINT, "mean")


@dataclass(frozen=True)
class RunFolder:
    """A `mima fit` run folder."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    # ---------------------------------------------------------------------------- names
    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    @property
    def config_changes_file(self) -> Path:
        return self.path / "config_changes.jsonl"

    @property
    def data_listing_file(self) -> Path:
        return self.path / "data_listing.json"

    @property
    def tracker_file(self) -> Path:
        """The experiment-tracker runs this mima run logs to (mima.training.trackers), so that a resume
        continues them."""
        return self.path / "tracker.json"

    @property
    def tracker_outbox_file(self) -> Path:
        """The rows sent to trackers that keep them in memory until their run finishes (W&B), kept
        until it has: a killed attempt's rows are sent again by its resume (mima.training.trackers)."""
        return self.path / "tracker_outbox.jsonl"

    @property
    def lock_file(self) -> Path:
        """The one-job-per-folder lock (mima.core.run_lock.RunLock(run.path, command) takes it)."""
        return self.path / LOCK_NAME

    @property
    def pretrained_file(self) -> Path:
        return self.path / "pretrained.safetensors"

    @property
    def final_dir(self) -> Path:
        return self.path / "final"

    def final_file(self, task: str) -> Path:
        return self.final_dir / f"{task}.safetensors"

    def final_metadata_file(self, task: str) -> Path:
        return self.final_dir / f"{task}.json"

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def stop_file(self) -> Path:
        return self.path / "STOP"

    @property
    def diverged_file(self) -> Path:
        return self.path / "diverged.json"

    @property
    def logs_dir(self) -> Path:
        return self.path / "logs"

    def rank_logs_dir(self, rank: int) -> Path:
        """Where process `rank` writes its CSV log: logs/ for rank 0, logs/rank-RRRRR/ for the others
        (each process trains its own tasks, so each logs their losses)."""
        return self.logs_dir if rank == 0 else self.logs_dir / f"rank-{rank:05d}"

    @property
    def analysis_root(self) -> Path:
        return self.path / "analysis"

    def analysis_dir(self, name: str) -> Path:
        return self.analysis_root / name

    def analysis_dirs(self) -> list[Path]:
        return sorted(p for p in self.analysis_root.glob("*") if p.is_dir())

    @property
    def evaluation(self) -> SweepFolder:
        return SweepFolder(self.path / "evaluation")

    def report_files(self) -> list[Path]:
        return [self.path / name for name in REPORT_FILES]

    def training_outputs(self) -> list[Path]:
        """What `mima fit` writes (and `--overwrite` removes)."""
        return [self.config_file, self.config_changes_file, self.data_listing_file, self.pretrained_file,
                self.metrics_file, self.final_dir, self.logs_dir, self.checkpoints_dir, self.diverged_file]

    @property
    def mlflow_store(self) -> Path:
        """The MLflow store a run's tracker logs to unless its config names one (mima.training.trackers)."""
        return self.path / "mlruns"

    def own_paths(self) -> list[Path]:
        """What the run itself consists of, which its fit alone writes and every other command reads:
        no command's output goes there (mima.core.run_outputs). The places a run keeps for what is made
        from it (analysis/, evaluation/, the report pages) are not among them."""
        return [*self.training_outputs(), self.lock_file, self.stop_file, self.tracker_file, self.tracker_outbox_file,
                self.mlflow_store, *self.replaced_runs()]

    def is_run(self) -> bool:
        """Whether the folder holds a run: its config.yaml beside what a fit writes from its start
        (its lock, theta_0, checkpoints/, final/ or metrics.jsonl)."""
        markers = (self.lock_file, self.pretrained_file, self.checkpoints_dir, self.final_dir, self.metrics_file)
        return self.config_file.is_file() and any(marker.exists() for marker in markers)

    # ---------------------------------------------------------------------------- state
    def has_metrics(self) -> bool:
        return self.metrics_file.is_file()

    def is_finished(self) -> bool:
        return any(self.final_dir.glob("*.json"))

    def divergence(self) -> str | None:
        """What made the fit stop as diverged (diverged.json's report), or None: it did not, or a later
        attempt finished it."""
        if not self.diverged_file.is_file():
            return None
        record = read_json(self.diverged_file)
        report = record.get("report") if isinstance(record, dict) else None
        if not isinstance(report, str):
            raise MimaError(f"{self.diverged_file}: expected {{\"report\": \"...\"}} as `mima fit` writes it")
        return report

    def write_divergence(self, report: str) -> None:
        write_json_atomic(self.diverged_file, {"report": report})

    def is_joint(self) -> bool:
        """A joint multi-task run: one final model for all tasks (final/joint.safetensors)."""
        return self.final_metadata_file(JOINT).is_file()

    def joint(self) -> StateDict:
        return load_state_dict(self.final_file(JOINT))

    # ----------------------------------------------------------------------------- read
    def config_dict(self) -> dict:
        """config.yaml as plain YAML (typed loading: mima.config.run_config.load_run_config)."""
        if not self.config_file.is_file():
            raise MimaError(f"{self.path}: no config.yaml (is this a `mima fit` run folder?)")
        return read_config_mapping(self.config_file, str(self.config_file))

    def task_order(self) -> list[str]:
        """Tasks in run order (as the metadata of the final checkpoints lists them)."""
        metadata_files = sorted(self.final_dir.glob("*.json"))
        if not metadata_files:
            raise MimaError(f"{self.path}: no final/<task>.json files (is this a finished `mima fit` run folder?)")
        tasks = read_json(metadata_files[0]).get("tasks")
        if not isinstance(tasks, list) or not all(isinstance(task, str) for task in tasks):
            raise MimaError(f"{metadata_files[0]}: no list of task names under 'tasks'")
        return tasks

    def final_metadata(self, task: str) -> dict:
        return read_json(self.final_metadata_file(task))

    def iterations(self) -> int | None:
        """N of the run, from its final checkpoints' metadata (None for a joint run: no phases)."""
        if self.is_joint():
            return None
        return int(self.final_metadata(self.task_order()[0])["N"])

    def pretrained(self) -> StateDict:
        return load_state_dict(self.pretrained_file)

    def final(self, task: str) -> StateDict:
        return load_state_dict(self.final_file(task))

    def final_files(self) -> list[Path]:
        if self.is_joint():
            return [self.final_file(JOINT)]
        return [self.final_file(task) for task in self.task_order()]

    def phase_records(self) -> list[dict]:
        """metrics.jsonl's records, each checked (`phase_record_problem`): a damaged line is one
        line naming the file and the line."""
        if not self.metrics_file.is_file():
            return []
        return read_json_lines(self.metrics_file, check=phase_record_problem)

    # ---------------------------------------------------------------------------- write
    def check_target(self, resuming: bool, overwrite: bool) -> list[Path]:
        """Refuse to clobber an earlier run unless resuming it or asked to overwrite it; return what
        `prepare` would remove. Changes nothing, so it can run before every other check. A run
        is never started over another run folder's own files (its final/, its checkpoints/, ...)."""
        from mima.core.run_outputs import refuse_output_on_runs  # it reads run folders through this module

        refuse_output_on_runs("--out", self.path)
        earlier = [path for path in self.training_outputs() if path.exists() or path.is_symlink()]
        if earlier and not resuming and not overwrite:
            raise MimaError(
                f"--out {self.path}: already holds a run ({', '.join(p.name for p in earlier)}); "
                "resume it with --ckpt_path last, pick another --out, or pass --overwrite"
            )
        return [] if resuming else earlier

    def prepare(self, resuming: bool, overwrite: bool) -> Path | None:
        """`check_target`, then move an overwritten run's outputs aside (into `.replaced-<time>/`) and
        create the folder; returns where they went. They are removed (`remove_replaced`) only once the
        new run has saved its first checkpoint, so a new run that fails early costs nothing."""
        earlier = self.check_target(resuming, overwrite)
        self.path.mkdir(parents=True, exist_ok=True)
        if not earlier:
            return None
        # mkdtemp: unique even for two overwrites within one second by one process (the test suite does that)
        aside = Path(tempfile.mkdtemp(prefix=f"{REPLACED_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-", dir=self.path))
        for path in earlier:
            os.rename(path, aside / path.name)
        return aside

    def replaced_runs(self) -> list[Path]:
        """Earlier runs moved aside by `--overwrite`, waiting for the new run's first checkpoint."""
        return sorted(self.path.glob(f"{REPLACED_PREFIX}*"))

    def write_config(self, text: str) -> None:
        write_text_atomic(self.config_file, text)

    def write_data_listing(self, listing: Mapping[str, Mapping]) -> None:
        write_json_atomic(self.data_listing_file, dict(listing))

    def data_listing(self) -> dict | None:
        """The recorded listing fingerprints (None: the run reads no folders, or predates the record)."""
        return read_json(self.data_listing_file) if self.data_listing_file.is_file() else None

    def write_tracker_record(self, record: Mapping[str, Mapping]) -> None:
        write_json_atomic(self.tracker_file, dict(record))

    def tracker_record(self) -> dict:
        """tracker name -> {"run_id": ..., "logged_through": {metric: last step sent}} ({}: none yet)."""
        return read_json(self.tracker_file) if self.tracker_file.is_file() else {}

    def append_config_changes(self, changes: dict) -> None:
        """Record a resume's accepted config changes (key -> [old, new]) before config.yaml takes them."""
        records = read_json_lines(self.config_changes_file) if self.config_changes_file.is_file() else []
        records.append({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "changes": changes})
        write_text_atomic(self.config_changes_file, "".join(json.dumps(r) + "\n" for r in records))

    def config_changes(self) -> list[dict]:
        return read_json_lines(self.config_changes_file) if self.config_changes_file.is_file() else []

    def write_pretrained(self, state: Mapping[str, torch.Tensor]) -> None:
        """theta_0, once: a resumed run keeps the file the run started with."""
        if not self.pretrained_file.exists():
            save_state_dict(self.pretrained_file, state, metadata={"role": "theta_0"})

    def write_final(self, task: str, weights: Mapping[str, torch.Tensor], metadata: dict) -> None:
        save_state_dict(self.final_file(task), weights, metadata={"mima": metadata})
        write_json_atomic(self.final_metadata_file(task), metadata)

    def append_phase_record(self, record: dict) -> None:
        lines = [json.dumps(r) for r in self.phase_records()] + [json.dumps(record)]
        write_text_atomic(self.metrics_file, "".join(line + "\n" for line in lines))

    def trim_phase_records(self, completed_phases: int) -> None:
        """Keep only the phases that the state being (re)started from has already completed."""
        if not self.metrics_file.exists():
            return
        kept = [json.dumps(r) for r in self.phase_records() if r["phase"] <= completed_phases]
        write_text_atomic(self.metrics_file, "".join(line + "\n" for line in kept))


def enclosing_run(path: Path) -> RunFolder | None:
    """The run folder `path` is or lies in (the nearest, of the path as given: resolve it first to
    see through symlinks and `..`); None when it lies in none."""
    for folder in (path, *path.parents):
        if RunFolder(folder).is_run():
            return RunFolder(folder)
    return None


def phase_record_problem(record: Mapping) -> str | None:
    """Why a metrics.jsonl record is not one phase's (None: it is): what its readers (the plots, the
    report, `mima analyze cosine`, a resume's trim) take from it. Losses and cosines may be NaN or
    infinite (a diverged phase); other keys are free."""
    for key in ("phase", "step"):
        if not _is_whole(record.get(key)) or record[key] < 0:
            return f"has no whole-number {key!r} (found {short_json(record.get(key))})"
    tasks = record.get("tasks")
    if not isinstance(tasks, list) or not all(isinstance(task, str) for task in tasks):
        return f"has no list of task names 'tasks' (found {short_json(tasks)})"
    for key in ("mean_cos_tau", "mean_cos_delta"):
        if not _is_number(record.get(key)):
            return f"has no number {key!r} (found {short_json(record.get(key))})"
    for key in ("cos_tau", "cos_delta"):  # optional: `mima analyze cosine` says when they are missing
        matrix = record.get(key, [[0.0] * len(tasks)] * len(tasks))
        if not (isinstance(matrix, list) and len(matrix) == len(tasks) and all(
                isinstance(row, list) and len(row) == len(tasks) and all(map(_is_number, row)) for row in matrix)):
            return f"has no {len(tasks)} x {len(tasks)} matrix of numbers {key!r}"
    loss = record.get("loss")
    if not isinstance(loss, dict) or not all(_is_number(value) for value in loss.values()):
        return f"has no numbers per task in 'loss' (found {short_json(loss)})"
    return None


def _is_whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SweepFolder:
    """A folder of runs over N with their results table (`mima demo`, `mima evaluate --out`)."""

    path: Path

    RESULT_FILES = ("results.json", "results.csv", "results.md", "selection.json")
    ACCURACY_PLOT = "merged_accuracy_vs_N.png"
    COSINE_PLOT = "cosine_vs_N.png"

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def runs_dir(self) -> Path:
        return self.path / "runs"

    def run(self, iterations: int, seed: int | None = None) -> RunFolder:
        """The run of N = `iterations` (of `seed`, in a sweep over seeds: runs/N<n>-seed<s>)."""
        return RunFolder(self.runs_dir / (f"N{iterations}" if seed is None else f"N{iterations}-seed{seed}"))

    def joint_run(self) -> RunFolder:
        """The joint multi-task baseline trained beside the N runs."""
        return RunFolder(self.runs_dir / JOINT)

    def runs(self, include_joint: bool = False) -> list[RunFolder]:
        """The MIMA run folders under runs/ (those with phase records), in order of N; with
        `include_joint`, also the joint baseline's (after them)."""
        if not self.runs_dir.is_dir():
            return []
        found = [RunFolder(p) for p in self.runs_dir.iterdir()
                 if p.is_dir() and (RunFolder(p).has_metrics() or include_joint and RunFolder(p).is_joint())]
        return sorted(found, key=lambda run: (len(run.path.name), run.path.name))

    def result_file(self, name: str) -> Path:
        if name not in self.RESULT_FILES:
            raise ValueError(f"{name} is not a result file of a sweep")
        return self.path / name

    @property
    def results_json(self) -> Path:
        return self.path / "results.json"

    @property
    def selection_json(self) -> Path:
        return self.path / "selection.json"

    def plot_file(self, name: str) -> Path:
        return self.path / name

    def analysis_dir(self, name: str) -> Path:
        return self.path / "analysis" / name

    def analysis_dirs(self) -> list[Path]:
        return sorted(p for p in (self.path / "analysis").glob("*") if p.is_dir())

    def report_files(self) -> list[Path]:
        return [self.path / name for name in REPORT_FILES]

    def has_results(self) -> bool:
        return self.results_json.is_file()

    def listed_runs(self, include_joint: bool = False) -> list[RunFolder]:
        """The run folders a results table names (selection.json's "runs", as `mima evaluate --out`
        writes it): those that still exist with their phase records (with `include_joint`, also a
        joint baseline's). A relative path is taken from the working directory, else from the sweep
        folder's parent."""
        if not self.selection_json.is_file():
            return []
        listed = read_json(self.selection_json).get("runs") or []
        found = []
        for name in listed if isinstance(listed, list) else []:
            for candidate in (Path(str(name)), self.path.parent / str(name)):
                if RunFolder(candidate).has_metrics() or include_joint and RunFolder(candidate).is_joint():
                    found.append(RunFolder(candidate))
                    break
        return found

    def is_sweep(self) -> bool:
        return self.has_results() and self.runs_dir.is_dir()

    def prepare(self, overwrite: bool) -> None:
        """Refuse a folder on a run folder's own files, and to replace an earlier results table unless
        asked; create the folder."""
        from mima.core.run_outputs import refuse_output_on_runs  # it reads run folders through this module

        refuse_output_on_runs("--out", self.path)
        if not overwrite:
            refuse_overwrite([self.path / name for name in self.RESULT_FILES], what=f"--out {self.path}")
        self.path.mkdir(parents=True, exist_ok=True)


def read_config_mapping(path: Path, name: str) -> dict:
    """A YAML run config as a plain mapping (read with bounds: mima.core.bounded_yaml); every way it
    can be unreadable is one line naming `name`."""
    loaded = read_bounded_yaml(path, name) or {}
    if not isinstance(loaded, dict):
        raise MimaError(f"{name}: expected a mapping with model:, data:, trainer: sections")
    return loaded
