"""benchmarks/study.py's gap grid (issue 50) on a tiny grid: the small CLIP on two digits tasks, one seed,
S = 4, the uniform sync (with the joint model) and outer Nesterov at N = 2 and 4, ATM at N = 2, two final
merges; outer Nesterov's lr and momentum chosen on validation first. It writes the gap report and figure,
a second call trains nothing, and a second study reusing the first trains nothing either."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from mima.core.run_folder import RunFolder
from mima.pools import task_pool
from tests.helpers import STUDY_TASKS as TASKS
from tests.helpers import final_bytes, load_study, tiny_study_base

CANDIDATES = ((0.7, 0.9), (1.0, 0.5))


def _tiny_gap_grid(study):
    merges = ("uniform", "task_arithmetic")
    cells = (study.Cell(2, "equal", "uniform", (2, 4), merges, joint=True),
             study.Cell(2, "equal", "outer_nesterov", (2, 4), merges, joint=False),
             study.Cell(2, "equal", "atm", (2,), merges, joint=False))
    return study.Grid("tiny-gap", (0,), cells, steps=4, family=TASKS, select_on_val=False,
                      outer_choice=study.OuterChoice(2, 2, 0, CANDIDATES), joint_gap=True)


def _uniform_validation_accuracy(run: Path) -> float:
    """The uniform merge's mean validation accuracy, the merge taken here by hand."""
    folder = RunFolder(run)
    finals = [folder.final(task) for task in TASKS]
    average = {key: sum(state[key] for state in finals) / len(finals) for key in finals[0]}
    return task_pool(folder).evaluator("val").mean_accuracy(average)


