"""The Markdown tables of evaluation results: Table 1 of paper 001 per N (absolute and relative
accuracy, single-task gap, per-task accuracy), the summary across N, and results.md's text.

A cell of an N with several seeds is the mean ± the sample standard deviation over them
(mima.evaluation.results computes both). Results with per-image records (`mima evaluate`) add, per
run, the 95 % intervals and paired comparisons (`significance_table`; a difference in bold is
distinguishable at 95 %).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mima.core.names import FINE_TUNED
from mima.evaluation.results import ModelResult, fine_tuned_by_run, relative_accuracy, seed_summaries, seeds_at

Table = tuple[list[str], list[list[str]]]  # header, rows of cells


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _percent(stats: tuple[float, float | None] | None) -> str:
    """'82.4 ± 1.3' (percent, one decimal) from a (mean, std) pair; '82.4' for one measurement (no std)."""
    if stats is None:
        return ""
    return f"{100 * stats[0]:.1f}" if stats[1] is None else f"{100 * stats[0]:.1f} ± {100 * stats[1]:.1f}"


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
        if (n, FINE_TUNED) in summaries:
            cos = summaries[(n, FINE_TUNED)].mean_cos_tau()
            cos_cells.append(f"{cos[0]:.3f} ± {cos[1]:.3f}" if cos else "")
            continue
        result = by_key.get((n, FINE_TUNED))
        cos_cells.append(f"{result.mean_cos_tau:.3f}" if result and result.mean_cos_tau is not None else "")
    return ["model"] + [f"N={n}" for n in n_values], rows + [cos_cells]


def run_table(results: Sequence[ModelResult], n: int, seed: int | None) -> Table:
    """Table 1 of paper 001 for the run at N = n with `seed`: abs / rel accuracy, gap and per-task
    accuracy of every model."""
    fine_tuned = fine_tuned_by_run(results).get((n, seed))
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


SIGNIFICANCE_NOTE = (
    "95 % intervals and paired tests on the same test images (mima.evaluation.statistics): the mean accuracy "
    "with its bootstrap interval over the images; against another model of the run (or the same model at the "
    "smallest N), the difference of the mean accuracies in points with its paired bootstrap interval, **in bold** "
    "where it is distinguishable at 95 % (the interval excludes 0), then the tasks whose exact McNemar test "
    "gives p < 0.05.")


def _points(value: float) -> str:
    return f"{100 * value:+.1f}"


def _comparison_cell(comparison) -> str:
    """'**+1.2** [+0.4, +2.0]; mnist, svhn' (bold: distinguishable; the tasks: McNemar p < 0.05)."""
    difference = _points(comparison.difference)
    low, high = comparison.interval
    cell = f"{f'**{difference}**' if comparison.distinguishable else difference} [{_points(low)}, {_points(high)}]"
    tasks = comparison.distinguishable_tasks()
    return cell + (f"; {', '.join(tasks)}" if tasks else "")


def significance_table(results: Sequence[ModelResult], n: int, seed: int | None) -> Table | None:
    """The run's mean accuracies with their 95 % intervals and its paired comparisons (one column
    per model compared with: 'vs uniform', 'vs N=1', ...), or None without per-image records."""
    rows_of_run = [r for r in results if r.N == n and r.seed == seed and "mean" in r.intervals]
    if not rows_of_run:
        return None
    def column(comparison) -> str:  # another N: the same model there
        return f"vs {comparison.model}" if comparison.N == n else f"vs N={comparison.N}"

    # the run's own models first (the order met), then the other N
    met = list(dict.fromkeys((c.N != n, column(c)) for r in rows_of_run for c in r.comparisons))
    columns = [name for _, name in sorted(met, key=lambda key: key[0])]
    rows = []
    for result in rows_of_run:
        low, high = result.intervals["mean"]
        by_column = {column(c): c for c in result.comparisons}
        cells = [result.model, f"{100 * result.mean:.1f} [{100 * low:.1f}, {100 * high:.1f}]"]
        rows.append(cells + [_comparison_cell(by_column[name]) if name in by_column else "" for name in columns])
    return ["model", "mean acc (%) [95 % CI]", *columns], rows


def n_table(results: Sequence[ModelResult], n: int) -> Table:
    """Table 1 of paper 001 at one N: the run's table, or the mean ± std over seeds where N has several."""
    seeds = seeds_at(results, n)
    return run_table(results, n, seeds[0]) if len(seeds) == 1 else seeds_table(results, n)


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
    results: Sequence[ModelResult], title: str = "Results", training: Mapping | Sequence[Mapping] | None = None,
    diverged: Mapping[str, str] | None = None,
) -> str:
    """Per-N Table-1 style tables (abs / rel / gap per task) and a summary across N, after a line on
    how the runs were trained (`training`: from `training_setup`; schedule, precision, clipping) and
    one per run left out because it diverged (`diverged`: {run: report}). An N with several seeds gets
    the mean ± std table over them, then one table per seed."""
    reference = fine_tuned_by_run(results)
    lines = [f"# {title}", "", *_training_lines(training)]
    if diverged:
        lines += [f"Left out, diverged (no final models): {run}: {report}." for run, report in diverged.items()] + [""]
    if seed_summaries(results):
        lines += ["Where an N has several runs that differ only in the seed, a cell is the mean ± the sample "
                  "standard deviation over the seeds. A model measured once and repeated beside every seed's run "
                  "(zero_shot; a joint model trained at one seed) is that one value, without ±, its seed alone named.", ""]
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
            significance = significance_table(results, n, seed)
            if significance is not None:
                lines += ["", SIGNIFICANCE_NOTE, ""] + markdown_table(*significance)
    return "\n".join(lines) + "\n"
