"""Issue 38, item 1: the 95 % intervals and paired tests of mima.evaluation.statistics, each checked
against an independent computation on hand-made per-image records: scipy.stats.binomtest's Wilson
interval and exact binomial test, an exact McNemar written here in fractions, and a plain numpy
bootstrap that resamples image indices with a fixed seed."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from mima.evaluation.results import ModelResult
from mima.evaluation.significance import add_statistics
from mima.evaluation.statistics import (
    RESAMPLES,
    bootstrap_mean_interval,
    discordant_counts,
    mcnemar_p_value,
    pack_record,
    paired_bootstrap_interval,
    unpack_record,
    wilson_interval,
)

scipy_stats = pytest.importorskip("scipy.stats")


def _exact_mcnemar(b: int, c: int) -> float:
    """Two-sided exact McNemar by definition: the probability, under Binomial(b + c, 1/2), of every
    outcome no more likely than the one seen (the binomial is symmetric: twice the smaller tail)."""
    n = b + c
    if n == 0:
        return 1.0
    probability = [Fraction(math.comb(n, i), 2 ** n) for i in range(n + 1)]
    seen = probability[b]
    return float(min(Fraction(1), sum(p for p in probability if p <= seen)))


def _records(rng: np.random.Generator, total: int, accuracy: float) -> np.ndarray:
    return rng.random(total) < accuracy


def test_wilson_interval_is_scipys():
    for correct, total in [(0, 1), (1, 1), (0, 10), (3, 10), (10, 10), (539, 600), (1, 10000), (9871, 10000), (250, 500)]:
        expected = scipy_stats.binomtest(correct, total).proportion_ci(0.95, method="wilson")
        low, high = wilson_interval(correct, total)
        assert math.isclose(low, expected.low, rel_tol=1e-12, abs_tol=1e-15), (correct, total)
        assert math.isclose(high, expected.high, rel_tol=1e-12, abs_tol=1e-15), (correct, total)
        assert 0.0 <= low <= correct / total <= high <= 1.0
    # 5 of 10 correct: half-width 1.96 / (1 + 1.96^2/10) * sqrt(0.025 + 1.96^2/400), centred on 0.5
    low, high = wilson_interval(5, 10)
    z = 1.959963984540054
    half = z / (1 + z * z / 10) * math.sqrt(0.25 / 10 + z * z / 400)
    assert math.isclose(low, 0.5 - half) and math.isclose(high, 0.5 + half)
    assert math.isclose(low, 0.2366, abs_tol=1e-4) and math.isclose(high, 0.7634, abs_tol=1e-4)  # the textbook values


@pytest.mark.parametrize("b, c", [(0, 0), (0, 1), (1, 0), (3, 10), (10, 3), (7, 7), (0, 25), (50, 70), (400, 330)])
def test_mcnemar_is_the_exact_binomial_test_on_the_discordant_images(b, c):
    p = mcnemar_p_value(b, c)
    assert math.isclose(p, _exact_mcnemar(b, c), rel_tol=1e-12)
    if b + c:
        assert math.isclose(p, scipy_stats.binomtest(b, b + c, 0.5).pvalue, rel_tol=1e-9)
    assert p == mcnemar_p_value(c, b)  # two-sided: the models' order does not matter


def test_mcnemar_from_per_image_records_of_two_models():
    # 12 images: both right on 0-3, only the first on 4-9 (6), only the second on 10 (1), both wrong on 11
    first = np.array([1] * 10 + [0, 0], dtype=bool)
    second = np.array([1] * 4 + [0] * 6 + [1, 0], dtype=bool)
    assert discordant_counts(first, second) == (6, 1)
    # P(X <= 1) for X ~ Binomial(7, 1/2) = (1 + 7) / 128; two-sided 16 / 128
    assert mcnemar_p_value(*discordant_counts(first, second)) == 0.125
    with pytest.raises(ValueError, match="not the same images"):
        discordant_counts(first, second[:-1])


def _index_bootstrap_mean(records: list[np.ndarray], resamples: int, seed: int) -> np.ndarray:
    """The textbook bootstrap: resample each task's images (indices, with replacement), take each
    resample's mean over tasks of the accuracy."""
    rng = np.random.default_rng(seed)
    means = np.zeros(resamples)
    for correct in records:
        indices = rng.integers(0, correct.size, size=(resamples, correct.size))
        means += correct[indices].mean(axis=1)
    return means / len(records)


def test_bootstrap_mean_interval_matches_a_plain_index_bootstrap():
    rng = np.random.default_rng(11)
    records = [_records(rng, 300, 0.8), _records(rng, 120, 0.55), _records(rng, 500, 0.93)]
    counts = [(int(r.sum()), r.size) for r in records]
    low, high = bootstrap_mean_interval(counts)
    expected = np.quantile(_index_bootstrap_mean(records, 20000, seed=5), [0.025, 0.975])
    # Monte Carlo error of a 2.5 % quantile over 2000 resamples: about 0.1 points here
    assert abs(low - expected[0]) < 0.004 and abs(high - expected[1]) < 0.004, ((low, high), expected)
    mean = np.mean([c / t for c, t in counts])
    assert low < mean < high and 0.02 < high - low < 0.08
    # deterministic: the same interval again, with the documented seed and number of resamples
    assert bootstrap_mean_interval(counts) == bootstrap_mean_interval(list(counts), resamples=RESAMPLES, seed=0)
    assert bootstrap_mean_interval(counts, seed=1) != (low, high)


