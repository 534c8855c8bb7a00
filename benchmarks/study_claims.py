"""The study's paired comparisons (issue 38): one recipe against another on the same test images, at
each seed, and over the seeds. benchmarks/study.py writes them to OUT/claims.md after every cell.

A side of a comparison is one model of the study at each seed: a final merge of a cell's run at some
N, or the joint model of a cell. At each seed both sides are read from their evaluations' cells
(mima.services.evaluate.results.recorded_test_records: the per-image records of the hyperparameters
each chose on validation) and compared as `mima evaluate` compares two models of one run
(mima.evaluation.significance.compare: the paired bootstrap over the test images of the difference
of the mean accuracies). The two sides of a seed were trained from the same data seed, so they were
tested on the same images.

Two sources of noise, two intervals:
  per seed    the paired bootstrap 95 % interval: which test images happened to be drawn;
  over seeds  the Student t 95 % interval of the mean of the seeds' differences (n - 1 degrees of
              freedom): which training run happened to be drawn.
The verdict says which of them exclude 0 on one side: "first higher at 95 % (seeds and every seed)"
when the interval over seeds and every seed's interval do, "(seeds)" or "(every seed)" when only one
of them does; otherwise "not distinguishable".
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mima.core.errors import MimaError
from mima.core.names import JOINT, Z95

# Student t's 97.5 % quantile by degrees of freedom (scipy.stats.t.ppf(0.975, df); the test checks
# them against scipy), so that the study needs no scipy
T975 = {1: 12.706204736174694, 2: 4.302652729749462, 3: 3.1824463052837078, 4: 2.7764451051977934,
        5: 2.5705818356363146, 6: 2.4469118511449786, 7: 2.364624251592784, 8: 2.306004135204166,
        9: 2.262157162798205, 10: 2.228138851986274}


@dataclass(frozen=True)
class Side:
    """One model of the study at each seed: `model` on the cell's N = `n` run, or its joint model."""

    cell: str  # the cell's folder under the study's output, e.g. "T4/equal/atm"
    model: str  # a final merge, fine_tuned, or JOINT
    n: int | None = None  # the run's N (None for the joint model)

    def where(self, out: Path, seed: int, first_seed: int) -> tuple[Path, Path]:
        """(the evaluation folder, the run folder) that hold this side at `seed` (benchmarks/study.py:
        the sweep's joint model is the first seed's, the others are in joint-seed<s>)."""
        cell = out / self.cell
        if self.model != JOINT:
            return cell, cell / "runs" / f"N{self.n}-seed{seed}"
        if seed == first_seed:
            return cell, cell / "runs" / JOINT
        return cell / f"{JOINT}-seed{seed}", cell / "runs" / f"{JOINT}-seed{seed}"

    def label(self) -> str:
        tasks, budget, operator = self.cell.split("/")
        budgets = "" if budget == "equal" else f" ({budget} budgets)"
        if self.model == JOINT:
            return f"{tasks} joint{budgets}"
        sync = "MIMA" if operator == "uniform" else operator
        return f"{tasks} {sync}{budgets} N={self.n} + {self.model}"


@dataclass(frozen=True)
class Claim:
    """`first` against `second`; `says` names the README or docs statement it checks."""

    first: Side
    second: Side
    says: str = ""


