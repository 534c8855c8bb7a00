"""Sweeps over seeds (mima.commands.sweep.run_sweep's `seeds`, benchmarks/offline_suite.py --seeds):
one run folder per (N, seed) with seed_everything and data.seed set, the table's mean ± std over
seeds checked against the per-seed rows, and a stopped sweep resumed seed by seed."""

from __future__ import annotations

import importlib.util
import json
import shutil
import statistics
from pathlib import Path

import pytest
import yaml

from mima.commands.sweep import check_seeds, run_settings, run_sweep
from mima.core.errors import MimaError
from mima.core.run_folder import SweepFolder
from tests.helpers import fit_config

ROOT = Path(__file__).resolve().parents[2]
TASKS = ["rot90", "mirror"]


def test_run_settings_name_one_folder_per_n_and_seed(tmp_path):
    sweep = SweepFolder(tmp_path)
    plain = run_settings(sweep, [1, 2], None, joint=True)
    assert [(setting, seed, folder.path.name) for setting, seed, folder, _ in plain] == [
        ({"iterations": 1}, None, "N1"), ({"iterations": 2}, None, "N2"), ({"mode": "joint", "iterations": 1}, None, "joint")]
    seeded = run_settings(sweep, [1, 4], [3, 0], joint=True)
    assert [(seed, folder.path.name) for _, seed, folder, _ in seeded] == [
        (3, "N1-seed3"), (3, "N4-seed3"), (0, "N1-seed0"), (0, "N4-seed0"), (3, "joint")]  # the joint run: first seed
    assert all(folder.path.parent == tmp_path / "runs" for _, _, folder, _ in seeded)


@pytest.mark.parametrize("seeds, message", [([], "give at least one seed"), ([1, 2, 1], "seed 1 is given more than once"),
                                            ([0, -3], "seed -3 is negative")])
def test_seed_mistakes_are_one_line(seeds, message):
    with pytest.raises(MimaError, match=message):
        check_seeds(seeds)
    check_seeds(None)
    check_seeds([0, 1, 2])


def _rows(folder: Path) -> list[dict]:
    return json.loads((folder / "results.json").read_text())


def _final_files(run: Path) -> dict[str, tuple[int, bytes]]:
    return {path.name: (path.stat().st_mtime_ns, path.read_bytes()) for path in sorted((run / "final").iterdir())}


