"""Evaluation results: one model's accuracies per run, compared with the run's fine-tuned models
and aggregated over seeds (the numbers of the Table-1 style report of paper 001).

A row is one (N, seed, model, task) accuracy of one run. `model` is "zero_shot", "fine_tuned"
(each task's own fine-tuned model on that task) or a merge name; `task` is a task name or "mean";
`seed` is the run's seed_everything. `mima evaluate` refuses two runs with the same N and seed.
    relative accuracy of a model = mean_t Acc(model, t) / Acc(theta_t, t)
    single-task gap on task t    = Acc(theta_t, t) - Acc(model, t)
both against the fine-tuned models of the same run (same N and seed).

Where several runs share an N (runs that differ only in the seed), each (N, model, task) also gets
an aggregate: the mean over seeds and the sample standard deviation (n - 1 in the denominator, as
`statistics.stdev`). A model measured once and repeated beside every seed's run (theta_0, evaluated
with the first run; a joint model trained at one seed: `ModelResult.measured_at`) is one measurement:
its aggregate is that value, with no standard deviation and only the seed it was measured at. Relative accuracy and gap of an aggregate are the mean over seeds of each
seed's own value; the "mean" task's aggregate is the mean over seeds of each seed's task average
(which equals the task average of the per-task means), and its standard deviation is that of the
per-seed task averages.

The tables are mima.evaluation.tables'; the files (results.json, .csv, .md, selection.json)
mima.evaluation.results_files'.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import fmean, stdev

from mima.core.names import FINE_TUNED
from mima.evaluation.statistics import ALPHA, excludes_zero

MEAN_OVER_SEEDS = "mean"  # the `seed` of an aggregate row


@dataclass
class Comparison:
    """One model against another of the same run or seed (`N`, `model`) on the same test images
    (mima.evaluation.significance chooses the pairs, mima.evaluation.statistics computes the numbers)."""

    N: int  # the other model's N (the same seed)
    model: str
    difference: float  # mean over tasks of this model's accuracy minus the other's
    interval: tuple[float, float]  # its paired bootstrap 95 % interval
    p_values: dict[str, float]  # per task, the exact McNemar p-value

    @property
    def distinguishable(self) -> bool:
        """The difference of the means is distinguishable at 95 % (its interval excludes 0)."""
        return excludes_zero(self.interval)

    def distinguishable_tasks(self) -> list[str]:
        """The tasks whose difference is distinguishable at 95 % (McNemar p < 0.05)."""
        return [task for task, p in self.p_values.items() if p < ALPHA]


@dataclass
class ModelResult:
    """One model's per-task test accuracies at one N and seed (plus what was chosen for it, and,
    where per-image records were evaluated, the counts, 95 % intervals and paired comparisons)."""

    N: int
    model: str
    accuracy: dict[str, float]
    mean_cos_tau: float | None = None
    hparams: dict[str, object] = field(default_factory=dict)
    validation_accuracy: float | None = None
    seed: int | None = None  # the run's seed_everything
    counts: dict[str, tuple[int, int]] = field(default_factory=dict)  # per task (correct, total)
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)  # per task and "mean": 95 % interval
    comparisons: list[Comparison] = field(default_factory=list)
    # set where this row repeats one model measured once, with the run of seed `measured_at` (theta_0;
    # a joint model trained at one seed), beside every seed's run: over the seeds it is one value
    measured_at: int | None = None

    @property
    def mean(self) -> float:
        return sum(self.accuracy.values()) / len(self.accuracy)


def relative_accuracy(result: ModelResult, fine_tuned: ModelResult) -> float:
    ratios = [result.accuracy[t] / fine_tuned.accuracy[t] for t in result.accuracy if fine_tuned.accuracy[t] > 0]
    return sum(ratios) / len(ratios) if ratios else float("nan")


def single_task_gap(result: ModelResult, fine_tuned: ModelResult) -> dict[str, float]:
    return {t: fine_tuned.accuracy[t] - result.accuracy[t] for t in result.accuracy}


# ------------------------------------------------------------------------------ seeds
@dataclass(frozen=True)
class SeedSummary:
    """One model at one N over two or more runs that differ only in the seed."""

    N: int
    model: str
    runs: tuple[ModelResult, ...]  # one per seed, in seed order
    fine_tuned: tuple[ModelResult | None, ...]  # the same seed's fine-tuned result (relative accuracy, gap)

    @property
    def seeds(self) -> list:
        return [run.seed for run in self.runs]

    @property
    def tasks(self) -> list[str]:
        return list(self.runs[0].accuracy)

    def accuracy(self, task: str) -> tuple[float, float | None]:
        """Mean and sample standard deviation over seeds of the accuracy on `task` ("mean": the task
        average); one measurement (a model repeated beside every seed): its value and None."""
        return _mean_std([run.mean if task == "mean" else run.accuracy[task] for run in self.runs])

    def relative(self, task: str) -> tuple[float, float | None] | None:
        if any(reference is None for reference in self.fine_tuned):
            return None
        values = []
        for run, reference in zip(self.runs, self.fine_tuned):
            if task == "mean":
                values.append(relative_accuracy(run, reference))
            elif reference.accuracy[task]:
                values.append(run.accuracy[task] / reference.accuracy[task])
        return _mean_std(values) if len(values) == len(self.runs) else None

    def gap(self, task: str) -> tuple[float, float | None] | None:
        if any(reference is None for reference in self.fine_tuned):
            return None
        return _mean_std([
            reference.mean - run.mean if task == "mean" else reference.accuracy[task] - run.accuracy[task]
            for run, reference in zip(self.runs, self.fine_tuned)
        ])

    def mean_cos_tau(self) -> tuple[float, float] | None:
        values = [run.mean_cos_tau for run in self.runs]
        return None if self.model != FINE_TUNED or None in values else _mean_std(values)


def _mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    return fmean(values), stdev(values) if len(values) > 1 else None


def _seed_order(seed: int | None) -> tuple[int, int | str]:
    return (0, seed) if isinstance(seed, int) else (1, str(seed))  # None (not recorded) last


def seed_summaries(results: Sequence[ModelResult]) -> list[SeedSummary]:
    """The (N, model) pairs that have results for two or more seeds, in order of N, then of the models
    (a model measured once and repeated beside the seeds: its one run, `ModelResult.measured_at`)."""
    groups: dict[tuple[int, str], list[ModelResult]] = {}
    for result in results:
        groups.setdefault((result.N, result.model), []).append(result)
    reference = fine_tuned_by_run(results)
    summaries = []
    for (n, model), group in sorted(groups.items(), key=lambda item: item[0][0]):  # stable: model order kept
        if len(group) < 2:
            continue
        runs = tuple(sorted(group, key=lambda run: _seed_order(run.seed)))
        measured = {run.measured_at for run in runs}
        if len(measured) == 1 and None not in measured:  # one model repeated beside every seed: one value
            runs = tuple(run for run in runs if run.seed == runs[0].measured_at) or runs[:1]
        summaries.append(SeedSummary(n, model, runs, tuple(reference.get((n, run.seed)) for run in runs)))
    return summaries


def seeds_at(results: Iterable[ModelResult], n: int) -> list:
    """The seeds of the runs at N = n, in order."""
    return sorted({r.seed for r in results if r.N == n}, key=_seed_order)


def several_seeds(results: Iterable[ModelResult]) -> bool:
    """Some N has runs with different seeds: the files then name each row's seed and add aggregates."""
    seeds: dict[int, set] = {}
    for result in results:
        seeds.setdefault(result.N, set()).add(result.seed)
    return any(len(found) > 1 for found in seeds.values())


