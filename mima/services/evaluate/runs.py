"""`mima evaluate`: the Table-1 results of finished runs, as cells that survive any stop.

What is evaluated, per run (one per N, or one per N and seed; at most one joint run beside them):
theta_0 with the frozen heads (once: the same for every run of one model), each task model on its
own task, the task vectors' pairwise cosines, and every merge in `merges`, its hyperparameters
chosen on the validation splits (the first best grid point, as mima.merging.selection) and its
test accuracy at that point.

How it survives a preemptible cluster:
  * Every result is a cell (mima.evaluation.cells) recorded the moment it is known; running the
    same command again skips the finished cells and says how many. The results files are built
    from the cells at the end, so they equal those of an uninterrupted evaluation.
  * SIGTERM or SIGUSR1 stops after the running batch; SIGUSR1 (SLURM's warning before the time
    limit) also requeues the job, as `mima fit` does.
  * `--devices N` deals the work over N processes, one device each (started here, or one per task
    under `srun`); each records its own cells, process 0 writes the results once all are done.
    Counts are integers, so the results equal one process's exactly. Each process makes its GPU
    (from its local rank, mima.evaluation.device) the current device before any CUDA call.
  * Each process has at most `--num-workers` loader workers alive, whatever the number of tasks and
    splits: one set serves every pass (mima.evaluation.loader_pool). With `--cache` on (the default on
    a GPU) the validation and test splits come from the decoded-image cache instead, in whole batches
    made on the device, several merged models per batch read (mima.evaluation.cache_use).

The parts, one job each: what is evaluated and its checks (evaluation), the processes and their
stop (team), which process evaluates which cells (dealing), one process's cells (worker), each
merge's best grid point (grid_search), the results built and written from the cells (results);
what is asked, and its checks, in options. This module composes them: `run_evaluation` is the one
entry of `mima evaluate` and mima.api.evaluate, `evaluate_runs` that of the sweep and the demo.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from mima.core.folders import no_empty_folder_left
from mima.core.run_folder import SweepFolder
from mima.core.run_lock import RunLock
from mima.core.run_outputs import refuse_output_on_runs
from mima.evaluation.accuracy import EvalSettings, EvaluationStopped, default_precision
from mima.evaluation.cache_use import CacheUse, cache_use, manifest_entry
from mima.evaluation.device import claim_device
from mima.evaluation.results import ModelResult
from mima.merging.engine import merge_device as resolve_merge_device
from mima.services.evaluate.dealing import deal, plan_units
from mima.services.evaluate.evaluation import Evaluation, data_free_per_model, describe_evaluation
from mima.services.evaluate.options import EvaluateOptions
from mima.services.evaluate.progress import ObservedCellStore, share_progress
from mima.services.evaluate.results import build_results, publish_results, selection_extra
from mima.services.evaluate.team import StopRequests, Team, finish_rank, new_session, stopped, team_for, wait_for_session
from mima.services.evaluate.worker import Worker


def run_evaluation(options: EvaluateOptions, argv: Sequence[str] | None = None) -> list[ModelResult] | None:
    """`mima evaluate` as `options` ask: this process's place among --devices processes (`argv`, the
    command line the others are started with; None: one process), then evaluate_runs into
    options.out, which is not left behind empty when the evaluation fails. Returns the results in
    process 0, None elsewhere."""
    team = team_for(options.devices, argv)
    with no_empty_folder_left(options.out):
        return evaluate_runs(list(options.runs), options.out, list(options.merges), not options.no_select,
                             options.overwrite, precision=options.precision, val_examples=options.val_examples,
                             team=team, skip_unfinished=options.skip_unfinished, num_workers=options.num_workers,
                             merge_device=options.merge_device, log_to_tracker=options.log_to_tracker,
                             cache=options.cache)


def evaluate_runs(
    run_dirs: Sequence[Path],
    out_dir: Path,
    merges: Sequence[str],
    select_on_val: bool = True,
    overwrite: bool = False,
    title: str = "mima evaluate",
    extra: dict | None = None,
    started: float | None = None,
    precision: str | None = None,
    val_examples: int | None = None,
    team: Team | None = None,
    skip_unfinished: bool = False,
    num_workers: int | None = None,
    merge_device: str | None = None,
    log_to_tracker: bool = False,
    cache: str = "auto",
) -> list[ModelResult] | None:
    """Evaluate finished runs of the same tasks and model into `out_dir` (results.json/.csv/.md,
    selection.json, plots; the cells in cells/). Returns the results in process 0, None elsewhere.

    Runs at the same N must differ only in the seed (seed_everything, and data.seed, which the
    SLURM seed sweep sets to the same value); the table then adds the mean and sample standard
    deviation over the seeds (format: mima.evaluation.results_files). `val_examples` (positive, as
    EvaluateOptions checks it): validation examples per task. `num_workers` loader workers per
    process (None: the first run's data.num_workers). `merge_device` (`--merge-device`): where the
    merges' arithmetic runs (None or "auto": each process's evaluation device). `log_to_tracker`: each
    run's rows also go to the tracker runs its fit logged to (mima.training.trackers). `cache`
    (`--cache`: auto, on or off, mima.evaluation.cache_use): whether the validation and test splits
    are read from the decoded-image cache in whole batches made on the device; every in-process
    evaluation (`mima evaluate`, the sweep and the demo) is switched here."""
    started = started or time.time()
    # before any work: not into a run it reads, but for the place each run keeps for its own results
    refuse_output_on_runs("--out", out_dir, run_dirs, kept=lambda run: [run.evaluation.path])
    team = team or Team(session=new_session())
    device = claim_device(team.local_rank)  # first: nothing below may open a CUDA context on another GPU
    merges_on = device if merge_device in (None, "auto") else resolve_merge_device(merge_device, "--merge-device")
    methods = data_free_per_model(merges)
    evaluation = describe_evaluation(run_dirs, methods, select_on_val, val_examples,
                                     precision or default_precision(device), skip_unfinished)
    workers = int(evaluation.configs[0].data.num_workers) if num_workers is None else num_workers
    # an unknown precision or a negative number of workers is one line here, before anything is written
    settings = EvalSettings(precision=evaluation.precision, num_workers=workers, pin_memory=device.type == "cuda",
                            cache=cache_use(cache, device.type))
    # one evaluation per folder at a time (process 0 holds the lock; the others are its own)
    with RunLock(out_dir, "mima evaluate") if team.rank == 0 else contextlib.nullcontext():
        results = _evaluate(evaluation, Path(out_dir), overwrite, title, extra, started, team, device, settings, merges_on)
    if results is not None and log_to_tracker:
        log_rows_to_trackers(evaluation, results, title)
    return results


def log_rows_to_trackers(evaluation: Evaluation, results: list[ModelResult], title: str) -> None:
    """Each run's own rows (its N and seed) as evaluate/<model>/<task> and evaluate/<model>/mean, to
    the tracker runs its fit recorded; a tracker that fails is one warning line."""
    from mima.training.trackers import log_to_run_trackers

    for run, config in zip(evaluation.runs, evaluation.configs):
        rows = [r for r in results if r.N == int(config.model.iterations) and r.seed == config.seed]
        metrics = {f"evaluate/{r.model}/{task}": value for r in rows for task, value in {**r.accuracy, "mean": r.mean}.items()}
        for line in log_to_run_trackers(run.path, (config.other.get("trainer") or {}).get("logger"), metrics, title):
            print(line)


def _evaluate(evaluation: Evaluation, out_dir: Path, overwrite: bool, title: str, extra: dict | None, started: float,
              team: Team, device: torch.device, settings: EvalSettings,
              merge_device: torch.device) -> list[ModelResult] | None:
    store = ObservedCellStore(out_dir, team.session, team.rank)  # each cell it records moves the progress
    if team.rank == 0:
        if store.read_manifest() is None and not overwrite:
            SweepFolder(out_dir).prepare(False)  # results of an evaluation without cells: refused as before
        store.prepare({**evaluation.manifest(), **manifest_entry(settings.cache, device.type), "session": team.session},
                      overwrite)
        team.start_children()
    else:
        wait_for_session(store, team.session)
    done = store.load()
    mine = deal(plan_units(evaluation), team.world)[team.rank]
    if team.rank == 0:
        print(f"{title}: {len(evaluation.tasks)} tasks ({', '.join(evaluation.tasks)}); merges: "
              f"{', '.join(method.name for method in evaluation.methods)}; {evaluation.precision}, {team.world} process(es)"
              + ("" if settings.cache == CacheUse.OFF else f"; decoded-image cache: {settings.cache.value}"))
        for line in store.rejected:  # left out: evaluated again, never published
            print(f"{title}: {line}")
        if done:
            print(f"{title}: {done} cells already done in {store.cells_dir}; evaluating the rest")
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True  # evaluation tolerates TF32's 10-bit mantissa matmuls
        torch.backends.cudnn.allow_tf32 = True
    progress = share_progress(evaluation, mine, store, title, team.rank)  # only process 0 shows it
    store.on_record = progress.recorded
    with StopRequests(team) as stop:
        try:
            worker = Worker(evaluation, store, stop.requested, settings, device, merge_device)
            try:
                for index, unit in enumerate(mine):
                    if stop.requested():
                        raise EvaluationStopped()
                    progress.start(index)
                    worker.run(unit)
                    progress.finish(index)
            finally:
                progress.close()
                worker.close()  # its loader workers end before this process waits for the others
            finish_rank(store, team, stop)
        except EvaluationStopped:
            stopped(store, team, stop.signal, title)
    if team.rank != 0:
        return None
    store.load()
    results, pairwise = build_results(evaluation, store)
    info = selection_extra(evaluation, extra)
    seconds = round(time.time() - started, 1)
    info["seconds_total"] = seconds
    publish_results(evaluation, results, pairwise, out_dir, info, title)
    print(f"Wrote {out_dir}/results.{{json,csv,md}}, selection.json and plots in {seconds:.0f} s.")
    return results
