"""benchmarks/study.py (issue 38, item 5) on a tiny grid: the small CLIP on two digits tasks, one seed,
N in {1, 2}, two phase-end operators (uniform and ATM), one final merge. It writes one sweep folder per
cell with a cost record per run, the combined tables, and a second call trains nothing."""

from __future__ import annotations

import importlib
import json
import statistics
from pathlib import Path

import pytest

from mima.core.errors import MimaError
from mima.core.run_folder import RunFolder
from tests.helpers import STUDY_TASKS as TASKS
from tests.helpers import final_bytes, fit_config, load_study, tiny_study_base


def _tiny_grid(study):
    cells = (study.Cell(2, "equal", "uniform", (1, 2), ("uniform", "adamerging"), joint=False),
             study.Cell(2, "equal", "atm", (1, 2), ("uniform",), joint=False))
    return study.Grid("tiny", (0,), cells, steps=4, family=TASKS, select_on_val=False)


def test_proportional_budgets_keep_the_total_and_divide_by_every_n():
    study = load_study()
    budgets = study.proportional_budgets(200, {"a": 54000, "b": 54000, "c": 1131, "d": 54000}, multiple=8)
    assert budgets == {"a": 264, "b": 264, "c": 8, "d": 264}  # 800 x 54000 / 163131 = 264.8 -> 264; c: at least 8
    assert all(value % 8 == 0 for value in budgets.values())
    assert study.proportional_budgets(100, {"a": 1, "b": 1}, multiple=4) == {"a": 100, "b": 100}


def test_cell_config_sets_the_operator_and_only_it():
    study = load_study()
    base = fit_config(Path("unused"), "local-dir:x", list(TASKS), steps=4, iterations=1)
    atm = study.cell_config(base, study.Cell(1, "equal", "atm", (1, 2), ("uniform",), False), None, TASKS)
    assert atm["data"]["tasks"] == ["rot90"] and atm["model"]["sync_merge"] == "task_arithmetic"
    assert atm["model"]["sync_merge_args"] == {"lam": 0.3} and atm["model"]["proximal_mu"] == 0.0
    fedprox = study.cell_config(atm, study.Cell(2, "equal", "fedprox", (1, 2), ("uniform",), False), 8, TASKS)
    assert fedprox["model"]["sync_merge"] == "uniform" and fedprox["model"]["sync_merge_args"] is None
    assert fedprox["model"]["proximal_mu"] == 0.01 and fedprox["model"]["steps"] == 8
    with pytest.raises(MimaError, match="only 2 tasks"):
        study.cell_config(base, study.Cell(3, "equal", "uniform", (1,), ("uniform",), False), None, TASKS)
    assert [study.cell_iterations(study.Cell(4, "equal", op, (1, 2, 4), (), False)) for op in ("atm", "fedprox")] == [
        [2, 4], [1, 2, 4]]  # ATM acts only at syncs (none at N = 1); FedProx pulls towards theta_0 at N = 1 too


