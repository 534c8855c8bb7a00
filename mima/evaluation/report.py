"""The Table-1 style report (paper 001): absolute and relative accuracy, single-task gap.

A row is one (N, model, task) accuracy. `model` is "zero_shot", "fine_tuned" (each task's own
fine-tuned model on that task) or a merge name; `task` is a task name or "mean".
    relative accuracy of a model = mean_t Acc(model, t) / Acc(theta_t, t)
    single-task gap on task t    = Acc(theta_t, t) - Acc(model, t)
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mima.core.run_folder import SweepFolder
from mima.core.files import read_json, write_json_atomic, write_text_atomic


@dataclass
class ModelResult:
    """One model's per-task test accuracies at one N (plus what was chosen for it)."""

    N: int
    model: str
    accuracy: dict[str, float]
    mean_cos_tau: float | None = None
    hparams: dict[str, object] = field(default_factory=dict)
    validation_accuracy: float | None = None

    @property
    def mean(self) -> float:
        return sum(self.accuracy.values()) / len(self.accuracy)


def relative_accuracy(result: ModelResult, fine_tuned: ModelResult) -> float:
    ratios = [result.accuracy[t] / fine_tuned.accuracy[t] for t in result.accuracy if fine_tuned.accuracy[t] > 0]
    return sum(ratios) / len(ratios) if ratios else float("nan")


def single_task_gap(result: ModelResult, fine_tuned: ModelResult) -> dict[str, float]:
    return {t: fine_tuned.accuracy[t] - result.accuracy[t] for t in result.accuracy}


def results_rows(results: Sequence[ModelResult]) -> list[dict]:
    """The `results.json` contract: one object per (N, model, task|mean)."""
    rows = []
    for result in results:
        cos = result.mean_cos_tau if result.model == "fine_tuned" else None
        for task, value in result.accuracy.items():
            rows.append({"N": result.N, "model": result.model, "task": task, "accuracy": value, "mean_cos_tau": cos})
        rows.append({"N": result.N, "model": result.model, "task": "mean", "accuracy": result.mean, "mean_cos_tau": cos})
    return rows


def _fine_tuned_by_n(results: Iterable[ModelResult]) -> dict[int, ModelResult]:
    return {r.N: r for r in results if r.model == "fine_tuned"}


def csv_text(results: Sequence[ModelResult]) -> str:
    reference = _fine_tuned_by_n(results)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["N", "model", "task", "accuracy", "relative_accuracy", "gap", "mean_cos_tau", "hparams"])
    for result in results:
        fine_tuned = reference.get(result.N)
        gaps = single_task_gap(result, fine_tuned) if fine_tuned else {}
        cos = "" if result.mean_cos_tau is None or result.model != "fine_tuned" else f"{result.mean_cos_tau:.4f}"
        params = json.dumps(result.hparams) if result.hparams else ""
        for task, value in result.accuracy.items():
            ratio = value / fine_tuned.accuracy[task] if fine_tuned and fine_tuned.accuracy[task] else ""
            writer.writerow([result.N, result.model, task, f"{value:.4f}", _fmt(ratio), _fmt(gaps.get(task, "")), cos, params])
        rel = relative_accuracy(result, fine_tuned) if fine_tuned else ""
        gap = fine_tuned.mean - result.mean if fine_tuned else ""
        writer.writerow([result.N, result.model, "mean", f"{result.mean:.4f}", _fmt(rel), _fmt(gap), cos, params])
    return buffer.getvalue()


