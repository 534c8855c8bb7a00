"""A sweep over N: one `mima fit` per value of N from the same config, then every merge of each
run, the Table-1 style results (results.json / .csv / .md, selection.json) and the plots.

`mima demo` is this sweep on the embedded digits config; `benchmarks/offline_suite.py` runs it on
any config file (the offline suite's, or a user's custom image-folder tasks); `mima evaluate`
(mima.services.evaluate.runs) is its second half for runs that already exist (e.g. the SLURM sweep's, one
per N and seed, which slurm/evaluate_sweep.sbatch evaluates).

With `seeds`, the sweep fits once per (N, seed) into runs/N<n>-seed<s> (seed_everything and
data.seed both set to s), and the table adds the mean and sample standard deviation over the seeds
beside the per-seed rows (mima.evaluation.results_files). Without it, one run per N in runs/N<n> with
the config's own seeds, as always.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from mima.config.run_config import load_run_config
from mima.core.errors import MimaError, RunDiverged
from mima.core.bounded_json import read_json
from mima.core.plan import check_budget
from mima.core.names import JOINT
from mima.core.run_folder import RunFolder, SweepFolder
from mima.services.evaluate.runs import data_free_per_model, evaluate_runs
from mima.evaluation.results import ModelResult
from mima.config.model import ModelSettings
from mima.core.cache_dir import cache_dir_or_default
from mima.models.clip import EMBEDDED_PREFIX
from mima.models.embedded import ensure_embedded_model
from mima.commands.fit.run import run_fit


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
    seeds: Sequence[int] | None = None,
) -> list[ModelResult]:
    """Fit `config` (a `mima fit` config dict) once per N in `iterations` (runs in the sweep folder's
    runs/N<n>; with `seeds`, once per N and seed in runs/N<n>-seed<s>, seed by seed), and with
    `joint` once more as the joint multi-task baseline (runs/joint: one model trained on all tasks for
    the same S steps; with `seeds`, at the first seed), then `evaluate_runs`. Runs already in the
    folder are resumed (finished ones kept: each (N, seed) on its own) unless `overwrite`, which
    trains them anew. A results table already in the folder is refused without `overwrite`, except
    one that a sweep over seeds wrote, which a sweep over seeds replaces (so that more seeds can be
    added to a finished sweep)."""
    started = time.time()
    check_seeds(seeds)
    model = checked_model(config, iterations, joint)
    methods = data_free_per_model(merges)
    sweep = SweepFolder(out_dir)
    # a sweep over seeds replaces its own table when run again (e.g. with one more seed); any other
    # table in the folder is refused without `overwrite`, as always
    sweep.prepare(overwrite or (seeds is not None and is_seed_sweep(sweep)))
    _quiet_lightning()
    seeds_note = "" if seeds is None else f", seeds {list(seeds)}"
    print(f"{title}: S={model.steps} steps per task, N in {list(iterations)}{seeds_note}")
    prepare_embedded_model(model, progress)
    run_dirs, diverged = [], {}
    for model_settings, seed, run_folder, label in run_settings(sweep, iterations, seeds, joint):
        run_config = sweep_run_config(config, model_settings, seed, run_folder, overwrite, progress)
        run_dir = fit_sweep_run(run_config, label, title)
        if run_dir is None:
            diverged[str(run_folder.path.relative_to(sweep.path))] = run_folder.divergence()
        else:
            run_dirs.append(run_dir)
    if not run_dirs or all(RunFolder(run).is_joint() for run in run_dirs):
        raise MimaError(f"{title}: every MIMA run of the sweep diverged ({'; '.join(diverged.values())}); "
                        "nothing to evaluate (a lower model.lr is the usual remedy)")
    if seeds is not None:  # selection.json records them beside the caller's extra
        extra = {**(extra or {}), "seeds": list(seeds)}
    if diverged:  # selection.json and results.md name the runs left out
        extra = {**(extra or {}), "diverged": diverged}
    return evaluate_runs(
        run_dirs, out_dir, [m.name for m in methods], select_on_val, overwrite=True, title=title,
        extra=extra, started=started,
    )


def checked_model(config: Mapping, iterations: Sequence[int], joint: bool) -> ModelSettings:
    """The config's model settings, checked and defaulted as `mima fit` would, after checking that every
    N in `iterations` divides each task's budget S (or S_t) as `mima fit` requires; per-task budgets
    are refused for the joint baseline, which trains every task for one S."""
    model = load_run_config(config).model
    steps = model.steps  # S, or S_t per task
    budgets = steps if isinstance(steps, Mapping) else {"": steps}
    for n in iterations:
        for task, budget in budgets.items():
            check_budget(int(budget), n, names=(f"model.steps.{task}" if task else "model.steps", "iterations"))
    if joint and isinstance(steps, Mapping):
        raise MimaError("model.steps: the joint baseline trains every task for one S; per-task budgets need --no-joint")
    return model


def sweep_run_config(config: Mapping, model_settings: dict, seed: int | None, run_folder: RunFolder, overwrite: bool,
                     progress: bool) -> dict:
    """The `mima fit` config of one run of the sweep: `config` with the run's model settings, its seed
    (seed_everything and data.seed; None keeps the config's), its folder, and a resume of what the folder
    holds unless `overwrite`."""
    run_config = copy.deepcopy(dict(config))
    run_config["model"] = {**run_config.get("model", {}), **model_settings}
    if seed is not None:
        run_config["seed_everything"] = seed
        run_config["data"] = {**(run_config.get("data") or {}), "seed": seed}
    run_config["trainer"] = {**(run_config.get("trainer") or {}), "enable_progress_bar": progress, "enable_model_summary": False}
    run_config.update(out=str(run_folder.path), overwrite=overwrite)
    if not overwrite and run_folder.config_file.is_file():
        # the same command again after a stop: each run resumes where it stopped (a finished one
        # is kept as it is; a changed config is refused), and evaluation goes on from its cells
        run_config["ckpt_path"] = "last"
    return run_config


def fit_sweep_run(run_config: dict, label: str, title: str) -> Path | None:
    """Fit one run of the sweep and return its folder. A signal (or RUN/STOP) that stops the fit after
    saving stops the sweep too (SystemExit), rather than going on to the next run; the same command
    resumes it. A run that diverges, now or in an earlier call (its diverged.json: a resume would
    repeat it), is left out: None, and the sweep goes on with the others."""
    run_folder = RunFolder(run_config["out"])
    earlier = None if run_config.get("overwrite") else run_folder.divergence()
    if earlier is not None:
        print(f"{title}: {label} diverged in an earlier call ({earlier}); left out (remove "
              f"{run_folder.diverged_file} to fit it again)")
        return None
    run_started = time.time()
    try:
        result = run_fit(run_config)
    except RunDiverged as diverged:
        print(f"{title}: {label} diverged ({diverged.report}); left out, the sweep goes on")
        return None
    if result.preempted_by is not None:
        print(f"{title}: {label} stopped (state saved); run the same command to go on")
        raise SystemExit(128 + result.preempted_by if result.preempted_by else 0)
    print(f"{label}: trained in {time.time() - run_started:.0f} s")
    return result.run_dir


RunSetting = tuple[dict, int | None, RunFolder, str]  # model settings, seed (None: the config's), folder, label


def run_settings(sweep: SweepFolder, iterations: Sequence[int], seeds: Sequence[int] | None,
                 joint: bool) -> list[RunSetting]:
    """The sweep's fits in order: one per N (runs/N<n>), or with `seeds` one per seed and N
    (runs/N<n>-seed<s>, every N of a seed before the next seed), then the joint baseline's."""
    if seeds is None:
        settings = [({"iterations": n}, None, sweep.run(n), f"N={n}") for n in iterations]
    else:
        settings = [({"iterations": n}, seed, sweep.run(n, seed), f"N={n}, seed {seed}")
                    for seed in seeds for n in iterations]
    if joint:
        seed = None if seeds is None else seeds[0]
        settings.append(({"mode": JOINT, "iterations": 1}, seed, sweep.joint_run(), JOINT))
    return settings


def is_seed_sweep(sweep: SweepFolder) -> bool:
    """The folder's table was written by a sweep over seeds (its selection.json names the seeds)."""
    return sweep.selection_json.is_file() and "seeds" in read_json(sweep.selection_json)


def check_seeds(seeds: Sequence[int] | None) -> None:
    """`seeds` as a sweep takes them: None, or a non-empty list of distinct whole numbers."""
    if seeds is None:
        return
    if not seeds:
        raise MimaError("--seeds: give at least one seed")
    repeated = sorted({seed for seed in seeds if list(seeds).count(seed) > 1})
    if repeated:
        raise MimaError(f"--seeds: seed {repeated[0]} is given more than once (one run per N and seed)")
    negative = [seed for seed in seeds if seed < 0]
    if negative:
        raise MimaError(f"--seeds: seed {negative[0]} is negative; expected seeds of 0 or more")


def prepare_embedded_model(model: ModelSettings, progress: bool) -> None:
    """Pretrain an embedded model (or find it in the cache) once before the first fit, so that the
    per-N training times printed after each fit do not include that one-time cost."""
    if not model.clip.startswith(EMBEDDED_PREFIX):
        return
    started = time.time()
    cache = cache_dir_or_default(model.cache_dir)
    ensure_embedded_model(model.clip[len(EMBEDDED_PREFIX):], cache, progress=progress)
    print(f"{model.clip}: ready in {time.time() - started:.0f} s (pretrained once and cached; not part of the "
          "training times below)")


def _quiet_lightning() -> None:
    """A sweep runs several fits; keep Lightning's per-fit banners out of the way."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.WARNING)
