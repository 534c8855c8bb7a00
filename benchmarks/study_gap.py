"""The joint-gap report of benchmarks/study.py's gap grid (issue 50): how far one merged model is below
the joint multi-task model at each number of syncs, per operator at the sync and per final merge.

For each T, each cell of equal budgets (an operator at the sync), each N and each final merge: the
joint gap = the joint model's mean test accuracy minus the merged model's, in points, paired at each
seed on the same test images (benchmarks/study_claims.py: the paired bootstrap 95 % interval per seed,
the Student t 95 % interval over the seeds). Each row's standing against the joint model:
  level   not distinguishable: the interval over the seeds holds 0 and so does every seed's own;
  below   the joint model higher by the interval over the seeds or at some seed, and never lower;
  above   the merge higher by the interval over the seeds or at some seed, and never lower;
  mixed   higher at one seed, lower at another;
  diverged  a run of that N stopped with a NaN or inf loss or weight at some seed (its diverged.json):
          no merged model there, no gap; it does not reach the joint model.
A merge *reaches* the joint model when it is level or above; the report gives the smallest N at which
it does, and whether every larger N of the cell does too. Beside it:
the syncs (N - 1: every phase after the first starts from a merge), the bytes a federated layout
(W = T, one process per task) would send and receive per process over them (`mima plan`'s figure,
from each run's cost.json), the measured CPU seconds per fit, and which runs came from an earlier study.

Written by `write_gap_report` into OUT/gap.md, OUT/gap.json and OUT/joint_gap_vs_syncs.png.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from study_claims import Claim, Side, diverged_sides, evaluate_claim, mean_std  # noqa: E402

from mima.core.names import FINE_TUNED, JOINT  # noqa: E402

GAP_FIGURE = "joint_gap_vs_syncs.png"
SAYS = "the joint gap (issue 50)"


REACHES = ("level", "above")
# The figure's y axis: linear up to LINEAR_GAP points and logarithmic beyond, in a row where some gap
# passes COLLAPSED_GAP (a merge that collapsed); GAP_TICKS label it.
LINEAR_GAP, COLLAPSED_GAP = 10.0, 20.0
GAP_TICKS = (-5, -2, 0, 2, 4, 6, 8, 10, 20, 50, 100)
OPERATOR_NAMES = {"uniform": "uniform average (MIMA)", "outer_nesterov": "outer Nesterov", "atm": "ATM"}  # the legend's  # the standings in which a merge has reached the joint model


def standing(claim: Mapping) -> str:
    """The module text's standing of a merge against the joint model from the claim joint - merge: its
    Student t interval over the seeds (None with one seed: the seed's own decides) and each seed's."""
    intervals = [seed["ci95"] for seed in claim["per_seed"]]
    if claim["ci95_over_seeds"] is not None:
        intervals.append(claim["ci95_over_seeds"])
    joint_higher = any(low > 0 for low, _ in intervals)
    merge_higher = any(high < 0 for _, high in intervals)
    if joint_higher and merge_higher:
        return "mixed"
    return "below" if joint_higher else "above" if merge_higher else "level"


def format_bytes(count: float | None) -> str:
    if count is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"


def _summary(rows: Sequence[Mapping], tasks: int, operator: str, n: int, model: str) -> Mapping | None:
    found = [r for r in rows if (r["T"], r["budget"], r["operator"], r["N"], r["model"]) == (tasks, "equal", operator, n, model)]
    return found[0] if found else None


def _accuracy(row: Mapping | None) -> str:
    return "-" if row is None else mean_std(row["accuracy"], row["accuracy_std"])


def _run_costs(costs: Sequence[Mapping], tasks: int, operator: str, n: int) -> list[Mapping]:
    prefix = f"N{n}-seed"
    return [c for c in costs if (c["T"], c["budget"], c["operator"]) == (tasks, "equal", operator) and c["run"].startswith(prefix)]


def gap_rows(out: Path, grid, rows: Sequence[Mapping], costs: Sequence[Mapping], iterations_of: Callable,
             data_merges: Collection[str]) -> tuple[list[dict], list[str]]:
    """One row per (T, operator, N, merge) whose evaluations are done, and the labels of those still
    pending. `grid`: benchmarks/study.py's Grid; `iterations_of(cell)`: the N its cell trains."""
    found, pending = [], []
    joint_cells = {cell.tasks: str(cell.folder(Path())) for cell in grid.cells if cell.joint and cell.budget == "equal"}
    for cell in grid.cells:
        if cell.budget != "equal" or cell.tasks not in joint_cells:
            continue
        name = str(cell.folder(Path()))
        for n in iterations_of(cell):
            run_costs = _run_costs(costs, cell.tasks, cell.operator, n)
            federated = [c["plan_sync_bytes_federated"] for c in run_costs if c.get("plan_sync_bytes_federated") is not None]
            for merge in (m for m in cell.merges if m not in data_merges):
                claim = Claim(Side(joint_cells[cell.tasks], JOINT), Side(name, merge, n), SAYS)
                merged = _summary(rows, cell.tasks, cell.operator, n, merge)
                joint = _summary(rows, cell.tasks, "uniform", n, JOINT) or _summary_any_n(rows, cell.tasks)
                # both cells' tables in this process's rows too (a cell another process evaluated: pending
                # until the whole grid's process has read it), so that no row shows a gap without its accuracies
                # a run that diverged is reported once its cell is (the cell's sweep has evaluated the others)
                evaluated = any((r["T"], r["budget"], r["operator"]) == (cell.tasks, "equal", cell.operator) for r in rows)
                lost = diverged_sides(claim, out, list(grid.seeds)) if evaluated and joint else []
                compared = evaluate_claim(claim, out, list(grid.seeds)) if merged and joint and not lost else None
                if compared is None and not lost:
                    pending.append(claim.second.label())
                    continue
                if lost:  # no model at that seed: no gap, and it does not reach the joint model
                    compared = {"difference": None, "difference_std": None, "ci95_over_seeds": None, "per_seed": [],
                                "verdict": "not compared: " + "; ".join(lost)}
                # cost.json before cpu_complete: whole unless resumed (an earlier attempt's seconds were not
                # kept); a run that diverged stopped short of S, so its seconds are not a fit's
                measured = [c for c in run_costs if c.get("cpu_complete", not c.get("resumed", False)) and not c.get("diverged")]
                found.append({
                    "T": cell.tasks, "operator": cell.operator, "N": n, "syncs": n - 1, "merge": merge,
                    "merged": merged, "task_models": _summary(rows, cell.tasks, cell.operator, n, FINE_TUNED),
                    "joint": joint, "gap": compared["difference"], "gap_std": compared["difference_std"],
                    "ci95_over_seeds": compared["ci95_over_seeds"], "per_seed": compared["per_seed"],
                    "verdict": compared["verdict"], "standing": "diverged" if lost else standing(compared),
                    "federated_bytes_per_process": statistics.fmean(federated) if federated else None,
                    "cpu_s_per_fit": statistics.fmean(c["cpu_s"] for c in measured) if measured else None,
                    "cpu_fits": len(measured), "fits": len(run_costs),
                    "reused": sorted(c["run"] for c in run_costs if c.get("reused_from")),
                })
    return found, pending


def _summary_any_n(rows: Sequence[Mapping], tasks: int) -> Mapping | None:
    """The joint model's row (the same model at every N of its cell)."""
    found = [r for r in rows if (r["T"], r["budget"], r["operator"], r["model"]) == (tasks, "equal", "uniform", JOINT)]
    return found[0] if found else None


def smallest_reaching(gaps: Sequence[Mapping]) -> list[dict]:
    """Per (T, operator, merge): the smallest N whose merge reaches the joint model (level or above),
    its standing, syncs and bytes, and whether every larger N of the cell reaches it too; N None where
    no N of the cell does (up to the largest N it has)."""
    groups: dict[tuple[int, str, str], list[Mapping]] = {}
    for row in gaps:
        groups.setdefault((row["T"], row["operator"], row["merge"]), []).append(row)
    result = []
    for (tasks, operator, merge), group in groups.items():
        group = sorted(group, key=lambda row: row["N"])
        reaching = [row for row in group if row["standing"] in REACHES]
        first = reaching[0] if reaching else None
        result.append({"T": tasks, "operator": operator, "merge": merge, "largest_N": group[-1]["N"],
                       "N": first["N"] if first else None, "syncs": first["syncs"] if first else None,
                       "standing": first["standing"] if first else None,
                       "every_larger_N": all(row["standing"] in REACHES for row in group if row["N"] >= first["N"])
                       if first else None,
                       "federated_bytes_per_process": first["federated_bytes_per_process"] if first else None,
                       "gap": first["gap"] if first else None})
    return result


def _interval(values: Sequence[float] | None) -> str:
    return "-" if values is None else "[{:+.1f}, {:+.1f}]".format(*values)


def gap_markdown(gaps: Sequence[Mapping], smallest: Sequence[Mapping], pending: Sequence[str], seeds: Sequence[int],
                 reused: Sequence[str]) -> str:
    lines = [f"# The joint gap (issue 50), seeds {list(seeds)}", "",
             "Joint gap = the joint model's mean test accuracy minus the merged model's, in points (positive: the "
             "joint model is higher): mean ± std over the seeds, the Student t 95 % interval over the seeds and each "
             "seed's paired bootstrap 95 % interval on the same test images; the standing against the joint model: "
             "level (none of them excludes 0), below (joint higher, never lower), above (merge higher, never lower), "
             "mixed, or diverged (a run of that N diverged at some seed: no merged model there, no gap); the verdict as "
             "benchmarks/study_claims.py words it. "
             "Syncs = N - 1; bytes: sent + received per process over the syncs in a federated layout "
             "(W = T, `mima plan`); CPU s: measured per fit, mean over the seeds.", ""]
    for tasks in sorted({row["T"] for row in gaps}):
        lines += [f"## T = {tasks}", "",
                  "| operator | N | syncs | bytes per process (W = T) | CPU s per fit | task models | merge | merged | joint | "
                  "joint gap | 95 % over seeds | 95 % per seed | standing | verdict |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | --- | --- | --- |"]
        for row in (r for r in gaps if r["T"] == tasks):
            per_seed = "; ".join(_interval(seed["ci95"]) for seed in row["per_seed"])
            cpu = "-" if row["cpu_s_per_fit"] is None else f"{row['cpu_s_per_fit']:.0f}"
            if row["cpu_s_per_fit"] is not None and row["cpu_fits"] < row["fits"]:
                cpu += f" ({row['cpu_fits']} of {row['fits']} fits measured whole)"
            lines.append(f"| {row['operator']} | {row['N']} | {row['syncs']} | {format_bytes(row['federated_bytes_per_process'])} | "
                         f"{cpu} | {_accuracy(row['task_models'])} | {row['merge']} | {_accuracy(row['merged'])} | "
                         f"{_accuracy(row['joint'])} | {'-' if row['gap'] is None else mean_std(row['gap'], row['gap_std'], signed=True)} | "
                         f"{_interval(row['ci95_over_seeds'])} | {per_seed} | {row['standing']} | {row['verdict']} |")
        lines.append("")
    lines += ["## The smallest N at which a merge reaches the joint model (level or above)", "",
              "| T | operator | final merge | smallest N | standing there | every larger N too | syncs | "
              "bytes per process (W = T) | joint gap there |",
              "| ---: | --- | --- | ---: | --- | --- | ---: | ---: | ---: |"]
    for row in smallest:
        if row["N"] is None:
            lines.append(f"| {row['T']} | {row['operator']} | {row['merge']} | none up to N = {row['largest_N']} | - | - | - | - | - |")
        else:
            lines.append(f"| {row['T']} | {row['operator']} | {row['merge']} | {row['N']} | {row['standing']} | "
                         f"{'yes' if row['every_larger_N'] else 'no'} | {row['syncs']} | "
                         f"{format_bytes(row['federated_bytes_per_process'])} | {row['gap']:+.1f} |")
    lines += ["", "Runs copied, not trained again (from an earlier study or the outer choice): " + (", ".join(reused) if reused else "none") + "."]
    if pending:
        lines += ["", "Not evaluated yet: " + "; ".join(pending) + "."]
    return "\n".join(lines) + "\n"


def plot_gap(gaps: Sequence[Mapping], path: Path) -> None:
    """The joint gap against the syncs: one panel per (T, final merge), one line per operator, the
    Student t interval over the seeds shaded; 0 (level) dashed; a row where some gap passes COLLAPSED_GAP
    gets a y axis linear up to LINEAR_GAP and logarithmic beyond."""
    task_counts = sorted({row["T"] for row in gaps})
    merges = list(dict.fromkeys(row["merge"] for row in gaps))
    operators = list(dict.fromkeys(row["operator"] for row in gaps))
    colours = dict(zip(operators, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    figure, axes = plt.subplots(len(task_counts), len(merges), figsize=(3.3 * len(merges), 3.0 * len(task_counts)),
                                sharex=True, sharey="row", squeeze=False)
    ticks = sorted({max(row["syncs"], 1) for row in gaps})
    for i, tasks in enumerate(task_counts):
        for j, merge in enumerate(merges):
            axis = axes[i][j]
            for operator in operators:
                every = sorted((r for r in gaps if (r["T"], r["merge"], r["operator"]) == (tasks, merge, operator)),
                               key=lambda r: r["syncs"])
                lost = [max(r["syncs"], 1) for r in every if r["gap"] is None]
                if lost:  # diverged at some seed: no gap to draw; a cross on the zero line marks the N
                    axis.scatter(lost, [0.0] * len(lost), marker="x", s=60, color=colours[operator], zorder=3)
                line = [r for r in every if r["gap"] is not None]
                if not line:
                    continue
                syncs = [max(r["syncs"], 1) for r in line]  # N = 1 (no sync) at 1 on the log axis
                axis.plot(syncs, [r["gap"] for r in line], marker="o", color=colours[operator])
                level = [(s, r["gap"]) for s, r in zip(syncs, line) if r["standing"] in REACHES]
                if level:  # a ring: the merge reaches the joint model (level or above)
                    axis.scatter([s for s, _ in level], [g for _, g in level], s=110, facecolors="none",
                                 edgecolors="black", linewidths=1.0, zorder=3)
                shaded = [(s, r["ci95_over_seeds"]) for s, r in zip(syncs, line) if r["ci95_over_seeds"]]
                if shaded:
                    axis.fill_between([s for s, _ in shaded], [c[0] for _, c in shaded], [c[1] for _, c in shaded],
                                      color=colours[operator], alpha=0.15, linewidth=0)
            axis.axhline(0.0, color="black", linestyle="--", linewidth=0.8)
            row_gaps = [r["gap"] for r in gaps if r["T"] == tasks and r["gap"] is not None]
            if max(map(abs, row_gaps), default=0.0) > COLLAPSED_GAP:
                # a merge that collapsed (tens of points) would flatten the few points near level that the
                # figure is about: linear up to LINEAR_GAP, logarithmic beyond
                axis.set_yscale("symlog", linthresh=LINEAR_GAP, linscale=2.0)
                gap_ticks = [t for t in GAP_TICKS if min(row_gaps) - 2 <= t <= 1.5 * max(row_gaps)]
                axis.set_yticks(gap_ticks, [f"{t:g}" for t in gap_ticks])
            axis.set_xscale("log")
            axis.set_xticks(ticks, [str(t) for t in ticks])
            axis.minorticks_off()
            axis.set_title(f"T = {tasks}, final merge: {merge}", fontsize=9)
            if i == len(task_counts) - 1:
                axis.set_xlabel("syncs (N - 1)")
            if j == 0:
                axis.set_ylabel("joint - merged (points)")
    handles = [Line2D([], [], color=colours[operator], marker="o") for operator in operators]
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    figure.legend(handles, [OPERATOR_NAMES.get(o, o) for o in operators], loc="lower center", ncol=max(len(operators), 1),
                  fontsize=8,
                  title="operator at the sync (ring: the merge reaches the joint model; cross: a run diverged)",
                  title_fontsize=8, frameon=False)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_gap_report(out: Path, grid, rows: Sequence[Mapping], costs: Sequence[Mapping], iterations_of: Callable,
                     data_merges: Collection[str]) -> list[dict]:
    """OUT/gap.md, gap.json and the figure from the cells evaluated so far; the gap rows."""
    gaps, pending = gap_rows(out, grid, rows, costs, iterations_of, data_merges)
    smallest = smallest_reaching(gaps)
    reused = [f"T{c['T']}/{c['budget']}/{c['operator']}/{c['run']}" for c in costs if c.get("reused_from")]
    out.mkdir(parents=True, exist_ok=True)
    (out / "gap.md").write_text(gap_markdown(gaps, smallest, pending, grid.seeds, reused))
    (out / "gap.json").write_text(json.dumps({"grid": grid.name, "seeds": list(grid.seeds), "rows": gaps,
                                              "smallest_reaching": smallest, "reused": reused, "pending": pending},
                                             indent=2) + "\n")
    if gaps:
        plot_gap(gaps, out / GAP_FIGURE)
    return gaps
