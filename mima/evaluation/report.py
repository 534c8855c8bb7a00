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

from mima.safetensors_io import write_json_atomic, write_text_atomic


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


def markdown_text(results: Sequence[ModelResult], title: str = "Results") -> str:
    """Per-N Table-1 style tables (abs / rel / gap per task) and a summary across N."""
    reference = _fine_tuned_by_n(results)
    n_values = sorted({r.N for r in results})
    tasks = list(results[0].accuracy) if results else []
    lines = [f"# {title}", ""]
    lines += _summary_table(results, n_values)
    for n in n_values:
        fine_tuned = reference.get(n)
        lines += ["", f"## N = {n}", ""]
        if fine_tuned and fine_tuned.mean_cos_tau is not None:
            lines += [f"Mean pairwise cosine of the final task vectors: {fine_tuned.mean_cos_tau:.3f}", ""]
        header = ["model", "abs. acc (%)", "rel. acc (%)", "gap (pts)"] + [f"{t} (%)" for t in tasks] + ["chosen"]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for result in (r for r in results if r.N == n):
            rel = f"{100 * relative_accuracy(result, fine_tuned):.1f}" if fine_tuned else ""
            gap = f"{100 * (fine_tuned.mean - result.mean):.1f}" if fine_tuned else ""
            cells = [result.model, f"{100 * result.mean:.1f}", rel, gap]
            cells += [f"{100 * result.accuracy[t]:.1f}" for t in tasks]
            cells.append(", ".join(f"{k}={v}" for k, v in result.hparams.items() if k != "matrix_keys"))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _summary_table(results: Sequence[ModelResult], n_values: Sequence[int]) -> list[str]:
    models = list(dict.fromkeys(r.model for r in results))
    by_key = {(r.N, r.model): r for r in results}
    header = ["model"] + [f"N={n}" for n in n_values]
    lines = ["Average absolute test accuracy (%) over the tasks:", "", "| " + " | ".join(header) + " |"]
    lines.append("|" + "---|" * len(header))
    for model in models:
        cells = [model] + [f"{100 * by_key[(n, model)].mean:.1f}" if (n, model) in by_key else "" for n in n_values]
        lines.append("| " + " | ".join(cells) + " |")
    cos_cells = ["mean cos(tau)"]
    for n in n_values:
        result = by_key.get((n, "fine_tuned"))
        cos_cells.append(f"{result.mean_cos_tau:.3f}" if result and result.mean_cos_tau is not None else "")
    lines.append("| " + " | ".join(cos_cells) + " |")
    return lines


def write_results(
    out_dir: Path, results: Sequence[ModelResult], extra: Mapping[str, object] | None = None, title: str = "Results"
) -> None:
    write_json_atomic(out_dir / "results.json", results_rows(results))
    write_text_atomic(out_dir / "results.csv", csv_text(results))
    write_text_atomic(out_dir / "results.md", markdown_text(results, title=title))
    selection = [
        {"N": r.N, "model": r.model, "hparams": r.hparams, "validation_accuracy": r.validation_accuracy}
        for r in results
        if r.hparams or r.validation_accuracy is not None
    ]
    write_json_atomic(out_dir / "selection.json", {"selection": selection, **(extra or {})})
