"""A sweep over N: one `mima fit` per value of N from the same config, then every merge of each
run, the Table-1 style results (results.json / .csv / .md, selection.json) and the plots.

`mima demo` is this sweep on the embedded digits config; `benchmarks/offline_suite.py` runs it on
any config file (the offline suite's, or a user's custom image-folder tasks); `mima evaluate`
(mima.commands.evaluate.runs) is its second half for runs that already exist (e.g. the SLURM sweep's, one
per N and seed, which slurm/evaluate_sweep.sbatch evaluates).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from mima.config.run_config import load_run_config
from mima.core.errors import MimaError
from mima.core.plan import check_budget
from mima.core.run_folder import JOINT, SweepFolder
from mima.commands.evaluate.runs import data_free_per_model, evaluate_runs
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
) -> list[ModelResult]:
    """Fit `config` (a `mima fit` config dict) once per N in `iterations` (runs in the sweep folder's
    runs/N<n>), and with `joint` once more as the joint multi-task baseline (runs/joint: one model
    trained on all tasks for the same S steps), then `evaluate_runs`. Runs already in the folder
    are resumed (finished ones kept) unless `overwrite`, which trains them anew."""
    started = time.time()
    model = load_run_config(config).model  # checked and defaulted as `mima fit` would
    steps = model.steps  # S, or S_t per task
    budgets = steps if isinstance(steps, Mapping) else {"": steps}
    for n in iterations:
        for task, budget in budgets.items():
            check_budget(int(budget), n, names=(f"model.steps.{task}" if task else "model.steps", "iterations"))
    if joint and isinstance(steps, Mapping):
        raise MimaError("model.steps: the joint baseline trains every task for one S; per-task budgets need --no-joint")
    methods = data_free_per_model(merges)
    sweep = SweepFolder(out_dir)
    sweep.prepare(overwrite)
    _quiet_lightning()
    print(f"{title}: S={steps} steps per task, N in {list(iterations)}")
    prepare_embedded_model(model, progress)
    run_dirs = []
    settings = [({"iterations": n}, sweep.run(n), f"N={n}") for n in iterations]
    if joint:
        settings.append(({"mode": JOINT, "iterations": 1}, sweep.joint_run(), JOINT))
    for model_settings, run_folder, label in settings:
        run_started = time.time()
        run_config = copy.deepcopy(dict(config))
        run_config["model"] = {**run_config.get("model", {}), **model_settings}
        run_config["trainer"] = {**(run_config.get("trainer") or {}), "enable_progress_bar": progress, "enable_model_summary": False}
        run_config.update(out=str(run_folder.path), overwrite=overwrite)
        if not overwrite and run_folder.config_file.is_file():
            # the same command again after a stop: each run resumes where it stopped (a finished one
            # is kept as it is; a changed config is refused), and evaluation goes on from its cells
            run_config["ckpt_path"] = "last"
        result = run_fit(run_config)
        if result.preempted_by is not None:
            # a signal (or RUN/STOP) stopped this fit after saving: the sweep stops too, rather than
            # going on to the next run; the same command resumes it
            print(f"{title}: {label} stopped (state saved); run the same command to go on")
            raise SystemExit(128 + result.preempted_by if result.preempted_by else 0)
        run_dirs.append(result.run_dir)
        print(f"{label}: trained in {time.time() - run_started:.0f} s")
    return evaluate_runs(
        run_dirs, out_dir, [m.name for m in methods], select_on_val, overwrite=True, title=title,
        extra=extra, started=started,
    )


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