def t975(df: int) -> float:
    """Student t's 97.5 % quantile: the table up to 10 degrees of freedom, beyond it the
    Cornish-Fisher expansion about the normal quantile (within 1e-5 of it from 11 on)."""
    if df in T975:
        return T975[df]
    z = Z95
    terms = ((z ** 3 + z) / 4, (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96,
             (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384,
             (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160)
    return z + sum(term / df ** (power + 1) for power, term in enumerate(terms))


def t_interval(values: Sequence[float]) -> tuple[float, float] | None:
    """The Student t 95 % interval of the mean of `values` (None for fewer than two)."""
    if len(values) < 2:
        return None
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    mean = statistics.fmean(values)
    return mean - half, mean + half


def verdict(intervals: Sequence[tuple[float, float]], over_seeds: tuple[float, float] | None) -> str:
    """The module text's verdict from the per-seed intervals and the interval over seeds."""
    for sign, winner in ((1, "first higher"), (-1, "second higher")):
        images = bool(intervals) and all(sign * low > 0 and sign * high > 0 for low, high in intervals)
        seeds = over_seeds is not None and all(sign * bound > 0 for bound in over_seeds)
        if images or seeds:
            return f"{winner} at 95 % ({' and '.join(w for w, held in (('seeds', seeds), ('every seed', images)) if held)})"
    return "not distinguishable"


def evaluate_claim(claim: Claim, out: Path, seeds: Sequence[int]) -> dict | None:
    """The claim's numbers in points (%), or None while a side's evaluation is not there yet."""
    from mima.services.evaluate.results import recorded_test_records
    from mima.evaluation.significance import compare

    per_seed = []
    for seed in seeds:
        sides = [side.where(out, seed, seeds[0]) for side in (claim.first, claim.second)]
        if not all((folder / "results.json").is_file() and run.is_dir() for folder, run in sides):
            return None
        first = recorded_test_records(*sides[0], claim.first.model)
        second = recorded_test_records(*sides[1], claim.second.model)
        if list(first) != list(second) or any(first[t][0][1] != second[t][0][1] for t in first):
            raise MimaError(f"{claim.first.label()} and {claim.second.label()}: not the same test images at seed {seed}")
        comparison = compare(first, second, (0, seed, claim.second.model))
        per_seed.append({"seed": seed, "difference": 100 * comparison.difference,
                         "ci95": [100 * bound for bound in comparison.interval]})
    differences = [row["difference"] for row in per_seed]
    over_seeds = t_interval(differences)
    return {
        "first": claim.first.label(), "second": claim.second.label(), "says": claim.says,
        "difference": statistics.fmean(differences),
        "difference_std": statistics.stdev(differences) if len(differences) > 1 else None,
        "ci95_over_seeds": list(over_seeds) if over_seeds else None,
        "per_seed": per_seed,
        "verdict": verdict([tuple(row["ci95"]) for row in per_seed], over_seeds),
    }


def diverged_sides(claim: Claim, out: Path, seeds: Sequence[int]) -> list[str]:
    """Where a run the claim compares diverged (its diverged.json: no final models, so no comparison),
    one entry per side and report, its seeds together: "T12 atm N=40 + uniform, seeds 0, 1, 2: task
    mnist diverged: ..."; empty when none did."""
    from mima.core.run_folder import RunFolder

    seeds_of: dict[tuple[str, str], list[int]] = {}  # (side, report) -> the seeds it diverged at, in order
    for seed in seeds:
        for side in (claim.first, claim.second):
            _, run = side.where(out, seed, seeds[0])
            report = RunFolder(run).divergence() if run.is_dir() else None
            if report is not None:
                seeds_of.setdefault((side.label(), report), []).append(seed)
    return [f"{label}, seed{'s' if len(found) > 1 else ''} {', '.join(map(str, found))}: {report}"
            for (label, report), found in seeds_of.items()]


def mean_std(mean: float, std: float | None, signed: bool = False) -> str:
    """'93.4 ± 0.2' (one decimal; no std for one seed); `signed`: '+1.1 ± 0.2'."""
    value = f"{mean:+.1f}" if signed else f"{mean:.1f}"
    return value if std is None else f"{value} ± {std:.1f}"


def claims_markdown(rows: Sequence[dict], pending: Sequence[Claim], seeds: Sequence[int],
                    diverged: Sequence[tuple[Claim, list[str]]] = ()) -> str:
    """OUT/claims.md: one line per comparison, then those not compared because a run diverged
    (`diverged`: each with where), then those whose cells have not been evaluated yet."""
    lines = [f"# The study's paired comparisons, seeds {list(seeds)}", "",
             "Difference of the mean test accuracy over the tasks, first minus second, in points: mean ± "
             "sample std over the seeds, the Student t 95 % interval of that mean, and each seed's paired "
             "bootstrap 95 % interval over the test images (benchmarks/study_claims.py says how).", "",
             "| first | second | difference | 95 % over seeds | 95 % per seed (images) | verdict | checks |",
             "| --- | --- | ---: | --- | --- | --- | --- |"]
    for row in rows:
        over = "[{:+.1f}, {:+.1f}]".format(*row["ci95_over_seeds"]) if row["ci95_over_seeds"] else "-"
        seeds_text = "; ".join("[{:+.1f}, {:+.1f}]".format(*r["ci95"]) for r in row["per_seed"])
        lines.append(f"| {row['first']} | {row['second']} | {mean_std(row['difference'], row['difference_std'], signed=True)} | {over} | {seeds_text} | "
                     f"{row['verdict']} | {row['says']} |")
    for claim, where in diverged:
        lines += ["", f"Not compared, a run diverged: {claim.first.label()} vs {claim.second.label()} ({'; '.join(where)})."]
    if pending:
        lines += ["", "Not evaluated yet: " + "; ".join(f"{c.first.label()} vs {c.second.label()}" for c in pending) + "."]
    return "\n".join(lines) + "\n"
