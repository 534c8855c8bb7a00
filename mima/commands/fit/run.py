"""`mima fit`, run: the run folder prepared, the Trainer fitted, a stop reported (and a SLURM job
requeued after the warning before its time limit), a divergence reported in one line (exit status 2,
mima.training.divergence); the options are parsed by mima.services.fit.build."""

from __future__ import annotations

import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from mima.services.fit.build import MimaCLI, build_cli
from mima.core.environment import global_rank, requeue_slurm_job
from mima.core.errors import MimaError
from mima.core.run_folder import RunFolder
from mima.training.checkpoint_format import STATE_NAME
from mima.training.determinism import deterministic_refusal
from mima.training.resume import log_resume, resolve_resume
from mima.training.trainer import Launch, missing_finals, run_finished


@dataclass
class FitResult:
    run_dir: Path
    preempted_by: int | None = None  # what stopped the run early (state saved): a signal, 0 for RUN/STOP
    finished_now: bool = False  # this call trained the run to its end (not: stopped early, or found finished)


def run_fit(args: list[str] | dict | None = None) -> FitResult:
    """Run `mima fit`; returns the run folder and whether a signal stopped it early."""
    started = time.monotonic()
    cli = build_cli(args)
    try:
        result = _run_fit(cli)
    finally:
        cli.release_lock()
    if result.finished_now and global_rank() == 0:
        print(finished_summary(RunFolder(result.run_dir), time.monotonic() - started), flush=True)
    return result


def _run_fit(cli: MimaCLI) -> FitResult:
    trainer, module, data = cli.trainer, cli.model, cli.datamodule
    run_dir: Path = cli.run_dir
    run = RunFolder(run_dir)
    resuming = cli.config.get("ckpt_path") is not None
    # Every process computes the same cut from the same files: nothing writes before training starts.
    launch = cli.launch or cli.prepare_launch(trainer.num_nodes * trainer.num_devices)
    resume_states, notes = launch.resume_states, launch.notes
    cli.run_start.settle(launch.identity, resume_states)  # for the strategy and the checkpoints, before fit
    if resuming and resume_states is None and run_finished(run, data.task_names, module.hparams.mode):
        if global_rank() == 0:
            print(f"mima fit: {run_dir} has finished (final/ holds every task model); nothing to resume")
            if run.checkpoints_dir.exists() and not cli.config.get("keep_checkpoints"):
                # left by a finished run whose clean-up was cut short: nothing can resume from it now
                shutil.rmtree(run.checkpoints_dir, ignore_errors=True)
                print(f"mima fit: removed the leftover {run.checkpoints_dir}")
        return FitResult(run_dir, None)
    if trainer.is_global_zero and global_rank() == 0:
        # only now, with every input checked, may an earlier run that --overwrite replaces be removed
        aside = run.prepare(resuming=resuming, overwrite=bool(cli.config.get("overwrite")))
        if aside:
            print(f"mima fit: --overwrite: the earlier run waits in {aside} until this one has saved its first checkpoint")
        run.stop_file.unlink(missing_ok=True)  # a stop asked of an earlier attempt is not one of this
        log_resume(notes)
        if resuming:
            steps = sorted({int(p.name.split("step-")[1][:8]) for p in (resume_states or {}).values()})
            print(f"mima fit: resuming from process steps {', '.join(map(str, steps))} ({run.checkpoints_dir})"
                  if resume_states else "mima fit: no checkpoint yet, starting fresh")
        if launch.config_changes is not None and launch.config_changes.harmless:
            run.append_config_changes(launch.config_changes.record())
            print(f"mima fit: config changes that cannot change the weights, recorded in {run.config_changes_file.name}: "
                  + ", ".join(launch.config_changes.harmless))
        run.write_config(cli.parser.dump(cli.config, skip_none=False))
        if cli.data_changes:
            print(f"mima fit: --accept_data_change: {'; '.join(cli.data_changes)}; the splits are cut from the new listing",
                  flush=True)
        listing = data.data_listing()
        if listing and (not resuming or cli.data_changes or run.data_listing() is None):
            run.write_data_listing(listing)  # what the splits of this attempt are cut from
    try:
        trainer.fit(module, datamodule=data, ckpt_path=str(run.checkpoints_dir) if resume_states else None)
    except RuntimeError as exc:
        refusal = deterministic_refusal(exc)  # trainer.deterministic and an op without such a kernel
        if refusal is None:
            raise
        raise refusal from None
    stop = getattr(trainer.strategy, "stop", None)
    if stop is not None and stop.divergence is not None:
        if not (trainer.is_global_zero and global_rank() == 0):
            # the line is process 0's (one line per job, not one per process); the others fail without it
            raise SystemExit(2)
        raise MimaError(f"{stop.divergence}; {last_good_checkpoint(run, launch)}")
    stopped_by = cli.checkpoint.stopped_by if cli.checkpoint is not None else None
    if stopped_by is not None and trainer.is_global_zero:
        cause = f"signal {stopped_by}" if stopped_by else f"{run.stop_file}"
        # flushed: `scontrol requeue` below ends this job step, and a block-buffered log (SLURM's output
        # file) would lose what is still in the buffer
        print(f"mima fit: stopped by {cause} at process step {trainer.global_step}; state saved, resume with --ckpt_path last",
              flush=True)
        if stopped_by == signal.SIGUSR1:
            # SLURM's warning before the time limit: come back and go on. Not SIGTERM: that is scancel
            # (the user wants the job gone), a preemption (SLURM requeues by itself) or a node going down.
            requeue_slurm_job("mima fit")
    planned = module.plan.local_steps
    if stopped_by is None and trainer.global_step < planned:
        # nothing asked it to stop, yet this process did not take its planned steps: never report such a
        # run as done (each process checks its own steps; the final models of the others may still be
        # being written when this one ends, where no checkpoint callback waits for them)
        raise MimaError(f"{run_dir}: training ended at process step {trainer.global_step} of {planned} on process "
                        f"{global_rank()} without a stop request; the run is unfinished (final/ lacks "
                        f"{', '.join(missing_finals(run, data.task_names, module.hparams.mode))}): resume it with "
                        "--ckpt_path last")
    return FitResult(run_dir, stopped_by, finished_now=stopped_by is None)



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
    steps = ", ".join(map(str, sorted({int(STATE_NAME.match(path.name).group(2)) for path in cut.values()})))
    return f"last good checkpoint: process steps {steps} in {run.checkpoints_dir} (--ckpt_path last resumes from it)"