def _fmt(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


Table = tuple[list[str], list[list[str]]]  # header, rows of cells


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def summary_table(results: Sequence[ModelResult]) -> Table:
    """Average absolute test accuracy (%) per model (rows) and N (columns), plus the mean cos(tau) row."""
    n_values = sorted({r.N for r in results})
    by_key = {(r.N, r.model): r for r in results}
    rows = []
    for model in dict.fromkeys(r.model for r in results):
        rows.append([model] + [f"{100 * by_key[(n, model)].mean:.1f}" if (n, model) in by_key else "" for n in n_values])
    cos_cells = ["mean cos(tau)"]
    for n in n_values:
        result = by_key.get((n, "fine_tuned"))
        cos_cells.append(f"{result.mean_cos_tau:.3f}" if result and result.mean_cos_tau is not None else "")
    return ["model"] + [f"N={n}" for n in n_values], rows + [cos_cells]


def n_table(results: Sequence[ModelResult], n: int) -> Table:
    """Table 1 of paper 001 at one N: abs / rel accuracy, gap and per-task accuracy of every model."""
    fine_tuned = _fine_tuned_by_n(results).get(n)
    tasks = list(results[0].accuracy) if results else []
    header = ["model", "abs. acc (%)", "rel. acc (%)", "gap (pts)"] + [f"{t} (%)" for t in tasks] + ["chosen"]
    rows = []
    for result in (r for r in results if r.N == n):
        rel = f"{100 * relative_accuracy(result, fine_tuned):.1f}" if fine_tuned else ""
        gap = f"{100 * (fine_tuned.mean - result.mean):.1f}" if fine_tuned else ""
        cells = [result.model, f"{100 * result.mean:.1f}", rel, gap] + [f"{100 * result.accuracy[t]:.1f}" for t in tasks]
        cells.append(", ".join(f"{k}={v}" for k, v in result.hparams.items() if k != "matrix_keys"))
        rows.append(cells)
    return header, rows


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
    how the runs were trained (`training`: from `training_setup`; schedule, precision, clipping)."""
    reference = _fine_tuned_by_n(results)
    lines = [f"# {title}", "", *_training_lines(training), "Average absolute test accuracy (%) over the tasks:", ""]
    lines += markdown_table(*summary_table(results))
    for n in sorted({r.N for r in results}):
        fine_tuned = reference.get(n)
        lines += ["", f"## N = {n}", ""]
        if fine_tuned and fine_tuned.mean_cos_tau is not None:
            lines += [f"Mean pairwise cosine of the final task vectors: {fine_tuned.mean_cos_tau:.3f}", ""]
        lines += markdown_table(*n_table(results, n))
    return "\n".join(lines) + "\n"


def read_results(folder: Path | SweepFolder) -> list[ModelResult]:
    """The ModelResults of a results folder (results.json, with the choices from selection.json)."""
    sweep = folder if isinstance(folder, SweepFolder) else SweepFolder(folder)
    rows = read_json(sweep.results_json, expect=list)
    selection_file = sweep.selection_json
    chosen = {}
    if selection_file.is_file():
        for entry in read_json(selection_file).get("selection", []):
            chosen[(entry["N"], entry["model"])] = entry
    results: dict[tuple[int, str], ModelResult] = {}
    for row in rows:
        key = (int(row["N"]), row["model"])
        if key not in results:
            entry = chosen.get(key, {})
            results[key] = ModelResult(key[0], key[1], {}, row.get("mean_cos_tau"), entry.get("hparams") or {},
                                       entry.get("validation_accuracy"))
        if row["task"] != "mean":
            results[key].accuracy[row["task"]] = float(row["accuracy"])
    return list(results.values())


def write_results(
    out_dir: Path | SweepFolder, results: Sequence[ModelResult], extra: Mapping[str, object] | None = None,
    title: str = "Results",
) -> None:
    sweep = out_dir if isinstance(out_dir, SweepFolder) else SweepFolder(out_dir)
    write_json_atomic(sweep.result_file("results.json"), results_rows(results))
    write_text_atomic(sweep.result_file("results.csv"), csv_text(results))
    training = (extra or {}).get("training")  # training_setup's record: stated in results.md's header
    write_text_atomic(sweep.result_file("results.md"), markdown_text(results, title=title, training=training))
    selection = [
        {"N": r.N, "model": r.model, "hparams": r.hparams, "validation_accuracy": r.validation_accuracy}
        for r in results
        if r.hparams or r.validation_accuracy is not None
    ]
    write_json_atomic(sweep.result_file("selection.json"), {"selection": selection, **(extra or {})})
