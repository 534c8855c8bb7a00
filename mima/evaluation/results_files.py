"""The results files of a sweep or of one run's evaluation: written together, read back.

With one run per N the files are as they always were:
    results.json  rows {N, model, task, accuracy, mean_cos_tau}
    results.csv   N, model, task, accuracy, relative_accuracy, gap, mean_cos_tau, hparams
    results.md    the summary across N, then one table per N
With several seeds at some N:
    results.json  per-run rows {N, model, task, seed, accuracy, mean_cos_tau}, then the aggregate rows
                  {N, model, task, seed: "mean", seeds: [...], accuracy, accuracy_std, mean_cos_tau,
                  mean_cos_tau_std} (mean_cos_tau: fine_tuned rows only, as in the per-run rows).
                  A model measured once and repeated beside every seed's run (zero_shot; a joint
                  model trained at one seed) has measured_at: that seed in its per-run rows, and
                  its aggregate rows hold that one value: seeds [that seed], accuracy_std null
    results.csv   the columns seed (after task) and accuracy_std (after accuracy) are added; the
                  aggregate rows have seed "mean"
    results.md    summary cells "mean ± std" where an N has several seeds; per such N the mean ± std
                  table, then one table per seed
    selection.json each entry also names its seed
Where the results come from per-image records (`mima evaluate`; mima.evaluation.significance), each
per-run row also holds (the fields above unchanged):
    task rows     correct, images (the counts), ci95 [low, high] (Wilson), paired: one entry per
                  comparison {N, model, p_value (exact McNemar), distinguishable (p < 0.05)}
    "mean" rows   ci95 (bootstrap over the images), paired: {N, model, difference, ci95 (paired
                  bootstrap), distinguishable (ci95 excludes 0)}
(the other model of a pair: that N and model, the same seed; intervals as fractions, like accuracy).
The rows and aggregates are mima.evaluation.results', the Markdown mima.evaluation.tables'.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from mima.core.bounded_json import read_json, short_json
from mima.core.errors import MimaError
from mima.core.files import write_json_atomic, write_text_atomic
from mima.core.names import FINE_TUNED
from mima.core.run_folder import SweepFolder
from mima.evaluation.results import (
    MEAN_OVER_SEEDS,
    Comparison,
    ModelResult,
    fine_tuned_by_run,
    relative_accuracy,
    seed_summaries,
    several_seeds,
    single_task_gap,
)
from mima.evaluation.tables import markdown_text


def results_rows(results: Sequence[ModelResult]) -> list[dict]:
    """The `results.json` contract: one object per (N, model, task|mean); where an N has several
    seeds, each names its seed and the aggregate rows over seeds (seed "mean") follow."""
    with_seed = several_seeds(results)
    rows = []
    for result in results:
        cos = result.mean_cos_tau if result.model == FINE_TUNED else None
        seed = {"seed": result.seed} if with_seed else {}
        if with_seed and result.measured_at is not None:
            seed["measured_at"] = result.measured_at  # one model repeated beside every seed's run
        for task, value in result.accuracy.items():
            rows.append({"N": result.N, "model": result.model, "task": task, **seed, "accuracy": value, "mean_cos_tau": cos,
                         **_task_statistics(result, task)})
        rows.append({"N": result.N, "model": result.model, "task": "mean", **seed, "accuracy": result.mean,
                     "mean_cos_tau": cos, **_mean_statistics(result)})
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


def _task_statistics(result: ModelResult, task: str) -> dict:
    """A task row's counts, interval and paired tests (none where the result has no records)."""
    if task not in result.intervals:
        return {}
    correct, total = result.counts[task]
    paired = [{"N": other.N, "model": other.model, "p_value": other.p_values[task],
               "distinguishable": task in other.distinguishable_tasks()} for other in result.comparisons]
    return {"correct": correct, "images": total, "ci95": list(result.intervals[task]), "paired": paired}


def _mean_statistics(result: ModelResult) -> dict:
    if "mean" not in result.intervals:
        return {}
    paired = [{"N": other.N, "model": other.model, "difference": other.difference, "ci95": list(other.interval),
               "distinguishable": other.distinguishable} for other in result.comparisons]
    return {"ci95": list(result.intervals["mean"]), "paired": paired}


def _read_statistics(result: ModelResult, row: Mapping) -> None:
    """What `_task_statistics` and `_mean_statistics` wrote, back into `result`."""
    if "ci95" not in row:
        return
    task = row["task"]
    result.intervals[task] = (float(row["ci95"][0]), float(row["ci95"][1]))
    if task == "mean":
        for entry in row["paired"]:
            comparison = _comparison(result, entry)
            comparison.difference, comparison.interval = float(entry["difference"]), tuple(map(float, entry["ci95"]))
        return
    result.counts[task] = (int(row["correct"]), int(row["images"]))
    for entry in row["paired"]:
        _comparison(result, entry).p_values[task] = float(entry["p_value"])


