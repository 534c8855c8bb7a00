"""`mima evaluate`: the results table of finished runs, checked against a hand-made evaluation; the
mean and standard deviation over seeds against hand numbers; a second run finding every cell done.
(tests/evaluation/test_evaluate_cells.py: stops, kills, several processes, precision, validation subsets.)"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil

import pytest
import torch
import yaml
from torch.utils.data import DataLoader

from mima.cli import main
from mima.pools import task_pool
from mima.models.classifier import classify
from mima.core.run_folder import RunFolder
from mima.evaluation.results import ModelResult
from mima.evaluation.results_files import read_results, write_results
from mima.commands.fit.run import run_fit
from tests.helpers import fit_config

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


def test_evaluate_refuses_runs_of_different_tasks(tmp_path, small_clip, two_runs, capsys):
    first = two_runs[0]  # rot90 and mirror
    second = run_fit(fit_config(tmp_path / "b", small_clip, ["rot90", "rot180"], steps=4, iterations=1)).run_dir  # S as first
    assert main(["evaluate", str(first), str(second), "--out", str(tmp_path / "t"), "--merges", "uniform"]) == 2
    assert "differ from" in capsys.readouterr().err


@pytest.mark.parametrize("merge, fragment", [("adamerging", "learns from task data"), ("tall", "keeps one model per task")])
def test_evaluate_takes_data_free_merges_only(tmp_path, two_runs, capsys, merge, fragment):
    run = two_runs[0]
    assert main(["evaluate", str(run), "--out", str(tmp_path / "t"), "--merges", "uniform", merge]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0] and "mima merge" in err[0], err
    assert not (tmp_path / "t").exists()  # refused before anything was evaluated


@pytest.fixture
def finished_run(tmp_path, two_runs):
    """A copy of the shared N = 1 run (tests/conftest.py), for a test to damage."""
    return shutil.copytree(two_runs[0], tmp_path / "run")


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


# ------------------------------------------------------------------------------------ seeds
def _result(n, model, seed, a, b, cos=None):
    return ModelResult(n, model, {"a": a, "b": b}, mean_cos_tau=cos, seed=seed)


def test_mean_and_std_over_seeds_against_hand_numbers(tmp_path):
    """Three seeds at N = 2 and one at N = 1: the aggregate rows, the CSV and the Markdown against
    numbers worked out by hand (sample standard deviation, n - 1 = 2)."""
    results = [
        _result(1, "fine_tuned", 0, 0.95, 0.85, cos=0.05), _result(1, "uniform", 0, 0.40, 0.30),
        _result(2, "fine_tuned", 0, 0.90, 0.80, cos=0.10), _result(2, "uniform", 0, 0.60, 0.50),
        _result(2, "fine_tuned", 1, 0.94, 0.78, cos=0.20), _result(2, "uniform", 1, 0.66, 0.52),
        _result(2, "fine_tuned", 2, 0.92, 0.82, cos=0.30), _result(2, "uniform", 2, 0.63, 0.48),
    ]
    write_results(tmp_path, results)
    rows = json.loads((tmp_path / "results.json").read_text())
    assert len([r for r in rows if r["seed"] != "mean"]) == 8 * 3  # every per-run row kept (a, b, mean)
    aggregate = {(r["N"], r["model"], r["task"]): r for r in rows if r["seed"] == "mean"}
    assert set(aggregate) == {(2, model, task) for model in ("fine_tuned", "uniform") for task in ("a", "b", "mean")}
    # uniform on a: 0.60, 0.66, 0.63 -> mean 0.63, deviations -0.03, 0.03, 0 -> std sqrt(0.0018 / 2) = 0.03
    # on b: 0.50, 0.52, 0.48 -> 0.50, std sqrt(0.0008 / 2) = 0.02
    # task averages per seed 0.55, 0.59, 0.555 -> mean 0.565, deviations -0.015, 0.025, -0.01 -> std sqrt(0.00095 / 2)
    for task, mean, std in (("a", 0.63, 0.03), ("b", 0.50, 0.02), ("mean", 0.565, math.sqrt(0.00095 / 2))):
        row = aggregate[(2, "uniform", task)]
        assert row["seeds"] == [0, 1, 2] and row["mean_cos_tau"] is None
        assert math.isclose(row["accuracy"], mean, abs_tol=1e-12) and math.isclose(row["accuracy_std"], std, abs_tol=1e-12)
    cos = aggregate[(2, "fine_tuned", "mean")]  # 0.1, 0.2, 0.3: mean 0.2, std 0.1
    assert math.isclose(cos["mean_cos_tau"], 0.2) and math.isclose(cos["mean_cos_tau_std"], 0.1)

    with open(tmp_path / "results.csv", newline="") as handle:
        csv_rows = list(csv.DictReader(handle))
    row = next(r for r in csv_rows if (r["N"], r["model"], r["task"], r["seed"]) == ("2", "uniform", "mean", "mean"))
    # relative accuracy: each seed's mean over tasks of merged / fine-tuned, averaged over the seeds;
    # gap: fine-tuned minus merged task average per seed (0.30, 0.27, 0.315), averaged
    relative = ((0.60 / 0.90 + 0.50 / 0.80) / 2 + (0.66 / 0.94 + 0.52 / 0.78) / 2 + (0.63 / 0.92 + 0.48 / 0.82) / 2) / 3
    assert (row["accuracy"], row["accuracy_std"], row["relative_accuracy"], row["gap"]) == (
        "0.5650", f"{math.sqrt(0.00095 / 2):.4f}", f"{relative:.4f}", "0.2950")
    assert next(r for r in csv_rows if (r["N"], r["model"], r["task"], r["seed"]) == ("2", "uniform", "a", "1"))["accuracy"] == "0.6600"

    markdown = (tmp_path / "results.md").read_text()
    assert "| uniform | 35.0 | 56.5 ± 2.2 |" in markdown  # N = 1: one seed, a plain cell
    assert "| fine_tuned | 90.0 | 86.0 ± 1.0 |" in markdown
    assert "| mean cos(tau) | 0.050 | 0.200 ± 0.100 |" in markdown
    assert "## N = 2: mean ± std over seeds 0, 1, 2" in markdown and "### N = 2, seed 1" in markdown
    assert "| uniform | 56.5 ± 2.2 |" in markdown  # the seeds table's first cell after the model
    # read back: the per-run results only (the aggregates are recomputed from them)
    assert [(r.N, r.seed, r.model, r.accuracy) for r in read_results(tmp_path)] == [
        (r.N, r.seed, r.model, r.accuracy) for r in results]

    # One seed per N: the files keep the schema of tables without seeds (mima demo, the offline suite).
    single = tmp_path / "single"
    write_results(single, [r for r in results if r.seed == 0])
    assert all(set(row) == {"N", "model", "task", "accuracy", "mean_cos_tau"} for row in json.loads((single / "results.json").read_text()))
    assert (single / "results.csv").read_text().splitlines()[0] == "N,model,task,accuracy,relative_accuracy,gap,mean_cos_tau,hparams"
    assert "±" not in (single / "results.md").read_text()


def test_a_model_measured_once_is_one_value_over_the_seeds_not_a_mean_with_no_spread(tmp_path):
    """A joint model trained at seed 0 and theta_0, each evaluated once and repeated beside both seeds'
    runs, are one measurement each: their aggregate is that value, with no ± and only seed 0 named
    (issue 50: a joint model trained once read "93.6 ± 0.0" with seeds 0, 1, 2)."""
    results = []
    for seed, (a, b) in ((0, (0.60, 0.50)), (1, (0.66, 0.52))):
        results += [ModelResult(2, "zero_shot", {"a": 0.20, "b": 0.10}, seed=seed, measured_at=0),
                    _result(2, "fine_tuned", seed, 0.90, 0.80, cos=0.1),
                    ModelResult(2, "joint", {"a": 0.95, "b": 0.91}, seed=seed, measured_at=0),
                    _result(2, "uniform", seed, a, b)]
    write_results(tmp_path, results)
    rows = json.loads((tmp_path / "results.json").read_text())
    aggregate = {(r["model"], r["task"]): r for r in rows if r["seed"] == "mean"}
    for model, mean in (("joint", 0.93), ("zero_shot", 0.15)):
        row = aggregate[(model, "mean")]
        assert (row["seeds"], row["accuracy_std"]) == ([0], None) and math.isclose(row["accuracy"], mean, abs_tol=1e-12)
    uniform = aggregate[("uniform", "mean")]
    assert uniform["seeds"] == [0, 1] and math.isclose(uniform["accuracy_std"], abs(0.55 - 0.59) / math.sqrt(2), abs_tol=1e-12)
    assert {r["measured_at"] for r in rows if r["seed"] in (0, 1) and r["model"] in ("joint", "zero_shot")} == {0}
    markdown = (tmp_path / "results.md").read_text()
    assert "| joint | 93.0 |" in markdown and "| joint | 93.0 ± " not in markdown
    joint_line, = [line for line in markdown.split("## N = 2: mean ± std over seeds 0, 1")[1].splitlines()
                   if line.startswith("| joint |")][:1]
    assert joint_line.endswith("| 0 |"), joint_line  # the seeds column names the one seed it was trained at
    with open(tmp_path / "results.csv", newline="") as handle:
        joint_csv = next(r for r in csv.DictReader(handle) if (r["model"], r["task"], r["seed"]) == ("joint", "mean", "mean"))
    assert (joint_csv["accuracy"], joint_csv["accuracy_std"]) == ("0.9300", "")
    assert [(r.model, r.seed, r.measured_at) for r in read_results(tmp_path)] == [
        (r.model, r.seed, r.measured_at) for r in results]


@pytest.fixture(scope="module")
def seed_runs(tmp_path_factory, small_clip):
    """Two N = 1 runs that differ only in the seed (seed_everything and data.seed, as sweep_n.sbatch sets them)."""
    folder = tmp_path_factory.mktemp("seed-runs")
    runs = []
    for seed in (0, 1):
        config = fit_config(folder / f"seed{seed}", small_clip, TASKS, steps=4, iterations=1)
        config["seed_everything"] = seed
        config["data"]["seed"] = seed
        runs.append(run_fit(config).run_dir)
    return runs


def _uniform_hand_accuracies(run_dir) -> dict[str, float]:
    """Each task's test accuracy of the plain average of the run's two task models, counted by hand."""
    context = task_pool(run_dir)
    run = RunFolder(run_dir)
    models = [run.final(t) for t in TASKS]
    context.encoder.load_state_dict({k: (models[0][k].double() + models[1][k].double()).div(2).to(models[0][k].dtype)
                                     for k in models[0]})
    return {task: _hand_accuracy(context.encoder, context.heads[task], context.splits[task].test) for task in TASKS}


def test_evaluate_over_seeds_goes_on_from_its_cells_and_matches_a_hand_computation(seed_runs, tmp_path, capsys):
    out = tmp_path / "table"
    argv = ["evaluate", *map(str, seed_runs), "--out", str(out), "--merges", "uniform"]
    assert main(argv) == 0
    assert "N=1, seed 1: cos(tau)" in capsys.readouterr().out
    rows = json.loads((out / "results.json").read_text())
    hand = [_uniform_hand_accuracies(run) for run in seed_runs]
    for task in TASKS:
        a, b = hand[0][task], hand[1][task]
        per_run = {r["seed"]: r["accuracy"] for r in rows if (r["model"], r["task"]) == ("uniform", task)}
        assert abs(per_run[0] - a) < 1e-6 and abs(per_run[1] - b) < 1e-6  # float32, as torchmetrics divides
        # two seeds: mean (a + b) / 2, sample standard deviation |a - b| / sqrt(2)
        assert abs(per_run["mean"] - (a + b) / 2) < 1e-6
        aggregate = next(r for r in rows if (r["model"], r["task"], r["seed"]) == ("uniform", task, "mean"))
        assert aggregate["seeds"] == [0, 1] and abs(aggregate["accuracy_std"] - abs(a - b) / math.sqrt(2)) < 1e-6
    assert any((r["accuracy_std"] or 0) > 0 for r in rows if r["seed"] == "mean")  # the seeds trained different models
    # cells per run: zero_shot (counted once), fine_tuned, uniform on each task's test split, and the geometry
    expected_cells = len(TASKS) + 2 * (2 * len(TASKS) + 1)

    # Again: every cell is found, nothing is evaluated, the same table is written.
    assert main(argv) == 0
    assert f"{expected_cells} cells already done" in capsys.readouterr().out
    assert json.loads((out / "results.json").read_text()) == rows
    # Other merges: another evaluation, refused in one line; --overwrite replaces it.
    other = [*argv[:-1], "uniform", "task_arithmetic", "--no-select"]
    assert main(other) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds the evaluation of another configuration (merges:" in err[0], err
    assert main([*other, "--overwrite"]) == 0
    assert "cells already done" not in capsys.readouterr().out
    # A run trained again since: its files changed, the folder belongs to other runs now.
    final = seed_runs[0] / "final" / f"{TASKS[0]}.safetensors"
    os.utime(final, ns=(final.stat().st_atime_ns, final.stat().st_mtime_ns + 1))
    assert main(other) == 2
    assert "holds the evaluation of other runs" in capsys.readouterr().err


def test_evaluate_refuses_runs_that_differ_in_more_than_the_seed(seed_runs, tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["evaluate", str(seed_runs[0]), str(seed_runs[0]), "--out", str(out), "--merges", "uniform"]) == 2
    assert "both N=1 with seed_everything 0" in capsys.readouterr().err
    other = tmp_path / "lr"
    shutil.copytree(seed_runs[0], other)
    config = yaml.safe_load((other / "config.yaml").read_text())
    config["seed_everything"], config["model"]["lr"] = 7, 0.01
    (other / "config.yaml").write_text(yaml.safe_dump(config))
    assert main(["evaluate", str(seed_runs[1]), str(other), "--out", str(out), "--merges", "uniform"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "differ in model.lr (0.001 vs 0.01), not only in the seed" in err[0], err
    assert not out.exists()