def test_tiny_study_writes_its_folders_and_tables_and_resumes(tmp_path, small_clip, capsys):
    study = load_study()
    out = tmp_path / "study"
    base = tiny_study_base(small_clip)
    grid = _tiny_grid(study)
    with pytest.raises(MimaError, match="--only T3/equal/atm: not a cell of grid tiny"):
        study.run_study(base, grid, out, only=["T3/equal/atm"])
    assert study.run_study(base, grid, out, tables=True) == [] and "not done yet: T2/equal/uniform, T2/equal/atm" in (
        out / "study.md").read_text()
    # a second process's share first: the ATM cell alone, no tables; the full command then does the rest
    assert {r["operator"] for r in study.run_study(base, grid, out, only=["T2/equal/atm"])} == {"atm"}
    assert not study.cell_is_done(grid.cells[0], grid, out) and study.cell_is_done(grid.cells[1], grid, out)
    assert "not done yet: T2/equal/uniform, T2/equal/atm" in (out / "study.md").read_text()
    rows = study.run_study(base, grid, out)

    uniform, atm = out / "T2" / "equal" / "uniform", out / "T2" / "equal" / "atm"
    assert sorted(p.name for p in (uniform / "runs").iterdir()) == ["N1-seed0", "N2-seed0"]
    assert sorted(p.name for p in (atm / "runs").iterdir()) == ["N2-seed0"]  # N = 1 is uniform's
    saved = RunFolder(atm / "runs" / "N2-seed0").config_file.read_text()
    assert "task_arithmetic" in saved and "lam: 0.3" in saved

    # each run's cost: measured CPU seconds, and the plan's sync bytes computed here again from the
    # encoder's state (one task's state sent and received per other process and sync, W = T = 2)
    costs = json.loads((out / "study.json").read_text())["costs"]
    assert [(c["operator"], c["run"]) for c in costs] == [("atm", "N2-seed0"), ("uniform", "N1-seed0"), ("uniform", "N2-seed0")]
    state = RunFolder(uniform / "runs" / "N2-seed0").final("rot90")
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    for cost in costs:
        syncs = int(cost["run"][1]) - 1
        assert cost["cpu_s"] > 0 and cost["wall_s"] > 0 and cost["sync_bytes"] == 0 and cost["plan_sync_bytes"] == 0
        assert cost["plan_sync_bytes_federated"] == 2 * state_bytes * syncs
    assert len((out / "costs.md").read_text().splitlines()) == 2 + 3
    evaluations = json.loads((out / "study.json").read_text())["evaluation_costs"]
    assert sorted(evaluations) == ["T2/equal/atm", "T2/equal/uniform"] and all(e["wall_s"] > 0 for e in evaluations.values())

    # the combined table: each (cell, N, model) as the cell's own results.json has it
    for folder, operator in ((uniform, "uniform"), (atm, "atm")):
        table = json.loads((folder / "results.json").read_text())
        for row in table:
            if row["task"] != "mean" or row.get("seed") == "mean":  # one seed: no aggregate rows
                continue
            ours, = [r for r in rows if (r["operator"], r["N"], r["model"]) == (operator, row["N"], row["model"])]
            assert ours["per_seed"] == [pytest.approx(100 * row["accuracy"], abs=1e-9)]
            assert ours["accuracy"] == pytest.approx(statistics.fmean(ours["per_seed"]), abs=1e-12)
            assert ours["ci95_per_seed"] == [[pytest.approx(100 * v, abs=1e-9) for v in row["ci95"]]]
    assert {(r["operator"], r["N"]) for r in rows if r["model"] == "uniform"} == {("uniform", 1), ("uniform", 2), ("atm", 2)}
    # AdaMerging (data-dependent, outside `mima evaluate`'s table): `mima merge --models RUN`'s results, per run
    for n in (1, 2):
        merged = json.loads((uniform / "data_merges" / f"N{n}-seed0-adamerging.safetensors.results.json").read_text())
        ours, = [r for r in rows if (r["operator"], r["N"], r["model"]) == ("uniform", n, "adamerging")]
        assert ours["per_seed"] == [pytest.approx(100 * merged["test_accuracy"]["mean"], abs=1e-9)]
        assert ours["ci95_per_seed"] == [None]
    markdown = (out / "study.md").read_text()
    n2 = [r for r in rows if (r["operator"], r["N"], r["model"]) == ("atm", 2, "uniform")][0]
    assert f"| 2 | equal | atm | 2 | uniform | {n2['accuracy']:.1f} |" in markdown

    # a second call trains nothing: same final weights and cost records, every run found finished
    finals = {run: final_bytes(run) for run in out.glob("T2/equal/*/runs/*")}
    records = {path: path.read_bytes() for path in [*out.glob("T2/equal/*/runs/*/cost.json"), *out.glob("T2/equal/*/evaluation_cost.json")]}
    capsys.readouterr()
    again = study.run_study(base, grid, out)
    printed = capsys.readouterr().out
    assert "fitting" not in printed and printed.count("has finished") == 3
    assert {run: final_bytes(run) for run in finals} == finals
    assert {path: path.read_bytes() for path in records} == records
    assert again == rows
    assert study.run_study(base, grid, out, tables=True) == rows