def _comparison(result: ModelResult, entry: Mapping) -> Comparison:
    """`result`'s comparison with the row `entry` names (made when first met)."""
    for comparison in result.comparisons:
        if (comparison.N, comparison.model) == (entry["N"], entry["model"]):
            return comparison
    result.comparisons.append(Comparison(int(entry["N"]), entry["model"], float("nan"), (float("nan"), float("nan")), {}))
    return result.comparisons[-1]


def csv_text(results: Sequence[ModelResult]) -> str:
    reference = fine_tuned_by_run(results)
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
        cos = "" if result.mean_cos_tau is None or result.model != FINE_TUNED else f"{result.mean_cos_tau:.4f}"
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
            row(summary.N, summary.model, task, MEAN_OVER_SEEDS, f"{mean:.4f}", "" if std is None else f"{std:.4f}",
                _fmt(rel[0]) if rel else "", _fmt(gap[0]) if gap else "", _fmt(cos[0]) if cos else "", "")
    return buffer.getvalue()


def _fmt(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def result_row_problem(row: object) -> str | None:
    """Why an entry of results.json is not a row of the contract above (None: it is): what its
    readers (`mima report`, mima.load_results, read_results) take from each row. Other keys are free."""
    if not isinstance(row, dict):
        return f"is not an object of N, model, task and accuracy (found {short_json(row)})"
    if not isinstance(row.get("N"), int) or isinstance(row.get("N"), bool):
        return f"has no whole-number 'N' (found {short_json(row.get('N'))})"
    for key in ("model", "task"):
        if not isinstance(row.get(key), str):
            return f"has no name {key!r} (found {short_json(row.get(key))})"
    for key, optional in (("accuracy", False), ("mean_cos_tau", True)):
        value = row.get(key)
        if not (optional and value is None) and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            return f"has no number {key!r} (found {short_json(value)})"
    seed = row.get("seed")
    if not (seed is None or seed == MEAN_OVER_SEEDS or isinstance(seed, int) and not isinstance(seed, bool)):
        return f"has a 'seed' that is neither a whole number nor {MEAN_OVER_SEEDS!r} (found {short_json(seed)})"
    measured_at = row.get("measured_at")
    if not (measured_at is None or isinstance(measured_at, int) and not isinstance(measured_at, bool)):
        return f"has a 'measured_at' that is not the whole-number seed of a run (found {short_json(measured_at)})"
    return None


def read_result_rows(folder: Path | SweepFolder) -> list[dict]:
    """results.json's rows, each checked (`result_row_problem`): a damaged one is one line naming the
    file and the row."""
    sweep = folder if isinstance(folder, SweepFolder) else SweepFolder(folder)
    rows = read_json(sweep.results_json, expect=list)
    for index, row in enumerate(rows):
        problem = result_row_problem(row)
        if problem is not None:
            raise MimaError(f"{sweep.results_json}: row {index} {problem}")
    return rows


def read_results(folder: Path | SweepFolder) -> list[ModelResult]:
    """The per-run ModelResults of a results folder (results.json, with the choices from
    selection.json, and the counts, intervals and comparisons where the rows hold them); the
    aggregate rows over seeds are left out (seed_summaries recomputes them)."""
    sweep = folder if isinstance(folder, SweepFolder) else SweepFolder(folder)
    rows = read_result_rows(sweep)
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
                                       entry.get("validation_accuracy"), seed=seed, measured_at=row.get("measured_at"))
        if row["task"] != "mean":
            results[key].accuracy[row["task"]] = float(row["accuracy"])
        _read_statistics(results[key], row)
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
    diverged = (extra or {}).get("diverged")  # runs a sweep left out: stated under the header
    write_text_atomic(sweep.result_file("results.md"), markdown_text(results, title=title, training=training,
                                                                     diverged=diverged))
    with_seed = several_seeds(results)
    selection = [
        {"N": r.N, **({"seed": r.seed} if with_seed else {}), "model": r.model, "hparams": r.hparams,
         "validation_accuracy": r.validation_accuracy}
        for r in results
        if r.hparams or r.validation_accuracy is not None
    ]
    write_json_atomic(sweep.result_file("selection.json"), {"selection": selection, **(extra or {})})
    write_json_atomic(sweep.result_file("results.json"), results_rows(results))
