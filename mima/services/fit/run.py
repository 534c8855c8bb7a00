"""`mima fit`'s run, for the command and mima.fit alike: one job per run folder (its lock), the Trainer
built (mima.services.fit.build), the run folder prepared, the Trainer fitted, a stop reported (and a
SLURM job requeued after the warning before its time limit), a divergence reported in one line (exit
status 2, mima.training.divergence), an unfinished run refused, a finished one summed up."""

from __future__ import annotations

import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mima.core.environment import global_rank, requeue_slurm_job
from mima.core.errors import MimaError, RunDiverged
from mima.core.run_folder import RunFolder
from mima.core.run_lock import RunLock
from mima.services.fit.build import FitRun, build_trainer
from mima.services.fit.config import ConfigLayers
from mima.services.fit.program import build_program, fit_settings
from mima.services.fit.settings import FitSettings
from mima.training.determinism import deterministic_refusal
from mima.training.resume import log_resume, resolve_resume
from mima.training.trainer import Launch, missing_finals, run_finished


@dataclass
class FitResult:
    run_dir: Path
    preempted_by: int | None = None  # what stopped the run early (state saved): a signal, 0 for RUN/STOP
    finished_now: bool = False  # this call trained the run to its end (not: stopped early, or found finished)


def fit_config(config: ConfigLayers | dict[str, Any], config_name: str) -> FitResult:
    """A run of `config` (mappings over an optional config file, merged as `mima fit` merges its --config
    files); `config_name` fills --out's {config}."""
    started = time.monotonic()
    return fit_run(fit_settings(build_program(config), config_name), started)


def fit_run(settings: FitSettings, started: float | None = None) -> FitResult:
    """Fit the run `settings` describe; returns its folder and whether a signal stopped it early.
    `started` (time.monotonic()): when the caller began, for the summary's duration."""
    started = time.monotonic() if started is None else started
    # One job per run folder: process 0 of the job holds the lock from before the first check to the end
    # (the job's other processes are its own); every check reads the folder under it.
    lock = RunLock(settings.run_dir, "mima fit").acquire() if global_rank() == 0 else None
    try:
        result = train(build_trainer(settings))
    finally:
        if lock is not None:
            lock.release()
    if result.finished_now and global_rank() == 0:
        print(finished_summary(RunFolder(result.run_dir), time.monotonic() - started), flush=True)
    return result


def train(run: FitRun) -> FitResult:
    trainer, module, data = run.trainer, run.model, run.datamodule
    folder = RunFolder(run.run_dir)
    resuming = run.options.ckpt_path is not None
    # Every process computes the same cut from the same files: nothing writes before training starts.
    launch = run.launch or run.prepare_launch(trainer.num_nodes * trainer.num_devices)
    run.run_start.settle(launch.identity, launch.resume_states)  # for the strategy and the checkpoints, before fit
    if resuming and launch.resume_states is None and run_finished(folder, data.task_names, module.hparams.mode):
        if global_rank() == 0:
            report_finished(run, folder)
        return FitResult(run.run_dir, None)
    if trainer.is_global_zero and global_rank() == 0:
        prepare_folder(run, folder, launch, resuming)
    try:
        trainer.fit(module, datamodule=data, ckpt_path=str(folder.checkpoints_dir) if launch.resume_states else None)
    except RuntimeError as exc:
        refusal = deterministic_refusal(exc)  # trainer.deterministic and an op without such a kernel
        if refusal is None:
            raise
        raise refusal from None
    return outcome(run, folder, launch)


def report_finished(run: FitRun, folder: RunFolder) -> None:
    """A resume of a run that has finished: nothing to do (and a leftover checkpoints/ removed)."""
    print(f"mima fit: {run.run_dir} has finished (final/ holds every task model); nothing to resume")
    if folder.checkpoints_dir.exists() and not run.options.keep_checkpoints:
        # left by a finished run whose clean-up was cut short: nothing can resume from it now
        shutil.rmtree(folder.checkpoints_dir, ignore_errors=True)
        print(f"mima fit: removed the leftover {folder.checkpoints_dir}")


def prepare_folder(run: FitRun, folder: RunFolder, launch: Launch, resuming: bool) -> None:
    """Process 0, every input checked: the run folder made ready, the resume and accepted changes said
    and recorded, the config and the data listing written."""
    # only now, with every input checked, may an earlier run that --overwrite replaces be removed
    aside = folder.prepare(resuming=resuming, overwrite=run.options.overwrite)
    if aside:
        print(f"mima fit: --overwrite: the earlier run waits in {aside} until this one has saved its first checkpoint")
    folder.stop_file.unlink(missing_ok=True)  # a stop asked of an earlier attempt is not one of this
    log_resume(launch.notes)
    if resuming:
        print(f"mima fit: resuming from {launch.resume_states.describe()}"
              if launch.resume_states else "mima fit: no checkpoint yet, starting fresh")
    if launch.config_changes is not None and launch.config_changes.harmless:
        folder.append_config_changes(launch.config_changes.record())
        print(f"mima fit: config changes that cannot change the weights, recorded in {folder.config_changes_file.name}: "
              + ", ".join(launch.config_changes.harmless))
    folder.write_config(run.settings.config_text)
    if run.data_changes:
        print(f"mima fit: --accept_data_change: {'; '.join(run.data_changes)}; the splits are cut from the new listing",
              flush=True)
    listing = run.datamodule.data_listing()
    if listing and (not resuming or run.data_changes or folder.data_listing() is None):
        folder.write_data_listing(listing)  # what the splits of this attempt are cut from