def test_the_joint_model_is_trained_and_evaluated_at_every_seed(tmp_path, small_clip, capsys):
    """The sweep trains the joint baseline at the first seed; the study adds it at the other seeds,
    each evaluated beside that seed's N = 1 run, so the joint row has a std over seeds too."""
    study = load_study()
    out = tmp_path / "study"
    base = tiny_study_base(small_clip)
    cell = study.Cell(2, "equal", "uniform", (1,), ("uniform",), joint=True)
    grid = study.Grid("tiny-joint", (0, 1), (cell,), steps=4, family=TASKS, select_on_val=False)
    rows = study.run_study(base, grid, out)
    folder = out / "T2" / "equal" / "uniform"
    assert sorted(p.name for p in (folder / "runs").iterdir()) == ["N1-seed0", "N1-seed1", "joint", "joint-seed1"]
    assert RunFolder(folder / "runs" / "joint-seed1").is_joint() and (folder / "runs" / "joint-seed1" / "cost.json").is_file()
    joint, = [r for r in rows if r["model"] == "joint"]
    assert joint["seeds"] == [0, 1] and joint["accuracy_std"] is not None
    # each seed's value is the mean row of the evaluation that holds that seed's joint model
    table0 = json.loads((folder / "results.json").read_text())
    table1 = json.loads((folder / "joint-seed1" / "results.json").read_text())
    mean0, = {r["accuracy"] for r in table0 if r["model"] == "joint" and r["task"] == "mean" and r.get("seed") in (0, None)}
    # the sweep's own table (offline_suite.py --seeds --joint writes the same): its one joint model is one
    # value, trained at seed 0, not a mean over seeds 0 and 1 with a spread of 0
    joint_aggregate, = [r for r in table0 if (r["model"], r["task"], r.get("seed")) == ("joint", "mean", "mean")]
    assert (joint_aggregate["seeds"], joint_aggregate["accuracy_std"], joint_aggregate["accuracy"]) == ([0], None, mean0)
    mean1, = [r["accuracy"] for r in table1 if r["model"] == "joint" and r["task"] == "mean"]
    assert joint["per_seed"] == [pytest.approx(100 * mean0, abs=1e-9), pytest.approx(100 * mean1, abs=1e-9)]
    capsys.readouterr()
    again = study.run_study(base, grid, out)
    assert "fitting" not in capsys.readouterr().out and again == rows

    # the paired comparison across the two evaluations of a seed (the joint model's and the sweep's):
    # each seed's difference is that of the two mean accuracies the evaluations wrote; seed 0's
    # interval is the one `mima evaluate` wrote for the pair (the uniform merge against the joint
    # model, the sign turned); the interval over the seeds is Student t's from scipy
    from scipy import stats

    claims = json.loads((out / "claims.json").read_text())
    gap, = [c for c in claims if c["says"] == "the joint gap"]
    assert (gap["first"], gap["second"]) == ("T2 joint", "T2 MIMA N=1 + uniform")
    means = {(model, seed): r["accuracy"] for r in table0 for model in ("uniform", "joint") for seed in (0, 1)
             if (r["model"], r["task"], r.get("seed")) == (model, "mean", seed)}
    means[("joint", 1)] = mean1  # the joint model of seed 1 is evaluated in joint-seed1/ only
    for ours in gap["per_seed"]:
        seed = ours["seed"]
        assert ours["difference"] == pytest.approx(100 * (means[("joint", seed)] - means[("uniform", seed)]), abs=1e-6)
        assert ours["ci95"][0] <= ours["difference"] <= ours["ci95"][1]
    uniform0, = [r for r in table0 if (r["model"], r["task"], r.get("seed")) == ("uniform", "mean", 0)]
    paired, = [p for p in uniform0["paired"] if p["model"] == "joint"]
    assert gap["per_seed"][0]["ci95"] == [pytest.approx(-100 * paired["ci95"][1], abs=1e-9),
                                          pytest.approx(-100 * paired["ci95"][0], abs=1e-9)]
    differences = [s["difference"] for s in gap["per_seed"]]
    half = stats.t.ppf(0.975, 1) * statistics.stdev(differences) / 2 ** 0.5
    assert gap["ci95_over_seeds"] == [pytest.approx(statistics.fmean(differences) - half, abs=1e-9),
                                      pytest.approx(statistics.fmean(differences) + half, abs=1e-9)]
    assert f"| {gap['difference']:+.1f} ± {gap['difference_std']:.1f} |" in (out / "claims.md").read_text()
    from mima.services.evaluate.results import recorded_test_records

    with pytest.raises(MimaError, match="not an evaluation folder"):
        recorded_test_records(folder / "runs", folder / "runs" / "N1-seed0", "uniform")
    with pytest.raises(MimaError, match="no test cells of ties"):
        recorded_test_records(folder, folder / "runs" / "N1-seed0", "ties")


def test_the_t_quantiles_and_the_verdicts():
    from scipy import stats

    load_study()  # puts benchmarks/ on the path
    claims = importlib.import_module("study_claims")
    assert claims.T975 == {df: pytest.approx(stats.t.ppf(0.975, df), abs=1e-12) for df in range(1, 11)}
    assert [claims.t975(df) for df in range(11, 60)] == [pytest.approx(stats.t.ppf(0.975, df), abs=1e-5) for df in range(11, 60)]
    assert claims.verdict([(0.1, 0.5), (0.2, 0.9)], (0.05, 0.8)) == "first higher at 95 % (seeds and every seed)"
    assert claims.verdict([(-0.1, 0.5), (0.2, 0.9)], (0.05, 0.8)) == "first higher at 95 % (seeds)"
    assert claims.verdict([(-0.5, -0.1), (-0.9, -0.2)], (-1.0, 0.3)) == "second higher at 95 % (every seed)"
    assert claims.verdict([(-0.5, 0.1)], None) == "not distinguishable"
