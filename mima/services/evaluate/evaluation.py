"""What one `mima evaluate` computes, the same in every process: the runs (checked: finished, of
the same tasks, one per N and seed, at most one joint run), the merges (data-free, one model for all
tasks), whether their hyperparameters are searched on validation, and the cells' names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mima.services.evaluate.grid_search import GridPoint, grid_points
from mima.config.run_config import load_run_config
from mima.core.errors import MimaError
from mima.core.run_folder import RunFolder
from mima.evaluation.cells import point_key
from mima.merging import get_method
from mima.merging.registry import MergeMethod

NO_POINT = point_key({})  # the point of a model without hyperparameters


@dataclass
class Evaluation:
    """What one evaluation computes; the same in every process."""

    runs: list[RunFolder]
    joint: RunFolder | None
    configs: list
    tasks: list[str]
    methods: list[MergeMethod]
    select_on_val: bool
    val_examples: int | None
    precision: str

    def run_id(self, run: RunFolder) -> str:
        return str(run.path.resolve())

    def manifest(self) -> dict:
        """What the cells are results of (mima.evaluation.cells: another manifest is another evaluation)."""
        def files(run: RunFolder) -> dict:
            paths = [run.config_file, run.pretrained_file, *run.final_files()]
            return {str(path.relative_to(run.path)): [path.stat().st_size, path.stat().st_mtime_ns] for path in paths}

        return {
            "runs": {self.run_id(run): files(run) for run in [*self.runs, *([self.joint] if self.joint else [])]},
            "merges": [method.name for method in self.methods],
            "select_on": "val" if self.select_on_val else "defaults",
            "val_examples": self.val_examples,
            "precision": self.precision,
        }

    def grid(self, method: MergeMethod) -> list[GridPoint]:
        """The method's validation grid in selection order; none without the validation search."""
        return grid_points(method) if self.select_on_val else []


def describe_evaluation(run_dirs: Sequence[Path], methods: Sequence[MergeMethod], select_on_val: bool,
                        val_examples: int | None, precision: str, skip_unfinished: bool = False) -> Evaluation:
    """The runs checked (one line for each mistake), before anything is written; `methods` as
    `data_free_per_model` checked them. With `skip_unfinished`, runs that are missing or have not
    finished (a cancelled or failed job of a sweep) are left out, named in one line, and the others
    evaluated."""
    every_run, missing = [], []
    for run_dir in run_dirs:
        try:
            every_run.append(finished_run(Path(run_dir)))
        except MimaError as error:
            if not skip_unfinished:
                raise
            missing.append(str(error).split(" (")[0])
    if missing:
        print(f"mima evaluate: left out {len(missing)} run(s) that have not finished: {'; '.join(missing)}")
        if not every_run:
            raise MimaError("no run given has finished; nothing to evaluate")
    joint_runs = [run for run in every_run if run.is_joint()]
    runs = [run for run in every_run if not run.is_joint()]
    if len(joint_runs) > 1 or not runs:
        raise MimaError("mima evaluate takes MIMA runs (one per N and seed) and at most one joint run (model.mode: joint)")
    configs = [load_run_config(run) for run in runs]
    tasks = runs[0].task_order()
    for run in runs[1:] + joint_runs:
        if run.task_order() != tasks:
            raise MimaError(f"{run.path}: tasks {run.task_order()} differ from {runs[0].path}'s {tasks}")
    check_one_run_per_seed(runs, configs)
    return Evaluation(runs, joint_runs[0] if joint_runs else None, configs, tasks, list(methods), select_on_val,
                      val_examples, precision)


def check_one_run_per_seed(runs: Sequence[RunFolder], configs: Sequence) -> None:
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


def finished_run(path: Path) -> RunFolder:
    """`path` as the folder of a finished `mima fit` run, or a one-line error saying what it is instead."""
    if not path.exists():
        raise MimaError(f"{path}: no such run folder (give folders written by `mima fit --out`)")
    if not path.is_dir():
        raise MimaError(f"{path}: a file, not a run folder (give folders written by `mima fit --out`)")
    run = RunFolder(path)
    divergence = run.divergence()
    if divergence is not None and not run.is_finished():
        raise MimaError(f"{path}: diverged ({divergence}); it has no final/ task models to evaluate")
    if not run.is_finished():
        raise MimaError(f"{path}: not a finished run (no final/ task models; resume it with `mima fit ... --ckpt_path last`)")
    run.iterations()  # reads the final models' metadata: a damaged file is named before anything is written
    run.phase_records()  # the plots read metrics.jsonl at the end: a damaged line is named before the work
    return run


def data_free_per_model(merges: Sequence[str]) -> list[MergeMethod]:
    """The merges named, each data-free and one model for all tasks (the table's), or one line."""
    methods = [get_method(name) for name in merges]
    per_task = [method.name for method in methods if method.per_task]
    if per_task:
        raise MimaError(f"--merges: '{per_task[0]}' keeps one model per task; use `mima merge` for it")
    needs_data = [method.name for method in methods if method.needs_data]
    if needs_data:  # they train on each N's validation data for minutes; the table compares data-free merges
        raise MimaError(f"--merges: '{needs_data[0]}' learns from task data; the table takes data-free merges, "
                        f"use `mima merge --method {needs_data[0]}` for it")
    return methods
