"""The Table-1 style report (paper 001): absolute and relative accuracy, single-task gap, and the
mean and standard deviation over seeds.

A row is one (N, seed, model, task) accuracy of one run. `model` is "zero_shot", "fine_tuned"
(each task's own fine-tuned model on that task) or a merge name; `task` is a task name or "mean";
`seed` is the run's seed_everything. `mima evaluate` refuses two runs with the same N and seed.
    relative accuracy of a model = mean_t Acc(model, t) / Acc(theta_t, t)
    single-task gap on task t    = Acc(theta_t, t) - Acc(model, t)
both against the fine-tuned models of the same run (same N and seed).

Where several runs share an N (runs that differ only in the seed), each (N, model, task) also gets
an aggregate row: seed "mean", the seeds it covers, the mean over seeds and the sample standard
deviation (n - 1 in the denominator, as `statistics.stdev`). Relative accuracy and gap of an
aggregate row are the mean over seeds of each seed's own value; the "mean" task's aggregate is
the mean over seeds of each seed's task average (which equals the task average of the per-task
means), and its standard deviation is that of the per-seed task averages.

With one run per N the files are as they always were:
    results.json  rows {N, model, task, accuracy, mean_cos_tau}
    results.csv   N, model, task, accuracy, relative_accuracy, gap, mean_cos_tau, hparams
    results.md    the summary across N, then one table per N
With several seeds at some N:
    results.json  per-run rows {N, model, task, seed, accuracy, mean_cos_tau}, then the aggregate rows
                  {N, model, task, seed: "mean", seeds: [...], accuracy, accuracy_std, mean_cos_tau,
                  mean_cos_tau_std} (mean_cos_tau: fine_tuned rows only, as in the per-run rows)
    results.csv   the columns seed (after task) and accuracy_std (after accuracy) are added; the
                  aggregate rows have seed "mean"
    results.md    summary cells "mean ± std" where an N has several seeds; per such N the mean ± std
                  table, then one table per seed
    selection.json each entry also names its seed
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean, stdev

from mima.core.run_folder import SweepFolder
from mima.core.files import read_json, write_json_atomic, write_text_atomic

MEAN_OVER_SEEDS = "mean"  # the `seed` of an aggregate row


@dataclass
class ModelResult:
    """One model's per-task test accuracies at one N and seed (plus what was chosen for it)."""

    N: int
    model: str
    accuracy: dict[str, float]
    mean_cos_tau: float | None = None
    hparams: dict[str, object] = field(default_factory=dict)
    validation_accuracy: float | None = None
    seed: int | None = None  # the run's seed_everything

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

    def accuracy(self, task: str) -> tuple[float, float]:
        """Mean and sample standard deviation over seeds of the accuracy on `task` ("mean": the task average)."""
        return _mean_std([run.mean if task == "mean" else run.accuracy[task] for run in self.runs])

    def relative(self, task: str) -> tuple[float, float] | None:
        if any(reference is None for reference in self.fine_tuned):
            return None
        values = []
        for run, reference in zip(self.runs, self.fine_tuned):
            if task == "mean":
                values.append(relative_accuracy(run, reference))
            elif reference.accuracy[task]:
                values.append(run.accuracy[task] / reference.accuracy[task])
        return _mean_std(values) if len(values) == len(self.runs) else None

    def gap(self, task: str) -> tuple[float, float] | None:
        if any(reference is None for reference in self.fine_tuned):
            return None
        return _mean_std([
            reference.mean - run.mean if task == "mean" else reference.accuracy[task] - run.accuracy[task]
            for run, reference in zip(self.runs, self.fine_tuned)
        ])

    def mean_cos_tau(self) -> tuple[float, float] | None:
        values = [run.mean_cos_tau for run in self.runs]
        return None if self.model != "fine_tuned" or None in values else _mean_std(values)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return fmean(values), stdev(values)


def _seed_order(seed: int | None) -> tuple[int, int | str]:
    return (0, seed) if isinstance(seed, int) else (1, str(seed))  # None (not recorded) last


def seed_summaries(results: Sequence[ModelResult]) -> list[SeedSummary]:
    """The (N, model) pairs that have results for two or more seeds, in order of N, then of the models."""
    groups: dict[tuple[int, str], list[ModelResult]] = {}
    for result in results:
        groups.setdefault((result.N, result.model), []).append(result)
    reference = _fine_tuned_by_run(results)
    summaries = []
    for (n, model), group in sorted(groups.items(), key=lambda item: item[0][0]):  # stable: model order kept
        if len(group) < 2:
            continue
        runs = tuple(sorted(group, key=lambda run: _seed_order(run.seed)))
        summaries.append(SeedSummary(n, model, runs, tuple(reference.get((n, run.seed)) for run in runs)))
    return summaries


