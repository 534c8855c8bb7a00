"""Which results rows get which 95 % intervals, and which pairs of models are compared.

From each row's per-task records (counts, and the per-image record where its cells hold one):
  * every task: the Wilson interval of its accuracy; the mean over tasks: the bootstrap interval
    (mima.evaluation.statistics, which also says how both are computed);
  * pairs, each within one seed, on the same test images: in each run (N, seed), every model but
    zero_shot against each REFERENCE present in the run (uniform, the best-known data-free merge;
    joint, the multi-task model; fine_tuned, each task's own model); and every model but zero_shot
    and joint (the same model at every N) against itself at the run's seed's smallest N (what N
    changes). Per task the exact McNemar test, on the mean the paired bootstrap interval. That is
    at most (models x (len(REFERENCES) + 1)) pairs per run, not every pair of models: the
    comparisons the tables and the claims made from them need.
A pair is left out where one of its rows lacks a per-image record (cells of an earlier mima).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from mima.core.names import FINE_TUNED, JOINT, ZERO_SHOT
from mima.evaluation.results import Comparison, ModelResult
from mima.evaluation.statistics import (
    bootstrap_mean_interval,
    discordant_counts,
    mcnemar_p_value,
    paired_bootstrap_interval,
    wilson_interval,
)

REFERENCES = ("uniform", JOINT, FINE_TUNED)  # what every model of a run is compared with
UNCOMPARED = ZERO_SHOT  # theta_0: below everything, compared with nothing
SAME_AT_EVERY_N = (ZERO_SHOT, JOINT)  # one model for every run: no comparison across N

TaskRecord = tuple[tuple[int, int], "np.ndarray | None"]  # (correct, total) and the per-image record
RowKey = tuple[int, object, str]  # (N, seed, model)


def add_statistics(results: Sequence[ModelResult], records: Mapping[RowKey, Mapping[str, TaskRecord]]) -> None:
    """Give each result with records its counts, intervals and comparisons (the module text)."""
    for result in results:
        own = records.get(_key(result))
        if own is None:
            continue
        result.counts = {task: own[task][0] for task in result.accuracy}
        result.intervals = {task: wilson_interval(*result.counts[task]) for task in result.accuracy}
        result.intervals["mean"] = bootstrap_mean_interval([result.counts[task] for task in result.accuracy])
        result.comparisons = [compare(own, records[key], key) for key in _partners(result, records)
                              if _recorded(own) and _recorded(records[key])]


def compare(first: Mapping[str, TaskRecord], second: Mapping[str, TaskRecord], other: RowKey) -> Comparison:
    """`first` against `second` (the row `other`) on the same images of each task."""
    discordant = []
    for task, ((_, total), correct) in first.items():
        discordant.append((*discordant_counts(correct, second[task][1]), total))
    return Comparison(
        N=other[0], model=other[2],
        difference=sum((only_first - only_second) / total for only_first, only_second, total in discordant) / len(discordant),
        interval=paired_bootstrap_interval(discordant),
        p_values={task: mcnemar_p_value(only_first, only_second)
                  for task, (only_first, only_second, _) in zip(first, discordant)},
    )


def _key(result: ModelResult) -> RowKey:
    return result.N, result.seed, result.model


def _partners(result: ModelResult, records: Mapping[RowKey, object]) -> list[RowKey]:
    """The rows `result` is compared with, in the module text's order."""
    if result.model == UNCOMPARED:
        return []
    partners = [(result.N, result.seed, reference) for reference in REFERENCES if reference != result.model]
    smallest = min(n for n, seed, _ in records if seed == result.seed)
    if result.N != smallest and result.model not in SAME_AT_EVERY_N:
        partners.append((smallest, result.seed, result.model))
    return [key for key in partners if key in records]


def _recorded(rows: Mapping[str, TaskRecord]) -> bool:
    return all(correct is not None for _, correct in rows.values())
