"""Issue 38, item 1: every count cell of `mima evaluate` holds which images it classified correctly;
the records are the same bit for bit when an evaluation resumes; a tampered record is evaluated
again; results.json, results.md and the report carry the intervals and paired tests, checked here
against an independent computation from the records on disk (scipy's Wilson interval, an exact
McNemar in fractions, a numpy bootstrap over image indices)."""

from __future__ import annotations

import json
import math
import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from mima.cli import main
from mima.core.run_folder import RunFolder
from mima.evaluation.accuracy import accuracy_of
from mima.evaluation.cells import cell_check, manifest_fingerprint
from mima.evaluation.statistics import pack_record, unpack_record
from mima.models.classifier import classify
from mima.pools import task_pool
from tests.helpers import cli

TASKS = ["rot90", "mirror"]
MERGES = ["uniform", "task_arithmetic"]  # task_arithmetic's grid: validation cells with records too


def _argv(runs: list[Path], out: Path) -> list[str]:
    return ["evaluate", *map(str, runs), "--out", str(out), "--merges", *MERGES]


@pytest.fixture(scope="module")
def evaluated(two_runs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("records") / "table"
    assert main(_argv(two_runs, out)) == 0
    return out


def _lines(out: Path) -> dict[tuple, dict]:
    """Every cell line of an evaluation folder, by its cell."""
    found = {}
    for path in sorted((out / "cells").glob("*.jsonl")):
        for line in path.read_text().splitlines(keepends=True):
            if not line.endswith("\n"):
                continue  # a line cut by a stop: never finished, not read
            entry = json.loads(line)
            found[tuple(entry["cell"])] = entry
    return found


def _hand_records(run: Path, split: str) -> dict[str, np.ndarray]:
    """theta_0's per-image correctness on each task's split, in a plain loop over the dataset."""
    pool = task_pool(run)
    pool.encoder.load_state_dict(RunFolder(run).pretrained())
    pool.encoder.eval()
    found = {}
    with torch.no_grad():
        for task in TASKS:  # the evaluation's batch size: the same float32 sums, so no near-tie can differ
            batches = DataLoader(getattr(pool.splits[task], split), batch_size=512)
            found[task] = np.concatenate([(classify(pool.encoder, pool.heads[task], images).argmax(dim=1) == labels).numpy()
                                          for images, labels in batches])
    return found


def test_each_count_cell_holds_its_per_image_record(two_runs, evaluated):
    lines = _lines(evaluated)
    counted = {cell: entry for cell, entry in lines.items() if cell[1] != "pairwise_cos_tau"}
    assert {cell[3] for cell in counted} == {"val", "test"}  # the validation grid's cells have records too
    for cell, entry in counted.items():
        correct, total = entry["value"]
        record = unpack_record(entry["images"], total)
        assert int(record.sum()) == correct, cell
    hand = _hand_records(two_runs[0], "test")
    for task in TASKS:
        entry = next(e for cell, e in counted.items() if cell[1:] == ("zero_shot", "{}", "test", task))
        assert np.array_equal(unpack_record(entry["images"], entry["value"][1]), hand[task])  # image by image, in order
        assert entry["images"] == pack_record(hand[task])


def test_a_resumed_evaluation_records_the_same_images_bit_for_bit(two_runs, evaluated, tmp_path, capfd):
    out = tmp_path / "table"
    shutil.copytree(evaluated, out)
    (out / "results.json").unlink()
    kept = 0
    for path in sorted((out / "cells").glob("*.jsonl")):  # a stop part-way: the later half of the cells lost
        lines = path.read_text().splitlines(keepends=True)
        kept += len(lines) // 2
        path.write_text("".join(lines[: len(lines) // 2]) + lines[len(lines) // 2][:40])  # and a cut line
    again = cli(_argv(two_runs, out), capfd)
    assert again.code == 0 and f"{kept} cells already done" in again.out, again.out[-2000:]
    assert _lines(out) == _lines(evaluated)  # the same lines, records and digests included
    assert (out / "results.json").read_text() == (evaluated / "results.json").read_text()
    assert (out / "results.md").read_text() == (evaluated / "results.md").read_text()


def _flip_first_image(entry: dict, manifest: dict) -> dict:
    """One image's correctness flipped; the check digest left as it was."""
    record = unpack_record(entry["images"], entry["value"][1])
    record[0] = not record[0]
    return {**entry, "images": pack_record(record)}


def _forged_record(entry: dict, manifest: dict) -> dict:
    """One image flipped and the digest recomputed as mima computes it: the counts no longer agree."""
    images = _flip_first_image(entry, manifest)["images"]
    return {**entry, "images": images, "check": cell_check(manifest_fingerprint(manifest), entry["cell"], entry["value"], images)}


def _record_removed(entry: dict, manifest: dict) -> dict:
    return {key: value for key, value in entry.items() if key != "images"}  # the digest still covers it


@pytest.mark.parametrize("edit, says", [
    (_flip_first_image, "its check digest does not match its content"),
    (_forged_record, "its per-image record has"),
    (_record_removed, "its check digest does not match its content"),
])
def test_a_tampered_record_is_named_and_evaluated_again(two_runs, evaluated, tmp_path, capfd, edit, says):
    out = tmp_path / "table"
    shutil.copytree(evaluated, out)
    manifest = json.loads((out / "cells.json").read_text())
    path = sorted((out / "cells").glob("*.jsonl"))[0]
    lines = path.read_text().splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if json.loads(line)["cell"][1] == "uniform")
    lines[index] = json.dumps(edit(json.loads(lines[index]), manifest)) + "\n"
    path.write_text("".join(lines))
    again = cli(_argv(two_runs, out), capfd)
    assert again.code == 0, again.err[-2000:]
    named = [line for line in again.out.splitlines() if "is not a valid cell" in line]
    assert len(named) == 1 and f"{path}: line {index + 1}" in named[0] and says in named[0], again.out
    assert (out / "results.json").read_text() == (evaluated / "results.json").read_text()


def test_a_cell_line_of_an_earlier_mima_without_a_record_is_used_without_paired_tests(two_runs, evaluated, tmp_path, capfd):
    out = tmp_path / "table"
    shutil.copytree(evaluated, out)
    fingerprint = manifest_fingerprint(json.loads((out / "cells.json").read_text()))
    for path in (out / "cells").glob("*.jsonl"):
        entries = [json.loads(line) for line in path.read_text().splitlines()]
        old = [{"cell": e["cell"], "value": e["value"], "check": cell_check(fingerprint, e["cell"], e["value"])}
               if e["cell"][1] == "uniform" and e["cell"][4] == "mirror" and e["cell"][0] == str(two_runs[1].resolve()) else e
               for e in entries]
        path.write_text("".join(json.dumps(e) + "\n" for e in old))
    again = cli(_argv(two_runs, out), capfd)
    assert again.code == 0 and "not a valid cell" not in again.out, again.out[-2000:]
    rows = json.loads((out / "results.json").read_text())
    untampered = json.loads((evaluated / "results.json").read_text())
    assert [r["accuracy"] for r in rows] == [r["accuracy"] for r in untampered]
    uniform = next(r for r in rows if (r["N"], r["model"], r["task"]) == (2, "uniform", "mean"))
    assert uniform["ci95"] == next(r["ci95"] for r in untampered if (r["N"], r["model"], r["task"]) == (2, "uniform", "mean"))
    assert uniform["paired"] == []  # its records incomplete: no paired test
    assert all(entry["model"] != "uniform" for r in rows if r["N"] == 2 for entry in r.get("paired", []))


# ---------------------------------------------------------------------------- the results files
def _exact_mcnemar(b: int, c: int) -> float:
    n = b + c
    if n == 0:
        return 1.0
    probability = [Fraction(math.comb(n, i), 2 ** n) for i in range(n + 1)]
    return float(min(Fraction(1), sum(p for p in probability if p <= probability[b])))


def _test_records(out: Path, runs: list[Path]) -> dict[tuple[int, str], dict[str, np.ndarray]]:
    """(N, model) -> task -> the per-image record its results row is built from (merges at their chosen point)."""
    selection = {(entry["N"], entry["model"]): entry["hparams"] for entry in json.loads((out / "selection.json").read_text())["selection"]}
    lines = _lines(out)
    found = {}
    for n, run in zip((1, 2), runs):
        for model in ("zero_shot", "fine_tuned", *MERGES):
            where = str(runs[0].resolve()) if model == "zero_shot" else str(run.resolve())
            point = json.dumps(selection.get((n, model), {}), sort_keys=True)
            found[(n, model)] = {task: unpack_record(lines[(where, model, point, "test", task)]["images"],
                                                     lines[(where, model, point, "test", task)]["value"][1]) for task in TASKS}
    return found


def test_results_json_intervals_and_paired_tests_recomputed_from_the_records(two_runs, evaluated):
    pytest.importorskip("scipy")
    from scipy.stats import binomtest

    rows = json.loads((evaluated / "results.json").read_text())
    records = _test_records(evaluated, two_runs)
    by_key = {(r["N"], r["model"], r["task"]): r for r in rows}
    for (n, model), per_task in records.items():
        for task, record in per_task.items():
            row = by_key[(n, model, task)]
            assert (row["correct"], row["images"]) == (int(record.sum()), record.size)
            assert row["accuracy"] == accuracy_of(int(record.sum()), record.size)  # the accuracy as before, from the counts
            wilson = binomtest(int(record.sum()), record.size).proportion_ci(0.95, method="wilson")
            assert np.allclose(row["ci95"], [wilson.low, wilson.high], rtol=1e-12, atol=1e-15)
        # the mean's interval: a plain numpy bootstrap over image indices (seeded), within its Monte Carlo error
        rng = np.random.default_rng(1)
        means = np.mean([r[rng.integers(0, r.size, size=(20000, r.size))].mean(axis=1) for r in per_task.values()], axis=0)
        low, high = np.quantile(means, [0.025, 0.975])
        mean_row = by_key[(n, model, "mean")]
        assert abs(mean_row["ci95"][0] - low) < 0.01 and abs(mean_row["ci95"][1] - high) < 0.01, (mean_row["ci95"], low, high)
    # the pairs: every merge and fine_tuned against uniform and fine_tuned, and at N = 2 against itself at N = 1
    partners = {(r["N"], r["model"]): [(p["N"], p["model"]) for p in r["paired"]] for r in rows if r["task"] == "mean"}
    assert partners[(2, "task_arithmetic")] == [(2, "uniform"), (2, "fine_tuned"), (1, "task_arithmetic")]
    assert partners[(1, "uniform")] == [(1, "fine_tuned")] and partners[(2, "zero_shot")] == []
    compared = 0
    for (n, model), pairs in partners.items():
        for other_n, other in pairs:
            first, second = records[(n, model)], records[(other_n, other)]
            for task in TASKS:
                b = int((first[task] & ~second[task]).sum())
                c = int((second[task] & ~first[task]).sum())
                entry = next(p for p in by_key[(n, model, task)]["paired"] if (p["N"], p["model"]) == (other_n, other))
                assert math.isclose(entry["p_value"], _exact_mcnemar(b, c), rel_tol=1e-12)
                assert entry["distinguishable"] == (entry["p_value"] < 0.05)
            entry = next(p for p in by_key[(n, model, "mean")]["paired"] if (p["N"], p["model"]) == (other_n, other))
            assert math.isclose(entry["difference"], np.mean([first[t].mean() - second[t].mean() for t in TASKS]), abs_tol=1e-12)
            rng = np.random.default_rng(2)
            draws = []
            for task in TASKS:
                indices = rng.integers(0, first[task].size, size=(20000, first[task].size))
                draws.append(first[task][indices].mean(axis=1) - second[task][indices].mean(axis=1))
            low, high = np.quantile(np.mean(draws, axis=0), [0.025, 0.975])
            assert abs(entry["ci95"][0] - low) < 0.01 and abs(entry["ci95"][1] - high) < 0.01, (entry, low, high)
            assert entry["distinguishable"] == (entry["ci95"][0] > 0 or entry["ci95"][1] < 0)
            compared += 1
    # per run: fine_tuned vs uniform, uniform vs fine_tuned, task_arithmetic vs both; at N = 2 each of the three vs N = 1
    assert compared == 2 * 4 + 3
    assert any(p["distinguishable"] for r in rows for p in r.get("paired", []) if r["task"] == "mean")


def test_results_md_and_the_report_mark_the_distinguishable_differences(evaluated, tmp_path):
    rows = json.loads((evaluated / "results.json").read_text())
    markdown = (evaluated / "results.md").read_text()
    assert "distinguishable at 95 %" in markdown
    assert "| model | mean acc (%) [95 % CI] | vs uniform | vs fine_tuned | vs N=1 |" in markdown
    for row in (r for r in rows if r["task"] == "mean" and r["N"] == 2 and r["paired"]):
        for entry in row["paired"]:
            difference = f"{100 * entry['difference']:+.1f}"
            cell = (f"**{difference}**" if entry["distinguishable"] else difference) + \
                f" [{100 * entry['ci95'][0]:+.1f}, {100 * entry['ci95'][1]:+.1f}]"
            assert cell in markdown, (row["model"], entry)
    assert main(["report", str(evaluated), "--out", str(tmp_path / "page")]) == 0
    page = (tmp_path / "page" / "report.md").read_text()
    assert "N = 2: 95 % intervals and paired tests" in page and "| model | mean acc (%) [95 % CI] |" in page
    assert "<b>" in (tmp_path / "page" / "report.html").read_text()  # the bold differences, in HTML
