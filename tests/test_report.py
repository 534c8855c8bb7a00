"""`mima report`: the page of a sweep and of a run, checked against the result files it is built from."""

from __future__ import annotations

import json
import re

import pytest

from mima.cli import main
from mima.evaluate_runs import evaluate_runs
from mima.training.trainer import run_fit
from tests.conftest import fit_config

TASKS = ["rot90", "mirror"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, small_clip):
    folder = tmp_path_factory.mktemp("report-sweep")
    runs = [run_fit(fit_config(folder / "runs" / f"N{n}", small_clip, TASKS, steps=4, iterations=n)).run_dir for n in (1, 2)]
    evaluate_runs(runs, folder, ["uniform", "task_arithmetic"], select_on_val=False)
    return folder


def _images(markdown: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)


def test_sweep_report_tables_images_and_links(sweep, capsys):
    assert main(["report", str(sweep)]) == 0
    markdown = (sweep / "report.md").read_text()
    # every mean accuracy of results.json appears in the summary row of its model, in % with one decimal
    rows = json.loads((sweep / "results.json").read_text())
    for model in ("zero_shot", "fine_tuned", "uniform", "task_arithmetic"):
        means = [100 * r["accuracy"] for n in (1, 2) for r in rows if (r["N"], r["model"], r["task"]) == (n, model, "mean")]
        assert f"| {model} | {means[0]:.1f} | {means[1]:.1f} |" in markdown
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


def test_run_report_lists_the_phases(sweep, tmp_path):
    run = sweep / "runs" / "N2"
    assert main(["report", str(run), "--out", str(tmp_path / "page")]) == 0
    markdown = (tmp_path / "page" / "report.md").read_text()
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