def outcome(run: FitRun, folder: RunFolder, launch: Launch) -> FitResult:
    """After trainer.fit: a divergence, a stop (said, and a SLURM job requeued), a run that ended short
    of its plan (refused), or the run finished."""
    trainer = run.trainer
    stop = getattr(trainer.strategy, "stop", None)
    if stop is not None and stop.divergence is not None:
        if not (trainer.is_global_zero and global_rank() == 0):
            # the line is process 0's (one line per job, not one per process); the others fail without it
            raise SystemExit(2)
        folder.write_divergence(stop.divergence)  # for a sweep or study called again: not fitted once more
        raise RunDiverged(f"{stop.divergence}; {last_good_checkpoint(folder, launch)}", stop.divergence)
    stopped_by = run.checkpoint.stopped_by if run.checkpoint is not None else None
    if stopped_by is not None and trainer.is_global_zero:
        cause = f"signal {stopped_by}" if stopped_by else f"{folder.stop_file}"
        # flushed: `scontrol requeue` below ends this job step, and a block-buffered log (SLURM's output
        # file) would lose what is still in the buffer
        print(f"mima fit: stopped by {cause} at process step {trainer.global_step}; state saved, resume with --ckpt_path last",
              flush=True)
        if stopped_by == signal.SIGUSR1:
            # SLURM's warning before the time limit: come back and go on. Not SIGTERM: that is scancel
            # (the user wants the job gone), a preemption (SLURM requeues by itself) or a node going down.
            requeue_slurm_job("mima fit")
    planned = run.model.plan.local_steps
    if stopped_by is None and trainer.global_step < planned:
        # nothing asked it to stop, yet this process did not take its planned steps: never report such a
        # run as done (each process checks its own steps; the final models of the others may still be
        # being written when this one ends, where no checkpoint callback waits for them)
        raise MimaError(f"{run.run_dir}: training ended at process step {trainer.global_step} of {planned} on process "
                        f"{global_rank()} without a stop request; the run is unfinished (final/ lacks "
                        f"{', '.join(missing_finals(folder, run.datamodule.task_names, run.model.hparams.mode))}): "
                        "resume it with --ckpt_path last")
    if stopped_by is None and trainer.is_global_zero and global_rank() == 0:
        folder.diverged_file.unlink(missing_ok=True)  # an earlier attempt diverged; this one finished the run
    return FitResult(run.run_dir, stopped_by, finished_now=stopped_by is None)


def finished_summary(run: RunFolder, seconds: float) -> str:
    """The last lines of a finished `mima fit`: where the run is, what it holds, each task's mean loss
    over its last phase (metrics.jsonl) and what to run next."""
    lines = [f"mima fit: finished in {format_duration(seconds)}; the run is in {run.path}"]
    names = [path.name for path in run.final_files()]
    lines.append(f"  final/: {', '.join(names)} (with pretrained.safetensors: theta_0)")
    records = run.phase_records()
    if records and isinstance(records[-1].get("loss"), dict):
        losses = records[-1]["loss"]
        lines.append(f"  mean loss over phase {records[-1]['phase']}: "
                     + ", ".join(f"{task} {loss:.4g}" for task, loss in losses.items()))
    if not run.is_joint():
        lines.append(f"  next: mima merge --method ties --models {run.path} --output MERGED.safetensors --select-on val, "
                     f"or mima evaluate {run.path} --out TABLE_DIR")
    return "\n".join(lines)


def format_duration(seconds: float) -> str:
    """`42 s`, `3 min 05 s`, `2 h 07 min`."""
    whole = int(round(seconds))
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def last_good_checkpoint(run: RunFolder, launch: Launch) -> str:
    """Where a run that diverged resumes from, said after every process has stopped and written
    what it saves: the cut `--ckpt_path last` takes (every state on disk was checked before it was
    written, mima.training.divergence)."""
    cut, _ = resolve_resume("last", run.path, launch.layout, launch.identity)
    if cut is None:
        return "no checkpoint was saved before it (nothing non-finite was written; --ckpt_path last starts afresh)"
    return f"last good checkpoint: {cut.describe()}; --ckpt_path last resumes from it"
