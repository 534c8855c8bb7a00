"""A sweep over N: one `mima fit` per value of N from the same config, then every merge of each
run, the Table-1 style results (results.json / .csv / .md, selection.json) and the plots.

`mima demo` is this sweep on the embedded digits config; `benchmarks/offline_suite.py` runs it on
any config file (the offline suite's, or a user's custom image-folder tasks); `mima evaluate`
is its second half for runs that already exist (e.g. the SLURM array's, one per N).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from mima.core.errors import MimaError
from mima.evaluation.plots import plot_accuracy_vs_n, plot_cosine_vs_n
from mima.evaluation.report import ModelResult, markdown_text, training_setup, write_results
from mima.merging import get_method
from mima.pools import task_pool
from mima.merging.selection import merge_with_defaults, select_on_validation
from mima.core.run_folder import JOINT, RunFolder, SweepFolder
from mima.core.state_dicts import mean_off_diagonal, task_vector_cosines
from mima.core.plan import check_budget
from mima.training.run_config import load_run_config
from mima.training.trainer import run_fit


def run_sweep(
    config: Mapping,
    out_dir: Path,
    iterations: Sequence[int],
    merges: Sequence[str],
    select_on_val: bool = True,
    overwrite: bool = False,
    progress: bool = True,
    title: str = "mima sweep",
    extra: dict | None = None,
    joint: bool = False,
) -> list[ModelResult]:
    """Fit `config` (a `mima fit` config dict) once per N in `iterations` (runs in the sweep folder's
    runs/N<n>), and with `joint` once more as the joint multi-task baseline (runs/joint: one model
    trained on all tasks for the same S steps), then `evaluate_runs`."""
    started = time.time()
    steps = int(load_run_config(config).model.steps)  # checked and defaulted as `mima fit` would
    for n in iterations:
        check_budget(steps, n, names=("model.steps", "iterations"))
    methods = _data_free_per_model(merges)
    sweep = SweepFolder(out_dir)
    sweep.prepare(overwrite)
    _quiet_lightning()
    print(f"{title}: S={steps} steps per task, N in {list(iterations)}")
    run_dirs = []
    settings = [({"iterations": n}, sweep.run(n), f"N={n}") for n in iterations]
    if joint:
        settings.append(({"mode": JOINT, "iterations": 1}, sweep.joint_run(), "joint"))
    for model_settings, run_folder, label in settings:
        run_started = time.time()
        run_config = copy.deepcopy(dict(config))
        run_config["model"] = {**run_config.get("model", {}), **model_settings}
        run_config["trainer"] = {**(run_config.get("trainer") or {}), "enable_progress_bar": progress, "enable_model_summary": False}
        run_config.update(out=str(run_folder.path), overwrite=True)
        run_dirs.append(run_fit(run_config).run_dir)
        print(f"{label}: trained in {time.time() - run_started:.0f} s")
    return evaluate_runs(
        run_dirs, out_dir, [m.name for m in methods], select_on_val, overwrite=True, title=title,
        extra=extra, started=started,
    )


def evaluate_runs(
    run_dirs: Sequence[Path],
    out_dir: Path,
    merges: Sequence[str],
    select_on_val: bool = True,
    overwrite: bool = False,
    title: str = "mima evaluate",
    extra: dict | None = None,
    started: float | None = None,
) -> list[ModelResult]:
    """Evaluate finished runs of the same tasks and model (typically one per N): theta_0 with the
    frozen heads, each task model on its task, and every merge (hyperparameters chosen on the
    validation split); a joint multi-task run among them adds a `joint` row to every N; write the
    results table and plots to `out_dir`."""
    started = started or time.time()
    methods = _data_free_per_model(merges)
    every_run = [finished_run(Path(run_dir)) for run_dir in run_dirs]
    joint_runs = [run for run in every_run if run.is_joint()]
    runs = [run for run in every_run if not run.is_joint()]
    if len(joint_runs) > 1 or not runs:
        raise MimaError("mima evaluate takes MIMA runs (one per N) and at most one joint run (model.mode: joint)")
    config = load_run_config(runs[0])
    pool = task_pool(config)
    sweep = SweepFolder(out_dir)
    sweep.prepare(overwrite)  # only now: a mistake above leaves no empty --out behind
    if torch.cuda.is_available() and not any(method.needs_data for method in methods):
        pool.encoder.to("cuda")  # evaluation only; data-dependent merges keep the pool on the CPU
    for run in runs[1:] + joint_runs:
        if run.task_order() != pool.tasks:
            raise MimaError(f"{run.path}: tasks {run.task_order()} differ from {runs[0].path}'s {pool.tasks}")
    head_kind = config.model.heads
    print(f"{title}: {len(pool.tasks)} tasks ({', '.join(pool.tasks)}); merges: {', '.join(merges)}")
    test, val = pool.evaluator("test"), pool.evaluator("val")
    zero_shot = test.accuracy(runs[0].pretrained())
    print(f"{head_kind} heads, test accuracy at theta_0: " + ", ".join(f"{t} {100 * a:.1f}%" for t, a in zero_shot.items()))
    joint = test.accuracy(joint_runs[0].joint()) if joint_runs else None
    if joint is not None:
        print("joint multi-task model, test accuracy: " + ", ".join(f"{t} {100 * a:.1f}%" for t, a in joint.items()))

    results: list[ModelResult] = []
    pairwise: dict[int, list[float]] = {}
    phases: dict[int, list[dict]] = {}
    for run in runs:
        run_started = time.time()
        tasks = run.task_order()
        base = run.pretrained()
        models = [run.final(task) for task in tasks]
        n = int(load_run_config(run).model.iterations)
        cos = task_vector_cosines(base, models)
        pairwise[n] = [float(cos[i, j]) for i in range(len(tasks)) for j in range(i + 1, len(tasks))]
        phases[n] = run.phase_records()
        fine_tuned = {task: test.accuracy(model, [task])[task] for task, model in zip(tasks, models)}
        results.append(ModelResult(n, "zero_shot", zero_shot))
        results.append(ModelResult(n, "fine_tuned", fine_tuned, mean_cos_tau=mean_off_diagonal(cos)))
        if joint is not None:
            results.append(ModelResult(n, JOINT, joint))  # one model for every N, like zero_shot
        for method in methods:
            if select_on_val and method.grid:
                chosen = select_on_validation(method, models, base, val.mean_accuracy, pool=pool)
            else:
                chosen = merge_with_defaults(method, models, base, pool=pool)
            hparams = {k: v for k, v in chosen.hparams.items() if k != "matrix_keys"}
            results.append(
                ModelResult(n, method.name, test.accuracy(chosen.merged), hparams=hparams, validation_accuracy=chosen.score)
            )
        summary = ", ".join(f"{r.model} {100 * r.mean:.1f}%" for r in results if r.N == n and r.model != "zero_shot")
        print(f"N={n}: cos(tau) {mean_off_diagonal(cos):.3f}; {summary} ({time.time() - run_started:.0f} s)")

    seconds = round(time.time() - started, 1)
    info = {
        "heads": head_kind,
        "select_on": "val" if select_on_val else "defaults",
        "runs": [str(r.path) for r in runs],
        # the schedule (lr_schedule, schedule_scope, warm-up), precision and clipping that produced the table
        "training": training_setup((c.model, c.other.get("trainer") or {}) for c in map(load_run_config, runs)),
    }
    info.update(steps=config.model.steps, **(extra or {}))
    info["seconds_total"] = seconds
    write_results(sweep, results, extra=info, title=title)
    plot_accuracy_vs_n(results, sweep.plot_file(SweepFolder.ACCURACY_PLOT))
    plot_cosine_vs_n(pairwise, phases, sweep.plot_file(SweepFolder.COSINE_PLOT))
    print()
    print(markdown_text(results, title=title))
    print(f"Wrote {out_dir}/results.{{json,csv,md}}, selection.json and plots in {seconds:.0f} s.")
    return results


def finished_run(path: Path) -> RunFolder:
    """`path` as the folder of a finished `mima fit` run, or a one-line error saying what it is instead."""
    if not path.exists():
        raise MimaError(f"{path}: no such run folder (give folders written by `mima fit --out`)")
    if not path.is_dir():
        raise MimaError(f"{path}: a file, not a run folder (give folders written by `mima fit --out`)")
    run = RunFolder(path)
    if not run.is_finished():
        raise MimaError(f"{path}: not a finished run (no final/ task models; resume it with `mima fit ... --ckpt_path last`)")
    run.iterations()  # reads the final models' metadata: a damaged file is named before anything is written
    return run


def _data_free_per_model(merges: Sequence[str]) -> list:
    methods = [get_method(name) for name in merges]
    per_task = [method.name for method in methods if method.per_task]
    if per_task:
        raise MimaError(f"--merges: '{per_task[0]}' keeps one model per task; use `mima merge` for it")
    needs_data = [method.name for method in methods if method.needs_data]
    if needs_data:  # they train on each N's validation data for minutes; the table compares data-free merges
        raise MimaError(f"--merges: '{needs_data[0]}' learns from task data; the table takes data-free merges, "
                        f"use `mima merge --method {needs_data[0]}` for it")
    return methods


def _quiet_lightning() -> None:
    """A sweep runs several fits; keep Lightning's per-fit banners out of the way."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