def test_two_seeds_two_runs_mean_and_std_over_them_and_resume_per_seed(tmp_path, small_clip, capsys):
    out = tmp_path / "sweep"
    config = fit_config(out, small_clip, TASKS, steps=4, iterations=1)
    config.pop("out")

    def sweep() -> None:
        run_sweep(config, out, iterations=[2], merges=["uniform"], select_on_val=False, progress=False, seeds=[0, 1])

    sweep()
    runs = {seed: out / "runs" / f"N2-seed{seed}" for seed in (0, 1)}
    assert sorted(path.name for path in (out / "runs").iterdir()) == ["N2-seed0", "N2-seed1"]
    for seed, run in runs.items():
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert saved["seed_everything"] == seed and saved["data"]["seed"] == seed
        assert saved["model"]["iterations"] == 2
    first = _final_files(runs[0])
    assert first["rot90.safetensors"][1] != _final_files(runs[1])["rot90.safetensors"][1]  # the seeds trained differently

    # results.json: each seed's rows, then the mean and sample std over the seeds, computed here again
    rows = _rows(out)
    per_seed = {(row["model"], row["task"], row["seed"]): row["accuracy"] for row in rows if row["seed"] != "mean"}
    aggregates = [row for row in rows if row["seed"] == "mean"]
    assert {seed for _, _, seed in per_seed} == {0, 1}
    assert {(row["model"], row["task"]) for row in aggregates} == {(m, t) for m, t, _ in per_seed}
    for row in aggregates:
        values = [per_seed[(row["model"], row["task"], seed)] for seed in (0, 1)]
        if row["model"] == "zero_shot":  # theta_0, evaluated once with seed 0's run: one value, no spread
            assert values[0] == values[1] and row["seeds"] == [0] and row["accuracy_std"] is None
            assert row["accuracy"] == values[0]
            continue
        assert row["seeds"] == [0, 1]
        assert row["accuracy"] == pytest.approx(statistics.fmean(values), abs=1e-12)
        assert row["accuracy_std"] == pytest.approx(statistics.stdev(values), abs=1e-12)
    assert {row["measured_at"] for row in rows if row["seed"] != "mean" and row["model"] == "zero_shot"} == {0}
    assert not any("measured_at" in row for row in rows if row["model"] != "zero_shot")
    # the mean over tasks of one seed is the mean of its tasks' accuracies
    for seed in (0, 1):
        assert per_seed[("uniform", "mean", seed)] == pytest.approx(
            statistics.fmean(per_seed[("uniform", task, seed)] for task in TASKS), abs=1e-12)
    uniform = [per_seed[("uniform", "mean", seed)] for seed in (0, 1)]
    cell = f"{100 * statistics.fmean(uniform):.1f} ± {100 * statistics.stdev(uniform):.1f}"
    markdown = (out / "results.md").read_text()
    assert any(line.startswith(f"| uniform | {cell}") for line in markdown.splitlines())  # the summary's N=2 cell
    assert json.loads((out / "selection.json").read_text())["seeds"] == [0, 1]

    # A stop after seed 0 (seed 1's run and the table not yet written): the same command trains seed 1
    # only, keeps seed 0's finished run as it is, and writes the same table.
    before = (out / "results.json").read_bytes()
    second = _final_files(runs[1])
    for name in SweepFolder.RESULT_FILES:
        (out / name).unlink()
    shutil.rmtree(runs[1])
    capsys.readouterr()
    sweep()
    printed = capsys.readouterr().out
    assert f"{runs[0]} has finished" in printed and f"{runs[1]} has finished" not in printed
    assert _final_files(runs[0]) == first  # not trained again: same bytes, same modification times
    assert {name: data for name, (_, data) in _final_files(runs[1]).items()} == {
        name: data for name, (_, data) in second.items()}  # seed 1 again, bit for bit
    assert _rows(out) == json.loads(before)

    # The finished sweep run again (as with one more seed): its own table is replaced, nothing retrained.
    capsys.readouterr()
    sweep()
    assert "has finished" in capsys.readouterr().out
    assert _final_files(runs[0]) == first and _rows(out) == json.loads(before)
    # ... but a table that is not a sweep over seeds is refused, as before
    selection = json.loads((out / "selection.json").read_text())
    del selection["seeds"]
    (out / "selection.json").write_text(json.dumps(selection))
    with pytest.raises(MimaError, match="results.json"):
        sweep()


def test_a_run_that_diverges_is_left_out_and_the_sweep_goes_on(tmp_path, small_clip, capsys):
    """N = 2 diverges at its process step 2 (tests.helpers.PoisonAtStep); N = 1 is fitted and evaluated,
    the table names the run left out, and the sweep called again does not fit it again."""
    out = tmp_path / "sweep"
    config = fit_config(out, small_clip, TASKS, steps=4, iterations=1)
    config.pop("out")
    config["trainer"]["callbacks"] = [{"class_path": "tests.helpers.PoisonAtStep", "init_args": {"step": 2, "iterations": 2}}]

    def sweep(iterations=(1, 2)):
        return run_sweep(config, out, iterations=list(iterations), merges=["uniform"], select_on_val=False,
                         progress=False, seeds=[0])

    assert {result.N for result in sweep()} == {1}
    run = out / "runs" / "N2-seed0"
    report = json.loads((run / "diverged.json").read_text())["report"]
    assert report == "task mirror diverged: loss nan at process step 2"  # K = 2: rot90 takes steps 0-1, mirror 2-3
    assert not (run / "final").exists() and (out / "runs" / "N1-seed0" / "final").is_dir()
    assert f"N=2, seed 0 diverged ({report}); left out" in capsys.readouterr().out
    assert json.loads((out / "selection.json").read_text())["diverged"] == {"runs/N2-seed0": report}
    assert f"Left out, diverged (no final models): runs/N2-seed0: {report}." in (out / "results.md").read_text().splitlines()
    assert {row["N"] for row in _rows(out)} == {1}
    before = _rows(out)
    sweep()  # again: the diverged run is not fitted again (a resume would repeat it), the same table
    assert "N=2, seed 0 diverged in an earlier call" in capsys.readouterr().out
    assert _rows(out) == before
    with pytest.raises(MimaError, match=r"every MIMA run of the sweep diverged \(task mirror diverged: loss nan"):
        sweep(iterations=(2,))


