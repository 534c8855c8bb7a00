"""`mima demo` end to end: the MIMA effect on the embedded digits tasks, and AdaMerging on its runs."""

import json
from pathlib import Path

import pytest

from mima.cli import main
from mima.services.evaluate.options import COMPARED_MERGES
from mima.merging import get_method
from mima.pools import task_pool
from mima.merging.selection import select_on_validation
from mima.core.run_folder import RunFolder


# The README's demo runs N = 1, 2, 4, 8 (and the joint baseline); the test runs the two ends, which is
# where the effect it checks shows, in 3/5 of the time.
ITERATIONS = (1, 8)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "demo"
    assert main(["demo", "--out", str(out), "--no-progress", "--iterations", *map(str, ITERATIONS)]) == 0
    return out


@pytest.mark.slow
def test_demo_shows_the_mima_effect(demo):
    for name in ("results.json", "results.csv", "results.md", "selection.json", "merged_accuracy_vs_N.png", "cosine_vs_N.png"):
        assert (demo / name).is_file(), name
    rows = json.loads((demo / "results.json").read_text())
    assert all({"N", "model", "task", "accuracy", "mean_cos_tau"} <= set(row) for row in rows)
    # per-image records: each task row with its counts and Wilson interval (mima.evaluation.statistics)
    assert all({"correct", "images", "ci95"} <= set(row) for row in rows if row["task"] != "mean")
    assert {row["model"] for row in rows} == {"zero_shot", "fine_tuned", "joint", *COMPARED_MERGES}
    assert all(0.0 <= row["accuracy"] <= 1.0 for row in rows)

    def mean(model, n):
        return next(r["accuracy"] for r in rows if r["model"] == model and r["N"] == n and r["task"] == "mean")

    cos = [next(r["mean_cos_tau"] for r in rows if r["model"] == "fine_tuned" and r["N"] == n) for n in ITERATIONS]
    assert cos[-1] - cos[0] > 0.3, cos  # alignment rises with N
    assert mean("uniform", 8) - mean("uniform", 1) >= 0.05  # the uniform merge gains >= 5 points
    assert abs(mean("fine_tuned", 8) - mean("fine_tuned", 1)) <= 0.03  # fine-tuned accuracy kept
    assert all(mean("zero_shot", 1) < mean(m, 8) for m in COMPARED_MERGES)
    # the joint baseline is one model (runs/joint), the same row at every N, and it learns the tasks
    assert len({mean("joint", n) for n in ITERATIONS}) == 1 and mean("joint", 1) > mean("zero_shot", 1) + 0.2
    assert RunFolder(demo / "runs" / "joint").is_joint()


@pytest.mark.slow
def test_adamerging_lowers_entropy_and_beats_task_arithmetic_on_the_demo_tasks(demo):
    run = RunFolder(demo / "runs" / "N1")
    pool = task_pool(run.path)
    base, models = run.pretrained(), [run.final(task) for task in run.task_order()]
    test = pool.evaluator("test")
    task_arithmetic = select_on_validation(get_method("task_arithmetic"), models, base, pool.evaluator("val").mean_accuracy)
    adamerged = get_method("adamerging").merge(models, base, pool=pool)
    note = adamerged.notes
    assert note["entropy_after"] < note["entropy_before"]
    assert test.mean_accuracy(adamerged.state) >= test.mean_accuracy(task_arithmetic.merged)


@pytest.mark.slow
def test_report_and_analyses_on_the_demo(demo):
    """The analysis commands of docs/analyses.md on the demo run, then the page that gathers them."""
    n8 = demo / "runs" / "N8"
    assert main(["analyze", "landscape", str(n8), "--tasks", "rot90", "rot180", "--resolution", "5"]) == 0
    assert main(["analyze", "ctl", str(n8), "--tasks", "rot90", "rot180", "--examples", "50"]) == 0
    assert main(["report", str(demo)]) == 0
    markdown = (demo / "report.md").read_text()
    for image in ("merged_accuracy_vs_N.png", "analysis/cosine/cosine_heatmaps_N8.png",
                  "runs/N8/analysis/landscape/landscape.png", "runs/N8/analysis/ctl/ctl.png"):
        assert f"]({image})" in markdown and (demo / image).is_file(), image
    landscape = json.loads((n8 / "analysis" / "landscape" / "landscape.json").read_text())
    cosine = json.loads((demo / "analysis" / "cosine" / "cosine.json").read_text())
    final = next(run for run in cosine["runs"] if run["N"] == 8)["phases"][-1]["cos_tau"]
    # the landscape's angle between the two task vectors is the one the trainer logged
    assert abs(landscape["basis"]["cos_tau_a_tau_b"] - final[0][1]) < 1e-5
