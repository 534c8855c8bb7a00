"""A sweep over N: one `mima fit` per value of N from the same config, then every merge of each
run, the Table-1 style results (results.json / .csv / .md, selection.json) and the plots.

`mima demo` is this sweep on the embedded digits config; `benchmarks/offline_suite.py` runs it on
any config file (the offline suite's, or a user's custom image-folder tasks); `mima evaluate`
is its second half for runs that already exist (e.g. the SLURM sweep's, one per N and seed, which
slurm/evaluate_sweep.sbatch evaluates with `--resume`).
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
from mima.core.files import read_json
from mima.evaluation.results import ModelResult, training_setup
from mima.evaluation.results_files import read_results, write_results
from mima.evaluation.tables import markdown_text
from mima.merging import get_method
from mima.pools import task_pool
from mima.merging.selection import merge_with_defaults, select_on_validation
from mima.core.run_folder import JOINT, RunFolder, SweepFolder
from mima.core.state_dicts import mean_off_diagonal, task_vector_cosines
from mima.core.plan import check_budget
from mima.config.run_config import load_run_config
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
    resume: bool = False,
) -> list[ModelResult]:
    """Evaluate finished runs of the same tasks and model (typically one per N, or one per N and
    seed): theta_0 with the frozen heads, each task model on its task, and every merge
    (hyperparameters chosen on the validation split); a joint multi-task run among them adds a
    `joint` row to every run; write the results table and plots to `out_dir`.

    Runs at the same N must differ only in the seed (seed_everything, and data.seed, which the
    SLURM seed sweep sets to the same value); the table then adds the mean and sample standard
    deviation over the seeds (format: mima.evaluation.results_files).

    With `resume`, each run's own results are written to RUN/evaluation/ (atomically, results.json
    last), a run whose RUN/evaluation/ already holds results of the same merges, selection and
    final models is not evaluated again, and `out_dir` is rebuilt from the per-run results (an
    earlier table there is replaced). A job stopped mid-way (preemption, time limit) and started
    again therefore redoes only the runs that were not finished."""
    started = started or time.time()
    methods = _data_free_per_model(merges)
    every_run = [finished_run(Path(run_dir)) for run_dir in run_dirs]
    joint_runs = [run for run in every_run if run.is_joint()]
    runs = [run for run in every_run if not run.is_joint()]
    if len(joint_runs) > 1 or not runs:
        raise MimaError("mima evaluate takes MIMA runs (one per N and seed) and at most one joint run (model.mode: joint)")
    configs = [load_run_config(run) for run in runs]
    tasks = runs[0].task_order()
    for run in runs[1:] + joint_runs:
        if run.task_order() != tasks:
            raise MimaError(f"{run.path}: tasks {run.task_order()} differ from {runs[0].path}'s {tasks}")
    _check_one_run_per_seed(runs, configs)
    config = configs[0]
    sweep = SweepFolder(out_dir)
    evaluator = _RunEvaluator(config, methods, select_on_val)
    if not resume:
        evaluator.load()  # a wrong data root fails here, before anything is written
        sweep.prepare(overwrite)  # only now: a mistake above leaves no empty --out behind
    print(f"{title}: {len(tasks)} tasks ({', '.join(tasks)}); merges: {', '.join(merges)}")
    joint = evaluator.test.accuracy(joint_runs[0].joint()) if joint_runs else None
    if joint is not None:
        print("joint multi-task model, test accuracy: " + ", ".join(f"{t} {100 * a:.1f}%" for t, a in joint.items()))

    several_seeds = len({(int(c.model.iterations), c.seed) for c in configs}) > len({int(c.model.iterations) for c in configs})
    results: list[ModelResult] = []
    pairwise: dict[int, list[float]] = {}
    phases: dict[int, list[dict]] = {}
    reused: list[str] = []
    for run, run_config in zip(runs, configs):
        n, seed = int(run_config.model.iterations), run_config.seed
        label = f"N={n}, seed {seed}" if several_seeds else f"N={n}"
        key = _evaluation_key(run, [m.name for m in methods], select_on_val)
        earlier = _earlier_results(run, key, seed) if resume else None
        if earlier is not None:
            own, pairs = earlier
            reused.append(str(run.path))
            print(f"{label}: results of {run.evaluation.path} reused")
        else:
            own, pairs = evaluator.evaluate(run, n, seed, label)
            if resume:
                _write_run_results(run, run_config, own, pairs, key)
        if joint is not None:  # one model for every run, like zero_shot; placed after fine_tuned
            own = own[:2] + [ModelResult(n, JOINT, joint, seed=seed)] + own[2:]
        results += own
        pairwise.setdefault(n, []).extend(pairs)
        phases.setdefault(n, run.phase_records())  # the phase plot shows the first run of each N

    if resume:
        sweep.prepare(overwrite=True)  # the table is rebuilt from the runs' own results every time
    seconds = round(time.time() - started, 1)
    info = {
        "heads": config.model.heads,
        "select_on": "val" if select_on_val else "defaults",
        "runs": [str(r.path) for r in runs],
        # the schedule (lr_schedule, schedule_scope, warm-up), precision and clipping that produced the table
        "training": training_setup((c.model, c.other.get("trainer") or {}) for c in configs),
    }
    if resume:
        info["reused"] = reused  # runs whose RUN/evaluation results were taken as they were
    info.update(steps=config.model.steps, **(extra or {}))
    info["seconds_total"] = seconds
    write_results(sweep, results, extra=info, title=title)
    plot_accuracy_vs_n(results, sweep.plot_file(SweepFolder.ACCURACY_PLOT))
    plot_cosine_vs_n(pairwise, phases, sweep.plot_file(SweepFolder.COSINE_PLOT))
    print()
    print(markdown_text(results, title=title))
    print(f"Wrote {out_dir}/results.{{json,csv,md}}, selection.json and plots in {seconds:.0f} s.")
    return results


class _RunEvaluator:
    """Merges and evaluates one run at a time. The task pool (encoder, heads, data) is loaded on
    first use, so that a resumed evaluation whose runs are all done loads nothing."""

    def __init__(self, config, methods: Sequence, select_on_val: bool) -> None:
        self.config, self.methods, self.select_on_val = config, list(methods), select_on_val
        self.pool = None
        self._zero_shot: dict[str, float] | None = None

    def load(self) -> None:
        if self.pool is not None:
            return
        self.pool = task_pool(self.config)
        if torch.cuda.is_available() and not any(method.needs_data for method in self.methods):
            self.pool.encoder.to("cuda")  # evaluation only; data-dependent merges keep the pool on the CPU
        self._test, self._val = self.pool.evaluator("test"), self.pool.evaluator("val")

    @property
    def test(self):
        self.load()
        return self._test

    def zero_shot(self, run: RunFolder) -> dict[str, float]:
        """theta_0 with the frozen heads: the same for every run of one model, so computed once."""
        if self._zero_shot is None:
            self._zero_shot = self.test.accuracy(run.pretrained())
            print(f"{self.config.model.heads} heads, test accuracy at theta_0: "
                  + ", ".join(f"{t} {100 * a:.1f}%" for t, a in self._zero_shot.items()))
        return self._zero_shot

    def evaluate(self, run: RunFolder, n: int, seed: int, label: str) -> tuple[list[ModelResult], list[float]]:
        """The run's rows (zero_shot, fine_tuned, one per merge) and its task vectors' pairwise cosines."""
        run_started = time.time()
        self.load()
        tasks = run.task_order()
        base = run.pretrained()
        models = [run.final(task) for task in tasks]
        cos = task_vector_cosines(base, models)
        pairs = [float(cos[i, j]) for i in range(len(tasks)) for j in range(i + 1, len(tasks))]
        fine_tuned = {task: self._test.accuracy(model, [task])[task] for task, model in zip(tasks, models)}
        results = [
            ModelResult(n, "zero_shot", self.zero_shot(run), seed=seed),
            ModelResult(n, "fine_tuned", fine_tuned, mean_cos_tau=mean_off_diagonal(cos), seed=seed),
        ]
        for method in self.methods:
            if self.select_on_val and method.grid:
                chosen = select_on_validation(method, models, base, self._val.mean_accuracy, pool=self.pool)
            else:
                chosen = merge_with_defaults(method, models, base, pool=self.pool)
            hparams = {k: v for k, v in chosen.hparams.items() if k != "matrix_keys"}
            results.append(ModelResult(n, method.name, self._test.accuracy(chosen.merged), hparams=hparams,
                                       validation_accuracy=chosen.score, seed=seed))
        summary = ", ".join(f"{r.model} {100 * r.mean:.1f}%" for r in results if r.model != "zero_shot")
        print(f"{label}: cos(tau) {mean_off_diagonal(cos):.3f}; {summary} ({time.time() - run_started:.0f} s)")
        return results, pairs


def _check_one_run_per_seed(runs: Sequence[RunFolder], configs: Sequence) -> None:
    """Runs at one N must have different seeds (their rows would be indistinguishable) and must not
    differ in anything else (their mean over seeds would mix two settings)."""
    seen: dict[tuple[int, int], RunFolder] = {}
    first_at_n: dict[int, tuple[RunFolder, object]] = {}
    for run, config in zip(runs, configs):
        n = int(config.model.iterations)
        if (n, config.seed) in seen:
            raise MimaError(f"{run.path} and {seen[(n, config.seed)].path}: both N={n} with seed_everything "
                            f"{config.seed}; give one run per N and seed")
        seen[(n, config.seed)] = run
        if n not in first_at_n:
            first_at_n[n] = (run, config)
            continue
        other_run, other_config = first_at_n[n]
        difference = _config_difference(other_config, config)
        if difference:
            raise MimaError(f"{run.path} and {other_run.path}: both N={n} but they differ in {difference}, not only "
                            "in the seed (a mean over seeds needs runs of one config)")


def _config_difference(first, second) -> str | None:
    """The first model or data option in which two run configs differ, data.seed aside (a seed
    sweep varies it with seed_everything), or None."""
    for section, left, right in (("model", first.model_args(), second.model_args()),
                                 ("data", first.data_args(), second.data_args())):
        for key in sorted(set(left) | set(right)):
            if (section, key) != ("data", "seed") and left.get(key) != right.get(key):
                return f"{section}.{key} ({left.get(key)!r} vs {right.get(key)!r})"
    return None


def _evaluation_key(run: RunFolder, merges: Sequence[str], select_on_val: bool) -> dict:
    """What a run's evaluation depends on: the merges, how their hyperparameters were chosen, and
    the files evaluated (name, size and modification time: a run trained again, e.g. with
    --overwrite, no longer matches)."""
    files = [run.config_file, run.pretrained_file, *run.final_files()]
    return {
        "merges": list(merges),
        "select_on": "val" if select_on_val else "defaults",
        "files": {str(path.relative_to(run.path)): [path.stat().st_size, path.stat().st_mtime_ns] for path in files},
    }


def _earlier_results(run: RunFolder, key: dict, seed: int) -> tuple[list[ModelResult], list[float]] | None:
    """The run's results from RUN/evaluation/ if they are complete and were written for `key`."""
    folder = run.evaluation
    if not (folder.has_results() and folder.selection_json.is_file()):
        return None
    try:
        info = read_json(folder.selection_json)
        if info.get("evaluated") != key:
            print(f"{folder.path}: written for other merges, selection or models; evaluating {run.path} again")
            return None
        results = read_results(folder)
    except (MimaError, KeyError, TypeError, ValueError):  # a damaged or foreign file: evaluate again
        print(f"{folder.path}: unreadable; evaluating {run.path} again")
        return None
    for result in results:  # one run: its rows name no seed; config.yaml (part of `key`) has it
        result.seed = seed
    return results, [float(value) for value in info.get("pairwise_cos_tau", [])]


def _write_run_results(run: RunFolder, config, results: list[ModelResult], pairs: list[float], key: dict) -> None:
    folder = run.evaluation
    folder.prepare(overwrite=True)
    info = {
        "heads": config.model.heads,
        "select_on": key["select_on"],
        "runs": [str(run.path)],
        "training": training_setup([(config.model, config.other.get("trainer") or {})]),
        "steps": config.model.steps,
        "evaluated": key,
        "pairwise_cos_tau": pairs,
    }
    write_results(folder, results, extra=info, title=f"mima evaluate: {run.path.name}")


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
