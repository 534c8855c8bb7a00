"""`mima demo` end to end: the MIMA effect on the embedded digits tasks (the issue's acceptance bars)."""

import json

import pytest

from mima.cli import main
from mima.merging import MERGE_METHODS


@pytest.mark.slow
def test_demo_shows_the_mima_effect(tmp_path):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--no-progress"]) == 0
    for name in ("results.json", "results.csv", "results.md", "selection.json", "merged_accuracy_vs_N.png", "cosine_vs_N.png"):
        assert (out / name).is_file(), name
    rows = json.loads((out / "results.json").read_text())
    assert all(set(row) == {"N", "model", "task", "accuracy", "mean_cos_tau"} for row in rows)
    assert {row["model"] for row in rows} == {"zero_shot", "fine_tuned", *MERGE_METHODS}
    assert all(0.0 <= row["accuracy"] <= 1.0 for row in rows)

    def mean(model, n):
        return next(r["accuracy"] for r in rows if r["model"] == model and r["N"] == n and r["task"] == "mean")

    cos = [next(r["mean_cos_tau"] for r in rows if r["model"] == "fine_tuned" and r["N"] == n) for n in (1, 2, 4, 8)]
    assert cos == sorted(cos) and cos[-1] - cos[0] > 0.3, cos  # alignment rises with N
    assert mean("uniform", 8) - mean("uniform", 1) >= 0.05  # the uniform merge gains >= 5 points
    assert abs(mean("fine_tuned", 8) - mean("fine_tuned", 1)) <= 0.03  # fine-tuned accuracy kept
    assert all(mean("zero_shot", 1) < mean(m, 8) for m in MERGE_METHODS)