def seeds_at(results: Iterable[ModelResult], n: int) -> list:
    """The seeds of the runs at N = n, in order."""
    return sorted({r.seed for r in results if r.N == n}, key=_seed_order)


# ---------------------------------------------------------------------------- rows
def several_seeds(results: Iterable[ModelResult]) -> bool:
    """Some N has runs with different seeds: the files then name each row's seed and add aggregates."""
    seeds: dict[int, set] = {}
    for result in results:
        seeds.setdefault(result.N, set()).add(result.seed)
    return any(len(found) > 1 for found in seeds.values())


def results_rows(results: Sequence[ModelResult]) -> list[dict]:
    """The `results.json` contract: one object per (N, model, task|mean); where an N has several
    seeds, each names its seed and the aggregate rows over seeds (seed "mean") follow."""
    with_seed = several_seeds(results)
    rows = []
    for result in results:
        cos = result.mean_cos_tau if result.model == "fine_tuned" else None
        seed = {"seed": result.seed} if with_seed else {}
        for task, value in result.accuracy.items():
            rows.append({"N": result.N, "model": result.model, "task": task, **seed, "accuracy": value, "mean_cos_tau": cos})
        rows.append({"N": result.N, "model": result.model, "task": "mean", **seed, "accuracy": result.mean,
                     "mean_cos_tau": cos})
    for summary in seed_summaries(results):
        cos = summary.mean_cos_tau()
        for task in [*summary.tasks, "mean"]:
            mean, std = summary.accuracy(task)
            rows.append({
                "N": summary.N, "model": summary.model, "task": task, "seed": MEAN_OVER_SEEDS, "seeds": summary.seeds,
                "accuracy": mean, "accuracy_std": std,
                "mean_cos_tau": cos[0] if cos else None, "mean_cos_tau_std": cos[1] if cos else None,
            })
    return rows


def _fine_tuned_by_run(results: Iterable[ModelResult]) -> dict[tuple[int, int | None], ModelResult]:
    return {(r.N, r.seed): r for r in results if r.model == "fine_tuned"}


def csv_text(results: Sequence[ModelResult]) -> str:
    reference = _fine_tuned_by_run(results)
    with_seed = several_seeds(results)
    buffer = io.StringIO()
    writer = csv.writer(buffer)

    def row(n, model, task, seed, accuracy: str, std: str, *rest) -> None:
        cells = [n, model, task, seed, accuracy, std, *rest]
        writer.writerow(cells if with_seed else [n, model, task, accuracy, *rest])  # the seed columns only with seeds

    row("N", "model", "task", "seed", "accuracy", "accuracy_std", "relative_accuracy", "gap", "mean_cos_tau", "hparams")
    for result in results:
        fine_tuned = reference.get((result.N, result.seed))
        gaps = single_task_gap(result, fine_tuned) if fine_tuned else {}
        cos = "" if result.mean_cos_tau is None or result.model != "fine_tuned" else f"{result.mean_cos_tau:.4f}"
        params = json.dumps(result.hparams) if result.hparams else ""
        seed = "" if result.seed is None else result.seed
        for task, value in result.accuracy.items():
            ratio = value / fine_tuned.accuracy[task] if fine_tuned and fine_tuned.accuracy[task] else ""
            row(result.N, result.model, task, seed, f"{value:.4f}", "", _fmt(ratio), _fmt(gaps.get(task, "")), cos, params)
        rel = relative_accuracy(result, fine_tuned) if fine_tuned else ""
        gap = fine_tuned.mean - result.mean if fine_tuned else ""
        row(result.N, result.model, "mean", seed, f"{result.mean:.4f}", "", _fmt(rel), _fmt(gap), cos, params)
    for summary in seed_summaries(results):
        cos = summary.mean_cos_tau()
        for task in [*summary.tasks, "mean"]:
            mean, std = summary.accuracy(task)
            rel, gap = summary.relative(task), summary.gap(task)
            row(summary.N, summary.model, task, MEAN_OVER_SEEDS, f"{mean:.4f}", f"{std:.4f}",
                _fmt(rel[0]) if rel else "", _fmt(gap[0]) if gap else "", _fmt(cos[0]) if cos else "", "")
    return buffer.getvalue()