def fine_tuned_by_run(results: Iterable[ModelResult]) -> dict[tuple[int, int | None], ModelResult]:
    """Each run's fine-tuned result, by (N, seed): the reference of relative accuracy and gap."""
    return {(r.N, r.seed): r for r in results if r.model == FINE_TUNED}



def training_setup(runs: Iterable[tuple[object, Mapping]]) -> dict | list[dict]:
    """What produced a table, from each run's model section (attributes lr, lr_schedule,
    schedule_scope, warmup_steps, iterations) and trainer options: the learning-rate schedule, the
    precision and the gradient clipping. One dict when every run agrees (a sweep from one config),
    else one per run, in order, each with its N. An unset precision is Lightning's default, 32-true."""
    runs = list(runs)
    setups = [
        {
            "lr": float(model.lr),
            "lr_schedule": model.lr_schedule,
            "schedule_scope": model.schedule_scope,
            "warmup_steps": int(model.warmup_steps),
            "precision": str(trainer.get("precision") or "32-true"),
            "gradient_clip_val": trainer.get("gradient_clip_val"),
        }
        for model, trainer in runs
    ]
    if not setups:
        return {}
    if all(setup == setups[0] for setup in setups):
        return setups[0]
    return [{"N": int(model.iterations), **setup} for (model, _), setup in zip(runs, setups)]