def test_paired_bootstrap_matches_a_plain_index_bootstrap_and_sees_what_unpaired_misses():
    """Two models that agree on almost every image: their accuracies' own intervals overlap, but
    the paired interval of the difference excludes 0 (the pairing removes the images' difficulty)."""
    rng = np.random.default_rng(3)
    tasks = []
    for total in (400, 250):
        first = _records(rng, total, 0.7)
        second = first.copy()
        right = np.flatnonzero(first)
        second[right[: total // 25]] = False  # the second misses 4 % of the images the first gets
        tasks.append((first, second))
    discordant = [(*discordant_counts(a, b), a.size) for a, b in tasks]
    assert [d[1] for d in discordant] == [0, 0]
    low, high = paired_bootstrap_interval(discordant)
    # the textbook paired bootstrap: the same image indices for both models
    index_rng = np.random.default_rng(9)
    differences = np.zeros(20000)
    for a, b in tasks:
        indices = index_rng.integers(0, a.size, size=(20000, a.size))
        differences += a[indices].mean(axis=1) - b[indices].mean(axis=1)
    expected = np.quantile(differences / len(tasks), [0.025, 0.975])
    assert abs(low - expected[0]) < 0.003 and abs(high - expected[1]) < 0.003, ((low, high), expected)
    assert low > 0  # distinguishable at 95 %
    first_ci = bootstrap_mean_interval([(int(a.sum()), a.size) for a, _ in tasks])
    second_ci = bootstrap_mean_interval([(int(b.sum()), b.size) for _, b in tasks])
    assert first_ci[0] < second_ci[1]  # the unpaired intervals overlap
    # no discordant image at all: the difference is exactly 0 in every resample
    assert paired_bootstrap_interval([(0, 0, 100), (0, 0, 7)]) == (0.0, 0.0)


def test_records_pack_to_one_bit_per_image_and_refuse_what_is_not_one():
    rng = np.random.default_rng(0)
    for total in (0, 1, 7, 8, 9, 10000):
        record = _records(rng, total, 0.6)
        text = pack_record(record)
        assert len(text) == 4 * math.ceil(math.ceil(total / 8) / 3)  # base64 of ceil(total / 8) bytes
        assert np.array_equal(unpack_record(text, total), record)
    assert pack_record(np.array([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=bool)) == "sIA="  # 10110000 10000000
    with pytest.raises(ValueError, match="bits set past the last image"):
        unpack_record("sIE=", 9)  # second byte 10000001: a bit set past image 9
    with pytest.raises(ValueError, match="2 bytes where 17 images take 3"):
        unpack_record("sIA=", 17)
    with pytest.raises(ValueError, match="not base64"):
        unpack_record("not base64!", 9)


def test_statistics_of_results_rows_against_the_same_computations_by_hand():
    """add_statistics: the Wilson interval per task, the bootstrap on the mean, and the pairs the
    module names (each merge vs uniform and fine_tuned; the same model against N = 1)."""
    rng = np.random.default_rng(21)
    tasks, sizes = ["a", "b"], {"a": 200, "b": 150}
    levels = {"zero_shot": 0.3, "fine_tuned": 0.95, "uniform": 0.7, "ties": 0.75}
    records, results = {}, []
    for n in (1, 2):
        for model, level in levels.items():
            correct = {task: _records(rng, sizes[task], level + 0.05 * (n - 1)) for task in tasks}
            records[(n, None, model)] = {task: ((int(c.sum()), c.size), c) for task, c in correct.items()}
            results.append(ModelResult(n, model, {task: c.mean() for task, c in correct.items()}))
    add_statistics(results, records)
    ties = next(r for r in results if (r.N, r.model) == (2, "ties"))
    own = records[(2, None, "ties")]
    assert ties.counts == {task: own[task][0] for task in tasks}
    for task in tasks:
        expected = scipy_stats.binomtest(*own[task][0]).proportion_ci(0.95, method="wilson")
        assert np.allclose(ties.intervals[task], (expected.low, expected.high), rtol=1e-12)
    assert ties.intervals["mean"] == bootstrap_mean_interval([own[task][0] for task in tasks])
    assert [(c.N, c.model) for c in ties.comparisons] == [(2, "uniform"), (2, "fine_tuned"), (1, "ties")]
    against_uniform = ties.comparisons[0]
    other = records[(2, None, "uniform")]
    for task in tasks:
        b, c = discordant_counts(own[task][1], other[task][1])
        assert math.isclose(against_uniform.p_values[task], _exact_mcnemar(b, c), rel_tol=1e-12)
    hand_difference = np.mean([own[t][1].mean() - other[t][1].mean() for t in tasks])
    assert math.isclose(against_uniform.difference, hand_difference, rel_tol=1e-12)
    assert against_uniform.distinguishable == (against_uniform.interval[0] > 0 or against_uniform.interval[1] < 0)
    zero_shot = next(r for r in results if (r.N, r.model) == (2, "zero_shot"))
    assert zero_shot.comparisons == [] and "mean" in zero_shot.intervals  # compared with nothing, still an interval
    uniform_n1 = next(r for r in results if (r.N, r.model) == (1, "uniform"))
    assert [(c.N, c.model) for c in uniform_n1.comparisons] == [(1, "fine_tuned")]  # the smallest N: no N below
    fine_tuned = next(r for r in results if (r.N, r.model) == (2, "fine_tuned"))
    # 0.95 + 0.05 vs 0.7 + 0.05 on 350 images: far apart, on the mean and on each task
    assert fine_tuned.comparisons[0].model == "uniform" and fine_tuned.comparisons[0].interval[0] > 0.1
    assert fine_tuned.comparisons[0].distinguishable_tasks() == tasks
