"""`mima report`: the page of a sweep and of a run, checked against the result files it is built from."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from mima.cli import main
from mima.services.evaluate.runs import evaluate_runs

TASKS = ["rot90", "mirror"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, two_runs):
    """A sweep folder: copies of the shared runs in runs/ (the reports write into their folders), evaluated."""
    folder = tmp_path_factory.mktemp("report-sweep")
    runs = [shutil.copytree(run, folder / "runs" / run.name) for run in two_runs]
    evaluate_runs(runs, folder, ["uniform", "task_arithmetic"], select_on_val=False)
    return folder


def _images(markdown: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)


def test_sweep_report_tables_images_and_links(sweep, capsys):
    assert main(["report", str(sweep)]) == 0
    markdown = (sweep / "report.md").read_text()
    # the table's numbers: test_report_tables_of_a_results_file_written_by_hand
    assert "| model | N=1 | N=2 |" in markdown
    images = _images(markdown)
    assert "merged_accuracy_vs_N.png" in images and "analysis/cosine/cosine_phases.png" in images
    assert all((sweep / image).is_file() for image in images)
    links = re.findall(r"(?<!!)\[[^\]]+\]\(([^)]+\.safetensors)\)", markdown)
    assert len(links) == 2 * (1 + len(TASKS)) and all((sweep / link).is_file() for link in links)
    page = (sweep / "report.html").read_text()
    assert page.count("<img src='data:image/png;base64,") == len(images)  # self-contained: every plot embedded
    assert "<td>task_arithmetic</td>" in page
    assert main(["report", str(sweep)]) == 2  # an earlier report is kept unless --overwrite
    assert "--overwrite" in capsys.readouterr().err


# A results.json written here, with numbers chosen so that every cell is known by hand (accuracies in
# [0, 1]; the "mean" rows are what `mima evaluate` writes beside the per-task rows).
HAND_ACCURACIES = {  # (N, model) -> (rot90, mirror)
    (1, "zero_shot"): (0.5, 0.3), (1, "fine_tuned"): (0.9, 0.8), (1, "uniform"): (0.72, 0.6), (1, "task_arithmetic"): (0.81, 0.64),
    (2, "zero_shot"): (0.5, 0.3), (2, "fine_tuned"): (0.96, 0.9), (2, "uniform"): (0.864, 0.72), (2, "task_arithmetic"): (0.912, 0.81),
}
HAND_COSINES = {1: 0.123, 2: 0.456}  # mean cos(tau) of each N's fine-tuned task models


def test_report_tables_of_a_results_file_written_by_hand(tmp_path):
    rows = []
    for (n, model), (rot90, mirror) in HAND_ACCURACIES.items():
        cos = HAND_COSINES[n] if model == "fine_tuned" else None
        for task, accuracy in (("rot90", rot90), ("mirror", mirror), ("mean", (rot90 + mirror) / 2)):
            rows.append({"N": n, "model": model, "task": task, "accuracy": accuracy, "mean_cos_tau": cos})
    (tmp_path / "results.json").write_text(json.dumps(rows))
    (tmp_path / "selection.json").write_text(json.dumps({"selection": [
        {"N": n, "model": "task_arithmetic", "hparams": {"lam": lam}} for n, lam in ((1, 0.3), (2, 0.5))]}))
    assert main(["report", str(tmp_path)]) == 0
    lines = (tmp_path / "report.md").read_text().splitlines()
    # summary: the mean over the two tasks in %, per N; then mean cos(tau)
    for row in ("| zero_shot | 40.0 | 40.0 |", "| fine_tuned | 85.0 | 93.0 |", "| uniform | 66.0 | 79.2 |",
                "| task_arithmetic | 72.5 | 86.1 |", "| mean cos(tau) | 0.123 | 0.456 |"):
        assert row in lines, row
    # per N: abs. acc, rel. acc (mean over tasks of merged / fine-tuned), gap (fine-tuned minus merged, points),
    # the two tasks, the chosen hyperparameters. N = 1, uniform: (72/90 + 60/80) / 2 = 77.5 %, 85.0 - 66.0 = 19.0
    n1 = lines[lines.index("**N = 1**"):lines.index("**N = 2**")]
    n2 = lines[lines.index("**N = 2**"):]
    assert "| model | abs. acc (%) | rel. acc (%) | gap (pts) | rot90 (%) | mirror (%) | chosen |" in n1
    for row in ("| fine_tuned | 85.0 | 100.0 | 0.0 | 90.0 | 80.0 |  |", "| uniform | 66.0 | 77.5 | 19.0 | 72.0 | 60.0 |  |",
                "| task_arithmetic | 72.5 | 85.0 | 12.5 | 81.0 | 64.0 | lam=0.3 |", "| zero_shot | 40.0 | 46.5 | 45.0 | 50.0 | 30.0 |  |"):
        assert row in n1, row
    # N = 2, task_arithmetic: (91.2/96 + 81/90) / 2 = 92.5 %, 93.0 - 86.1 = 6.9
    for row in ("| uniform | 79.2 | 85.0 | 13.8 | 86.4 | 72.0 |  |", "| task_arithmetic | 86.1 | 92.5 | 6.9 | 91.2 | 81.0 | lam=0.5 |"):
        assert row in n2, row
    page = (tmp_path / "report.html").read_text()
    assert "<td>task_arithmetic</td><td>86.1</td><td>92.5</td><td>6.9</td>" in "".join(page.split())


def test_run_report_lists_the_phases(sweep, tmp_path, capsys):
    run = sweep / "runs" / "N2"
    capsys.readouterr()
    assert main(["report", str(run), "--out", str(tmp_path / "page")]) == 0
    said = capsys.readouterr().out
    # it names where the page is, never the staging folder the cosine analysis is computed in first
    assert said.strip().splitlines() == [line for line in said.strip().splitlines() if ".tmp" not in line]
    assert f"wrote {tmp_path / 'page' / 'report.md'}" in said
    markdown = (tmp_path / "page" / "report.md").read_text()
    assert "(weights of the folder)" in markdown and "pretrained: openai" not in markdown  # a local-dir: model
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        assert f"| {record['phase']} | {record['step']} | {record['mean_cos_tau']:.3f} | {record['mean_cos_delta']:.3f} |" in markdown
    assert "mima evaluate RUN --out RUN/evaluation" in markdown  # no evaluation yet: the page says how to add it
    for image in _images(markdown):  # links are relative to the page, wherever --out puts it
        assert (tmp_path / "page" / image).resolve().is_file()


def test_report_of_a_folder_that_is_neither(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(tmp_path) in err and len(err.splitlines()) == 1


# ---------------------------------------------------------------- issue 26: what report reads and writes
def _copy_run(run, target):
    import shutil

    shutil.copytree(run, target, ignore=shutil.ignore_patterns("analysis", "report.*"))
    return target


def test_report_of_an_evaluate_folder(sweep, tmp_path):
    """`mima evaluate RUNS --out EVAL` writes the results files and names the runs in selection.json (no
    runs/ folder): the report reads it as docs/demo.md says (the old code refused it: "not a sweep folder")."""
    import shutil

    from tests.helpers import unchanged

    evaluation = tmp_path / "eval"
    evaluation.mkdir()
    for name in ("results.json", "results.csv", "results.md", "selection.json"):
        shutil.copy(sweep / name, evaluation / name)
    assert json.loads((evaluation / "selection.json").read_text())["runs"]  # what evaluate records
    with unchanged(sweep / "runs"):
        assert main(["report", str(evaluation)]) == 0
    markdown = (evaluation / "report.md").read_text()
    rows = json.loads((evaluation / "results.json").read_text())
    mean = next(100 * r["accuracy"] for r in rows if (r["N"], r["model"], r["task"]) == (2, "uniform", "mean"))
    assert f"{mean:.1f}" in markdown and "runs (N1, N2)" in markdown
    assert all((evaluation / image).resolve().is_file() for image in _images(markdown))
    links = re.findall(r"(?<!!)\[[^\]]+\]\(([^)]+\.safetensors)\)", markdown)
    assert len(links) == 2 * (1 + len(TASKS)) and all((evaluation / link).resolve().is_file() for link in links)


def test_report_with_out_writes_nothing_beside_a_read_only_run(sweep, tmp_path):
    """--out: the page and the plots it makes go there; the run folder is not touched (the old code wrote
    RUN/analysis/cosine, and failed on a read-only run)."""
    import os
    import stat

    from tests.helpers import unchanged

    run = _copy_run(sweep / "runs" / "N2", tmp_path / "run")
    modes = {}
    for path in [run, *run.rglob("*")]:
        modes[path] = path.stat().st_mode
        os.chmod(path, modes[path] & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        with unchanged(run):
            assert main(["report", str(run), "--out", str(tmp_path / "page")]) == 0
    finally:
        for path, mode in modes.items():
            os.chmod(path, mode)
    page = tmp_path / "page"
    assert (page / "report.md").is_file() and (page / "analysis" / "cosine" / "cosine_phases.png").is_file()
    markdown = (page / "report.md").read_text()
    assert "analysis/cosine/cosine_phases.png" in _images(markdown)
    assert all((page / image).resolve().is_file() for image in _images(markdown))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page", "run"]  # no temporary folder left


def test_a_failed_report_leaves_the_previous_one_as_it_was(sweep, tmp_path, monkeypatch):
    import mima.commands.report.page

    from tests.helpers import unchanged

    run = _copy_run(sweep / "runs" / "N1", tmp_path / "run")
    page = tmp_path / "page"
    assert main(["report", str(run), "--out", str(page)]) == 0
    monkeypatch.setattr(mima.commands.report.page, "render_markdown", lambda *args: "a new page")

    def fail(*args):
        raise RuntimeError("the html page failed")

    monkeypatch.setattr(mima.commands.report.page, "render_html", fail)
    with unchanged(tmp_path):
        with pytest.raises(RuntimeError, match="the html page failed"):
            main(["report", str(run), "--out", str(page), "--overwrite"])


def test_report_refuses_an_output_folder_another_job_holds(sweep, tmp_path):
    from tests.helpers import lock_holder

    run = _copy_run(sweep / "runs" / "N1", tmp_path / "run")
    holder = lock_holder(tmp_path / "page")
    try:
        code = main(["report", str(run), "--out", str(tmp_path / "page")])
    finally:
        holder.communicate("\n", timeout=30)
    assert code == 2
    assert not (tmp_path / "page" / "report.md").exists()
    assert [p.name for p in tmp_path.rglob(".*")] == []  # no temporary folder or file left


@pytest.mark.parametrize("clip, pretrained, shown", [
    ("ViT-B-32", "openai", "pretrained: openai"),
    ("ViT-B-32", "none", "random weights"),
    ("embedded:tiny-digits", "openai", "pretrained by mima on first use"),  # the tag does not apply
    ("local-dir:/models/mine", "laion2b_s34b_b79k", "weights of the folder"),
])
def test_the_page_says_where_theta_0_came_from(clip, pretrained, shown):
    from mima.commands.report.page import _weights

    assert _weights(clip, pretrained) == shown