def test_the_gap_grid_chooses_outer_nesterov_reports_the_gap_and_reuses_runs(tmp_path, small_clip, capsys):
    study = load_study()
    out = tmp_path / "gap"
    base = tiny_study_base(small_clip)
    grid = _tiny_gap_grid(study)
    rows = study.run_study(base, grid, out)

    # outer Nesterov's choice: each candidate's score is its uniform merge on the validation splits,
    # the best one (the first on ties) is taken, and every outer_nesterov run was trained with it
    choice = json.loads((out / "T2" / "equal" / "outer_nesterov-choice" / "choice.json").read_text())
    scores = [c["uniform_validation_accuracy"] for c in choice["scores"]]
    for (lr, momentum), score in zip(CANDIDATES, scores):
        run = out / "T2" / "equal" / "outer_nesterov-choice" / "runs" / f"lr{lr:g}-momentum{momentum:g}"
        assert score == pytest.approx(_uniform_validation_accuracy(run), abs=1e-6)
    lr, momentum = CANDIDATES[scores.index(max(scores))]
    assert choice["chosen"] == {"outer_lr": lr, "outer_momentum": momentum}
    for n in (2, 4):
        saved = RunFolder(out / "T2" / "equal" / "outer_nesterov" / "runs" / f"N{n}-seed0").config_file.read_text()
        assert "outer_nesterov" in saved and f"outer_lr: {lr}" in saved and f"outer_momentum: {momentum}" in saved
    # the outer cell's run at the choice's N and seed is the chosen candidate's run, copied, not fitted again
    chosen_run = out / "T2" / "equal" / "outer_nesterov-choice" / "runs" / f"lr{lr:g}-momentum{momentum:g}"
    twin = out / "T2" / "equal" / "outer_nesterov" / "runs" / "N2-seed0"
    assert final_bytes(twin) == final_bytes(chosen_run)
    assert json.loads((twin / "cost.json").read_text())["reused_from"] == str(chosen_run)

    # the gap: the joint model's mean test accuracy minus the merge's, as the cells' results.json have them
    report = json.loads((out / "gap.json").read_text())
    assert report["pending"] == []
    assert {(g["operator"], g["N"], g["merge"]) for g in report["rows"]} == {
        (operator, n, merge) for operator, ns in (("uniform", (2, 4)), ("outer_nesterov", (2, 4)), ("atm", (2,)))
        for n in ns for merge in ("uniform", "task_arithmetic")}
    joint_table = json.loads((out / "T2" / "equal" / "uniform" / "results.json").read_text())
    joint_mean, = {r["accuracy"] for r in joint_table if (r["model"], r["task"]) == ("joint", "mean")}
    costs = json.loads((out / "study.json").read_text())["costs"]
    for gap in report["rows"]:
        table = json.loads((out / "T2" / "equal" / gap["operator"] / "results.json").read_text())
        merged, = [r["accuracy"] for r in table if (r["model"], r["task"], r["N"]) == (gap["merge"], "mean", gap["N"])]
        assert gap["gap"] == pytest.approx(100 * (joint_mean - merged), abs=1e-6)
        low, high = gap["per_seed"][0]["ci95"]  # one seed: its interval decides
        assert gap["ci95_over_seeds"] is None
        assert gap["standing"] == ("below" if low > 0 else "above" if high < 0 else "level")
        cost, = [c for c in costs if (c["operator"], c["run"]) == (gap["operator"], f"N{gap['N']}-seed0")]
        assert gap["syncs"] == gap["N"] - 1 == cost["plan_syncs"] and gap["cpu_s_per_fit"] == cost["cpu_s"] > 0
    # W = T = 2: each process sends and receives one task's state per sync, so the bytes grow with the syncs
    bytes_at = {g["N"]: g["federated_bytes_per_process"] for g in report["rows"] if g["operator"] == "uniform"}
    assert bytes_at[4] == 3 * bytes_at[2] > 0
    for smallest in report["smallest_reaching"]:
        reaching = sorted(g["N"] for g in report["rows"] if g["standing"] in ("level", "above") and
                          (g["operator"], g["merge"]) == (smallest["operator"], smallest["merge"]))
        assert smallest["N"] == (reaching[0] if reaching else None)
    markdown = (out / "gap.md").read_text()
    assert "## T = 2" in markdown
    assert "Runs copied, not trained again (from an earlier study or the outer choice): T2/equal/outer_nesterov/N2-seed0." in markdown
    assert (out / "joint_gap_vs_syncs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a second call trains and chooses nothing
    capsys.readouterr()
    assert study.run_study(base, grid, out) == rows
    assert "fitting" not in capsys.readouterr().out

    # a second study reusing the first: every run copied (cost.json says from where), nothing trained,
    # the same final models and the same report; a run trained with other settings is not reused
    again = tmp_path / "again"
    assert study.run_study(base, grid, again, earlier=out) == rows
    printed = capsys.readouterr().out
    assert "fitting" not in printed and printed.count("study: reusing") == 8  # 2 N + joint, 2 choices, 2 N, 1 N
    for run in out.glob("T2/equal/*/runs/*"):
        copied = again / run.relative_to(out)
        assert final_bytes(copied) == final_bytes(run)
        assert json.loads((copied / "cost.json").read_text())["reused_from"] == str(run)
    reported = json.loads((again / "gap.json").read_text())
    assert reported["rows"] == [{**g, "reused": [f"N{g['N']}-seed0"]} for g in report["rows"]]
    assert len(reported["reused"]) == 8 and "T2/equal/uniform/joint" in reported["reused"]
    other = {**base, "model": {**base["model"], "lr": 2e-3}}
    run_config = study.fit_run_config(study.cell_config(other, grid.cells[0], 4, TASKS), {"iterations": 2}, 0,
                                      tmp_path / "third" / "T2" / "equal" / "uniform" / "runs" / "N2-seed0", False)
    assert not study.same_training(out / "T2" / "equal" / "uniform" / "runs" / "N2-seed0", run_config)
    same = study.fit_run_config(study.cell_config(base, grid.cells[0], 4, TASKS), {"iterations": 2}, 0, tmp_path / "x", False)
    assert study.same_training(out / "T2" / "equal" / "uniform" / "runs" / "N2-seed0", same)
    other_precision = {**same, "trainer": {**same["trainer"], "precision": "bf16-true"}}  # the weights differ
    assert not study.same_training(out / "T2" / "equal" / "uniform" / "runs" / "N2-seed0", other_precision)
    assert not study.reuse_earlier_run([out / "T2" / "equal" / "uniform" / "runs" / "N2-seed0"], Path(run_config["out"]), run_config)
    assert "not reusing" in capsys.readouterr().out and not Path(run_config["out"]).exists()


def test_the_standing_against_the_joint_model_over_several_seeds():
    """The standing from made-up claims (joint minus merge): the Student t interval over the seeds and
    each seed's interval, by the rule study_gap's docstring states."""
    load_study()  # puts benchmarks/ on the path
    gap = importlib.import_module("study_gap").standing

    def claim(over, *seeds):
        return {"ci95_over_seeds": over, "per_seed": [{"ci95": list(seed)} for seed in seeds]}

    assert gap(claim([-0.5, 1.0], (-1, 1), (-0.2, 0.9), (-2, 0.1))) == "level"
    assert gap(claim([-0.5, 1.0], (-1, 1), (0.2, 0.9), (-2, 0.1))) == "below"  # one seed's interval excludes 0
    assert gap(claim([0.3, 1.0], (-1, 1), (-0.2, 0.9), (-2, 0.1))) == "below"  # the seeds' interval does
    assert gap(claim([-2.0, -0.1], (-1, 1), (-0.2, 0.9), (-2, 0.1))) == "above"  # the merge higher over the seeds
    assert gap(claim([-0.5, 1.0], (-1, -0.1), (0.2, 0.9), (-2, 0.1))) == "mixed"
    assert gap(claim(None, (-0.3, 0.2))) == "level" and gap(claim(None, (0.1, 0.2))) == "below"


def test_a_run_stopped_and_resumed_counts_the_seconds_of_both_attempts(tmp_path, small_clip):
    """A study run stopped mid-fit (RUN/STOP at its step 3) keeps that attempt's seconds in
    cost.partial.json; the attempt that finishes adds them into cost.json, which says it is whole."""
    study = load_study()
    base = tiny_study_base(small_clip)
    base["trainer"]["callbacks"] = [{"class_path": "tests.helpers.TouchStopAtStep", "init_args": {"step": 3}}]
    cell = study.Cell(2, "equal", "uniform", (2,), ("uniform",), joint=False)
    grid = study.Grid("tiny-stop", (0,), (cell,), steps=4, family=TASKS, select_on_val=False)
    out = tmp_path / "study"
    with pytest.raises(SystemExit):
        study.run_study(base, grid, out)
    run = out / "T2" / "equal" / "uniform" / "runs" / "N2-seed0"
    partial = json.loads((run / "cost.partial.json").read_text())
    assert partial["attempts"] == 1 and partial["cpu_s"] > 0 and not (run / "cost.json").exists()
    study.run_study(base, grid, out)  # the stop at step 3 lies behind the resumed run
    cost = json.loads((run / "cost.json").read_text())
    assert cost["resumed"] and cost["cpu_complete"] and not (run / "cost.partial.json").exists()
    assert cost["cpu_s"] > partial["cpu_s"] and cost["wall_s"] > partial["wall_s"]


def test_a_run_that_diverges_is_recorded_and_reported_as_diverged(tmp_path, small_clip):
    """N = 4 diverges at its process step 2 (tests.helpers.PoisonAtStep): its cost.json says so, the study
    goes on, and the gap report shows that N as diverged (no gap; it does not reach the joint model)."""
    study = load_study()
    base = tiny_study_base(small_clip)
    base["trainer"]["callbacks"] = [{"class_path": "tests.helpers.PoisonAtStep", "init_args": {"step": 2, "iterations": 4}}]
    cell = study.Cell(2, "equal", "uniform", (2, 4), ("uniform",), joint=True)
    grid = study.Grid("tiny-diverged", (0,), (cell,), steps=4, family=TASKS, select_on_val=False, joint_gap=True)
    out = tmp_path / "study"
    study.run_study(base, grid, out)
    run = out / "T2" / "equal" / "uniform" / "runs" / "N4-seed0"
    report = RunFolder(run).divergence()
    cost = json.loads((run / "cost.json").read_text())
    # K = 1: each phase takes one step of each task in turn, so process step 2 is the first task's
    assert report == cost["diverged"] == f"task {TASKS[0]} diverged: loss nan at process step 2" and cost["cpu_s"] > 0
    gap = json.loads((out / "gap.json").read_text())
    rows = {(row["N"], row["merge"]): row for row in gap["rows"]}
    assert set(rows) == {(2, "uniform"), (4, "uniform")} and gap["pending"] == []
    lost = rows[(4, "uniform")]
    assert lost["standing"] == "diverged" and lost["gap"] is None and lost["cpu_fits"] == 0
    assert lost["verdict"] == f"not compared: T2 MIMA N=4 + uniform, seed 0: {report}"
    kept = rows[(2, "uniform")]
    assert kept["gap"] is not None and kept["standing"] in ("level", "below", "above")
    smallest, = gap["smallest_reaching"]
    assert smallest["N"] == (2 if kept["standing"] in ("level", "above") else None)
    assert smallest["every_larger_N"] in (None, False)  # N = 4 never reaches the joint model
    claims = (out / "claims.md").read_text()
    assert f"Not compared, a run diverged: T2 MIMA N=4 + uniform vs T2 MIMA N=2 + uniform (T2 MIMA N=4 + uniform, seed 0: {report})." in claims
    assert "| diverged |" in (out / "gap.md").read_text()
    assert (out / "joint_gap_vs_syncs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_diverged_runs_are_named_once_per_side_and_report_with_their_seeds(tmp_path):
    """Two seeds that diverged at the same step are one entry with their seeds (the gap table's
    verdict stays one line); a seed with another report is its own entry; a run that did not diverge
    is not named."""
    load_study()
    from study_claims import Claim, Side, diverged_sides

    out = tmp_path / "study"
    claim = Claim(Side("T8/equal/uniform", "joint"), Side("T8/equal/atm", "uniform", 40), "the joint gap")
    reports = {0: "task mnist diverged: loss nan at process step 1561", 1: None,
               2: "task mnist diverged: loss nan at process step 1561", 3: "task digits diverged: weight inf at process step 9"}
    for seed, report in reports.items():
        run = RunFolder(out / "T8" / "equal" / "atm" / "runs" / f"N40-seed{seed}")
        run.path.mkdir(parents=True)
        if report is not None:
            run.write_divergence(report)
    assert diverged_sides(claim, out, [0, 1, 2, 3]) == [
        f"T8 atm N=40 + uniform, seeds 0, 2: {reports[0]}", f"T8 atm N=40 + uniform, seed 3: {reports[3]}"]
    assert diverged_sides(claim, out, [1]) == []
