"""`mima analyze cosine`: the logged per-phase cosine matrices, checked against cosines computed by hand
from the saved checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mima.analysis.cosine.command import analyse
from mima.analysis.cosine.compute import heatmap_phases, off_diagonal
from mima.cli import main
from mima.models.clip import load_clip
from mima.core.run_folder import RunFolder
from mima.commands.fit.run import run_fit
from tests.helpers import fit_config

TASKS = ["rot90", "rot180", "mirror"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, small_clip):
    """A sweep folder like `mima demo` writes: runs/N1 and runs/N2 of the same three tasks."""
    folder = tmp_path_factory.mktemp("cosine-sweep")
    for n in (1, 2):
        run_fit(fit_config(folder / "runs" / f"N{n}", small_clip, TASKS, steps=4, iterations=n))
    return folder


def _hand_cosines(run_dir, clip: str) -> np.ndarray:
    """cos(tau_i, tau_j) over the encoder's trainable parameters, from flattened numpy vectors."""
    trainable = [name for name, p in load_clip(clip).encoder.named_parameters() if p.requires_grad]
    run = RunFolder(run_dir)
    base = run.pretrained()
    taus = []
    for task in TASKS:
        final = run.final(task)
        taus.append(np.concatenate([(final[k].double() - base[k].double()).numpy().ravel() for k in trainable]))
    matrix = np.array([[a @ b / np.linalg.norm(a) / np.linalg.norm(b) for b in taus] for a in taus])
    return matrix


def test_final_phase_matrices_match_the_checkpoints(sweep, small_clip, tmp_path):
    result = analyse([sweep], out=tmp_path / "out")
    by_n = {entry["N"]: entry for entry in result["runs"]}
    assert sorted(by_n) == [1, 2] and [len(by_n[n]["phases"]) for n in (1, 2)] == [1, 2]
    for n in (1, 2):
        expected = _hand_cosines(sweep / "runs" / f"N{n}", small_clip)
        logged = np.array(by_n[n]["phases"][-1]["cos_tau"])
        np.testing.assert_allclose(logged, expected, atol=1e-6)
        assert by_n[n]["phases"][-1]["mean_cos_tau"] == pytest.approx(expected[np.triu_indices(3, 1)].mean(), abs=1e-6)
    # In the first phase every task starts from theta_0, so delta = tau.
    for n in (1, 2):
        first = by_n[n]["phases"][0]
        np.testing.assert_allclose(first["cos_delta"], first["cos_tau"], atol=1e-12)
    # Phase 2 starts from the average, so its updates differ from the task vectors.
    assert not np.allclose(by_n[2]["phases"][1]["cos_delta"], by_n[2]["phases"][1]["cos_tau"], atol=1e-3)
    written = json.loads((tmp_path / "out" / "cosine.json").read_text())
    assert written["tasks"] == TASKS
    for name in ("cosine_phases.png", "cosine_vs_N.png", "cosine_heatmaps_N1.png", "cosine_heatmaps_N2.png"):
        assert (tmp_path / "out" / name).stat().st_size > 10_000


def test_off_diagonal_and_phase_choice():
    matrix = np.array([[1.0, 0.2, 0.3], [0.2, 1.0, -0.4], [0.3, -0.4, 1.0]])
    assert off_diagonal(matrix).tolist() == [0.2, 0.3, -0.4]
    assert heatmap_phases(4) == [0, 1, 2, 3]
    chosen = heatmap_phases(20, most=6)
    assert chosen[0] == 0 and chosen[-1] == 19 and len(chosen) == 6 and chosen == sorted(set(chosen))


def test_cli_default_folder_and_clear_errors(sweep, tmp_path, capsys):
    run = sweep / "runs" / "N2"
    assert main(["analyze", "cosine", str(run)]) == 0
    assert (run / "analysis" / "cosine" / "cosine_heatmaps_N2.png").is_file()
    assert "mean cos(tau) per phase" in capsys.readouterr().out
    assert main(["analyze", "cosine", str(run)]) == 2  # outputs exist, no --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert main(["analyze", "cosine", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(tmp_path) in err and "run folder" in err and len(err.splitlines()) == 1
    assert main(["analyze", "cosine", str(sweep / "runs" / "N1"), str(run)]) == 2
    assert "--out" in capsys.readouterr().err


def test_a_failed_analysis_leaves_the_earlier_outputs_as_they_were(sweep, tmp_path, monkeypatch, capsys):
    """Issue 26: `mima analyze` writes its files into a temporary folder and moves them into place at the
    end; one that fails half-way (a plot after another was written) leaves --out as it was."""
    import mima.analysis.cosine.plot as plots
    from tests.helpers import unchanged

    out = tmp_path / "out"
    run = sweep / "runs" / "N2"
    assert main(["analyze", "cosine", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"Wrote {out} in" in printed and ".tmp" not in printed  # the message names --out, not the temporary folder
    assert (out / "cosine.json").is_file() and not list(tmp_path.glob(".*"))

    def changed_heatmaps(run_cosines, path):
        path.write_bytes(b"a half-written set")

    def failing(*args, **kwargs):
        raise RuntimeError("a plot failed")

    monkeypatch.setattr(plots, "plot_heatmaps", changed_heatmaps)
    monkeypatch.setattr(plots, "plot_phase_boxes", failing)
    with unchanged(tmp_path):
        with pytest.raises(RuntimeError, match="a plot failed"):
            main(["analyze", "cosine", str(run), "--out", str(out), "--overwrite"])