def _fmt(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


Table = tuple[list[str], list[list[str]]]  # header, rows of cells


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _percent(stats: tuple[float, float] | None) -> str:
    """'82.4 ± 1.3' (percent, one decimal) from a (mean, std) pair."""
    return "" if stats is None else f"{100 * stats[0]:.1f} ± {100 * stats[1]:.1f}"


def summary_table(results: Sequence[ModelResult]) -> Table:
    """Average absolute test accuracy (%) per model (rows) and N (columns), plus the mean cos(tau)
    row; a cell of an N with several seeds is the mean ± std over them."""
    n_values = sorted({r.N for r in results})
    summaries = {(s.N, s.model): s for s in seed_summaries(results)}
    by_key = {(r.N, r.model): r for r in results}  # used where an N has one seed only
    rows = []
    for model in dict.fromkeys(r.model for r in results):
        cells = [model]
        for n in n_values:
            if (n, model) in summaries:
                cells.append(_percent(summaries[(n, model)].accuracy("mean")))
            else:
                cells.append(f"{100 * by_key[(n, model)].mean:.1f}" if (n, model) in by_key else "")
        rows.append(cells)
    cos_cells = ["mean cos(tau)"]
    for n in n_values:
        if (n, "fine_tuned") in summaries:
            cos = summaries[(n, "fine_tuned")].mean_cos_tau()
            cos_cells.append(f"{cos[0]:.3f} ± {cos[1]:.3f}" if cos else "")
            continue
        result = by_key.get((n, "fine_tuned"))
        cos_cells.append(f"{result.mean_cos_tau:.3f}" if result and result.mean_cos_tau is not None else "")
    return ["model"] + [f"N={n}" for n in n_values], rows + [cos_cells]


def run_table(results: Sequence[ModelResult], n: int, seed: int | None) -> Table:
    """Table 1 of paper 001 for the run at N = n with `seed`: abs / rel accuracy, gap and per-task
    accuracy of every model."""
    fine_tuned = _fine_tuned_by_run(results).get((n, seed))
    tasks = list(results[0].accuracy) if results else []
    header = ["model", "abs. acc (%)", "rel. acc (%)", "gap (pts)"] + [f"{t} (%)" for t in tasks] + ["chosen"]
    rows = []
    for result in (r for r in results if r.N == n and r.seed == seed):
        rel = f"{100 * relative_accuracy(result, fine_tuned):.1f}" if fine_tuned else ""
        gap = f"{100 * (fine_tuned.mean - result.mean):.1f}" if fine_tuned else ""
        cells = [result.model, f"{100 * result.mean:.1f}", rel, gap] + [f"{100 * result.accuracy[t]:.1f}" for t in tasks]
        cells.append(", ".join(f"{k}={v}" for k, v in result.hparams.items() if k != "matrix_keys"))
        rows.append(cells)
    return header, rows


def seeds_table(results: Sequence[ModelResult], n: int) -> Table:
    """Table 1 at N = n as mean ± std over its seeds (every cell in %, or points for the gap)."""
    summaries = [s for s in seed_summaries(results) if s.N == n]
    tasks = summaries[0].tasks if summaries else []
    header = ["model", "abs. acc (%)", "rel. acc (%)", "gap (pts)"] + [f"{t} (%)" for t in tasks] + ["seeds"]
    rows = []
    for summary in summaries:
        cells = [summary.model, _percent(summary.accuracy("mean")), _percent(summary.relative("mean")),
                 _percent(summary.gap("mean"))]
        cells += [_percent(summary.accuracy(task)) for task in tasks]
        rows.append(cells + [", ".join(map(str, summary.seeds))])
    return header, rows


def n_table(results: Sequence[ModelResult], n: int) -> Table:
    """Table 1 of paper 001 at one N: the run's table, or the mean ± std over seeds where N has several."""
    seeds = seeds_at(results, n)
    return run_table(results, n, seeds[0]) if len(seeds) == 1 else seeds_table(results, n)


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


def describe_training(setup: Mapping) -> str:
    """One line: 'lr 1e-05, 200 linear warm-up steps, then cosine decay to zero over each task's
    whole budget S (schedule_scope: run); precision bf16-mixed; gradient clipping at norm 1.0'."""
    schedule = {"cosine": "cosine decay to zero", "constant": "a constant rate"}.get(setup["lr_schedule"], setup["lr_schedule"])
    scope = {
        "run": "over each task's whole budget S (schedule_scope: run)",
        "phase": "restarted in every phase (schedule_scope: phase)",
    }.get(setup["schedule_scope"], f"schedule_scope: {setup['schedule_scope']}")
    clip = setup.get("gradient_clip_val")
    clipping = f"gradient clipping at norm {clip}" if clip else "no gradient clipping"
    return (f"lr {setup['lr']:g}, {setup['warmup_steps']} linear warm-up steps, then {schedule} {scope}; "
            f"precision {setup['precision']}; {clipping}")


def _training_lines(training: Mapping | Sequence[Mapping] | None) -> list[str]:
    if not training:
        return []
    if isinstance(training, Mapping):
        return [f"Training: {describe_training(training)}.", ""]
    lines = ["Training differs between the runs:", ""]
    return lines + [f"- N = {setup.get('N', '?')}: {describe_training(setup)}" for setup in training] + [""]


def markdown_text(
    results: Sequence[ModelResult], title: str = "Results", training: Mapping | Sequence[Mapping] | None = None
) -> str:
    """Per-N Table-1 style tables (abs / rel / gap per task) and a summary across N, after a line on
    how the runs were trained (`training`: from `training_setup`; schedule, precision, clipping).
    An N with several seeds gets the mean ± std table over them, then one table per seed."""
    reference = _fine_tuned_by_run(results)
    lines = [f"# {title}", "", *_training_lines(training)]
    if seed_summaries(results):
        lines += ["Where an N has several runs that differ only in the seed, a cell is the mean ± the sample "
                  "standard deviation over the seeds.", ""]
    lines += ["Average absolute test accuracy (%) over the tasks:", ""]
    lines += markdown_table(*summary_table(results))
    for n in sorted({r.N for r in results}):
        seeds = seeds_at(results, n)
        if len(seeds) > 1:
            lines += ["", f"## N = {n}: mean ± std over seeds {', '.join(map(str, seeds))}", ""]
            lines += markdown_table(*seeds_table(results, n))
        for seed in seeds:
            fine_tuned = reference.get((n, seed))
            lines += ["", f"## N = {n}" if len(seeds) == 1 else f"### N = {n}, seed {seed}", ""]
            if fine_tuned and fine_tuned.mean_cos_tau is not None:
                lines += [f"Mean pairwise cosine of the final task vectors: {fine_tuned.mean_cos_tau:.3f}", ""]
            lines += markdown_table(*run_table(results, n, seed))
    return "\n".join(lines) + "\n"


def read_results(folder: Path | SweepFolder) -> list[ModelResult]:
    """The per-run ModelResults of a results folder (results.json, with the choices from
    selection.json); the aggregate rows over seeds are left out (seed_summaries recomputes them)."""
    sweep = folder if isinstance(folder, SweepFolder) else SweepFolder(folder)
    rows = read_json(sweep.results_json, expect=list)
    selection_file = sweep.selection_json
    chosen = {}
    if selection_file.is_file():
        for entry in read_json(selection_file).get("selection", []):
            chosen[(entry["N"], entry.get("seed"), entry["model"])] = entry
    results: dict[tuple[int, int | None, str], ModelResult] = {}
    for row in rows:
        seed = row.get("seed")  # absent where every N has one run (one seed)
        if seed == MEAN_OVER_SEEDS:
            continue
        key = (int(row["N"]), seed, row["model"])
        if key not in results:
            entry = chosen.get(key, {})
            results[key] = ModelResult(key[0], key[2], {}, row.get("mean_cos_tau"), entry.get("hparams") or {},
                                       entry.get("validation_accuracy"), seed=seed)
        if row["task"] != "mean":
            results[key].accuracy[row["task"]] = float(row["accuracy"])
    return list(results.values())


def write_results(
    out_dir: Path | SweepFolder, results: Sequence[ModelResult], extra: Mapping[str, object] | None = None,
    title: str = "Results",
) -> None:
    """results.json/.csv/.md and selection.json, each written atomically. results.json comes last and
    an earlier one is removed first, so that a folder holding results.json holds a complete set
    written together (`mima evaluate --resume` trusts it; a stop mid-way leaves no results.json)."""
    sweep = out_dir if isinstance(out_dir, SweepFolder) else SweepFolder(out_dir)
    sweep.result_file("results.json").unlink(missing_ok=True)
    write_text_atomic(sweep.result_file("results.csv"), csv_text(results))
    training = (extra or {}).get("training")  # training_setup's record: stated in results.md's header
    write_text_atomic(sweep.result_file("results.md"), markdown_text(results, title=title, training=training))
    with_seed = several_seeds(results)
    selection = [
        {"N": r.N, **({"seed": r.seed} if with_seed else {}), "model": r.model, "hparams": r.hparams,
         "validation_accuracy": r.validation_accuracy}
        for r in results
        if r.hparams or r.validation_accuracy is not None
    ]
    write_json_atomic(sweep.result_file("selection.json"), {"selection": selection, **(extra or {})})
    write_json_atomic(sweep.result_file("results.json"), results_rows(results))