def _offline_suite():
    spec = importlib.util.spec_from_file_location("offline_suite", ROOT / "benchmarks" / "offline_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_offline_suite_passes_its_seeds_and_merges_config_files(tmp_path, monkeypatch):
    """--seeds reaches the sweep; several --config files are read as `mima fit --config A --config B`."""
    suite = _offline_suite()
    calls = []
    monkeypatch.setattr(suite, "run_sweep", lambda config, out, **options: calls.append((config, out, options)))
    base, family = ROOT / "configs" / "offline.yaml", ROOT / "configs" / "offline" / "t8.yaml"
    assert suite.main(["--config", str(base), str(family), "--seeds", "0", "1", "2", "--out", str(tmp_path),
                       "--merges", "uniform"]) == 0
    (config, out, options), = calls
    assert options["seeds"] == [0, 1, 2] and out == tmp_path
    assert options["extra"]["config"] == f"{base} + {family}"
    original = yaml.safe_load(base.read_text())
    assert config["data"]["tasks"] == yaml.safe_load(family.read_text())["data"]["tasks"]
    assert config["model"]["steps"] == original["model"]["steps"] and config["data"]["batch_size"] == original["data"]["batch_size"]
    calls.clear()
    assert suite.main(["--out", str(tmp_path), "--merges", "uniform"]) == 0  # no --seeds: the sweep as before
    assert calls[0][2]["seeds"] is None and calls[0][2]["extra"]["config"] == str(base)
    assert calls[0][0]["data"]["tasks"] == original["data"]["tasks"]


def test_offline_suite_refuses_repeated_seeds_in_one_line(tmp_path, capsys):
    suite = _offline_suite()
    assert suite.main(["--seeds", "1", "1", "--out", str(tmp_path / "x"), "--merges", "uniform", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == "offline_suite: error: --seeds: seed 1 is given more than once (one run per N and seed)"
    assert not (tmp_path / "x").exists()


def test_demo_passes_its_seeds_to_the_sweep(tmp_path, monkeypatch, capsys):
    """`mima demo --seeds`: one run per N and seed through the same sweep; repeated seeds are one line."""
    from mima.cli import main
    from mima.commands.demo import run as demo_run

    calls = []
    monkeypatch.setattr(demo_run, "run_sweep", lambda config, out, **options: calls.append((out, options)) or [])
    assert main(["demo", "--seeds", "0", "1", "2", "--iterations", "1", "8", "--out", str(tmp_path / "d"), "--no-progress"]) in (0, None)
    (out, options), = calls
    assert options["seeds"] == [0, 1, 2] and options["iterations"] == [1, 8] and out == tmp_path / "d"
    calls.clear()
    assert main(["demo", "--out", str(tmp_path / "e"), "--no-progress"]) in (0, None)
    assert calls[0][1]["seeds"] is None  # no --seeds: one run per N, as before
    assert main(["demo", "--seeds", "1", "1", "--out", str(tmp_path / "x")]) == 2
    assert "--seeds: seed 1 is given more than once" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
