"""`mima evaluate`: the results table of finished runs, checked against a hand-made evaluation."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch.utils.data import DataLoader

from mima.cli import main
from mima.pools import task_pool
from mima.models.classifier import classify
from mima.core.run_folder import RunFolder
from mima.training.trainer import run_fit
from tests.conftest import fit_config

TASKS = ["rot90", "mirror"]


def _hand_accuracy(encoder, head, dataset) -> float:
    """Top-1 accuracy counted in a plain loop (no torchmetrics)."""
    encoder.eval()
    correct = 0
    with torch.no_grad():
        for images, labels in DataLoader(dataset, batch_size=100):
            correct += int((classify(encoder, head, images).argmax(dim=1) == labels).sum())
    return correct / len(dataset)


def test_evaluate_two_runs_matches_a_hand_computed_uniform_merge(tmp_path, small_clip, capsys):
    runs = []
    for n in (1, 2):
        config = fit_config(tmp_path / f"N{n}", small_clip, TASKS, steps=4, iterations=n)
        runs.append(run_fit(config).run_dir)
    out = tmp_path / "table"
    assert main(["evaluate", *map(str, runs), "--out", str(out), "--merges", "uniform", "task_arithmetic"]) == 0
    rows = json.loads((out / "results.json").read_text())
    assert {(r["N"], r["model"]) for r in rows} == {
        (n, m) for n in (1, 2) for m in ("zero_shot", "fine_tuned", "uniform", "task_arithmetic")
    }
    assert (out / "results.md").is_file() and (out / "merged_accuracy_vs_N.png").stat().st_size > 0

    context = task_pool(runs[1])
    run = RunFolder(runs[1])
    models = [run.final(task) for task in TASKS]
    mean = {key: (models[0][key].double() + models[1][key].double()).div(2).to(models[0][key].dtype) for key in models[0]}
    context.encoder.load_state_dict(mean)
    for task in TASKS:
        expected = _hand_accuracy(context.encoder, context.heads[task], context.splits[task].test)
        reported = next(r["accuracy"] for r in rows if (r["N"], r["model"], r["task"]) == (2, "uniform", task))
        # torchmetrics reports float32: equal counts agree to ~1e-8, one example apart is 1/len(test)
        assert abs(reported - expected) < 1e-6 < 1 / len(context.splits[task].test)
    selection = json.loads((out / "selection.json").read_text())
    assert selection["runs"] == [str(r) for r in runs]
    assert "N=2: cos(tau)" in capsys.readouterr().out


def test_evaluate_refuses_runs_of_different_tasks(tmp_path, small_clip, capsys):
    first = run_fit(fit_config(tmp_path / "a", small_clip, TASKS, steps=2, iterations=1)).run_dir
    second = run_fit(fit_config(tmp_path / "b", small_clip, ["rot90", "rot180"], steps=2, iterations=1)).run_dir
    assert main(["evaluate", str(first), str(second), "--out", str(tmp_path / "t"), "--merges", "uniform"]) == 2
    assert "differ from" in capsys.readouterr().err


@pytest.mark.parametrize("merge, fragment", [("adamerging", "learns from task data"), ("tall", "keeps one model per task")])
def test_evaluate_takes_data_free_merges_only(tmp_path, small_clip, capsys, merge, fragment):
    run = run_fit(fit_config(tmp_path / "a", small_clip, TASKS, steps=2, iterations=1)).run_dir
    started = time.monotonic()
    assert main(["evaluate", str(run), "--out", str(tmp_path / "t"), "--merges", "uniform", merge]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0] and "mima merge" in err[0], err
    assert time.monotonic() - started < 30 and not (tmp_path / "t").exists()


@pytest.fixture
def finished_run(tmp_path, small_clip):
    return run_fit(fit_config(tmp_path / "run", small_clip, TASKS, steps=2, iterations=1)).run_dir


@pytest.mark.parametrize(
    "damage, argv, fragment",
    [
        (lambda run: (run / "metrics.jsonl").write_text("{bad\n"), ["analyze", "cosine", "{run}"], "metrics.jsonl: line 1 is not valid JSON"),
        (lambda run: sorted((run / "final").glob("*.json"))[0].write_text("[1, 2]"), ["evaluate", "{run}", "--out", "{out}"], "expected a JSON object"),
        (lambda run: (run / "config.yaml").write_text("model: [\n"), ["report", "{run}"], "config.yaml: not valid YAML"),
        (lambda run: None, ["evaluate", "{run}/final/rot90.safetensors", "--out", "{out}"], "a file, not a run folder"),
        (lambda run: None, ["evaluate", "{run}/nope", "--out", "{out}"], "no such run folder"),
    ],
    ids=["metrics-jsonl", "final-json", "config-yaml", "file-for-folder", "missing"],
)
def test_damaged_or_wrong_run_folders_are_one_line_and_leave_no_output(finished_run, tmp_path, capsys, damage, argv, fragment):
    damage(finished_run)
    out = tmp_path / "table"
    code = main([arg.format(run=finished_run, out=out) for arg in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and fragment in err[0], err
    assert not out.exists()
