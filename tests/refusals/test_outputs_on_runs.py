"""No output lands on a run folder's own files or inside the run folder a command reads (issue 49,
item 3; mima.core.run_outputs): each case, through the `mima` command line in this process or the
Python API, is refused in one line naming the output and the run, with exit status 2, no traceback
and nothing written (every file of the run and beside it hashed before and after), --overwrite or
not, whatever name the output takes (a symlink, `..`, a hard link). The places a run keeps for what
is made from it stay open: `mima evaluate --out RUN/evaluation`, RUN/analysis/, RUN's report."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import mima
from mima.cli import main
from mima.core.errors import MimaError
from tests.helpers import assert_one_line, cli, copy_run, fit_argv, unchanged

RUN = "{run}"  # stands for the test's copy of the finished run in each command line
TASKS = ("rot90", "mirror")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, small_clip) -> Path:
    """A finished two-task run of the small CLIP (S = 4, N = 2)."""
    run = tmp_path_factory.mktemp("fit") / "run"
    assert main(fit_argv(small_clip, run)) == 0
    return run


@pytest.fixture
def run(finished_run, tmp_path) -> Path:
    """The test's own copy of the finished run, with its task models also copied outside it."""
    copy = copy_run(finished_run, tmp_path / "run")
    (tmp_path / "models").mkdir()
    for name in (*TASKS, "pretrained"):
        source = copy / ("pretrained.safetensors" if name == "pretrained" else f"final/{name}.safetensors")
        shutil.copy(source, tmp_path / "models" / f"{name}.safetensors")
    os.symlink(copy, tmp_path / "alias")
    os.link(copy / "config.yaml", tmp_path / "hard-link.yaml")
    return copy


OUTSIDE_MODELS = ["--models", "{tmp}/models/rot90.safetensors", "{tmp}/models/mirror.safetensors",
                  "--base", "{tmp}/models/pretrained.safetensors"]
MERGE = ["merge", "--method", "task_arithmetic"]

# (argv, what the line says): each would write into or over the run today
COMMAND_CASES = {
    "merge-over-config": ([*MERGE, "--models", RUN, "--output", f"{RUN}/config.yaml", "--overwrite"],
                          "would write over config.yaml of the run folder"),
    "merge-over-config-of-another-run": (
        [*MERGE, *OUTSIDE_MODELS, "--output", f"{RUN}/config.yaml", "--overwrite"],
        "would write over config.yaml of the run folder"),
    "merge-over-pretrained": ([*MERGE, *OUTSIDE_MODELS, "--output", f"{RUN}/pretrained.safetensors", "--overwrite"],
                              "would write over pretrained.safetensors of the run folder"),
    "merge-into-final": ([*MERGE, "--models", *(f"{RUN}/final/{task}.safetensors" for task in TASKS),
                          "--base", f"{RUN}/pretrained.safetensors", "--output", f"{RUN}/final/merged.safetensors"],
                         "would write over final/ of the run folder"),
    "merge-into-the-input-run": ([*MERGE, "--models", RUN, "--output", f"{RUN}/merged.safetensors"],
                                 "would write into the run folder"),
    "merge-through-a-symlink": ([*MERGE, "--models", RUN, "--output", "{tmp}/alias/config.yaml", "--overwrite"],
                                "would write over config.yaml of the run folder"),
    "merge-through-dot-dot": ([*MERGE, "--models", RUN, "--output", f"{RUN}/final/../config.yaml", "--overwrite"],
                              "would write over config.yaml of the run folder"),
    "merge-over-a-hard-link": ([*MERGE, "--models", RUN, "--output", "{tmp}/hard-link.yaml", "--overwrite"],
                               "under another name (a hard link)"),
    "merge-open-clip-into-the-run": ([*MERGE, "--models", RUN, "--format", "open-clip", "--output", RUN, "--overwrite"],
                                     "would write into the run folder"),
    "evaluate-into-the-run": (["evaluate", RUN, "--out", RUN, "--merges", "uniform", "--no-select"],
                              "would write into the run folder"),
    "evaluate-into-final": (["evaluate", RUN, "--out", f"{RUN}/final", "--merges", "uniform", "--no-select"],
                            "would write over final/ of the run folder"),
    "convert-open-clip-into-the-run": (["convert", "--to", "open-clip", f"{RUN}/final/rot90.safetensors", "--config", RUN,
                                        "--output", RUN, "--overwrite"], "would write into the run folder"),
    "report-into-final": (["report", RUN, "--out", f"{RUN}/final"], "would write over final/ of the run folder"),
    "analyze-into-logs": (["analyze", "cosine", RUN, "--out", f"{RUN}/logs"], "would write over logs/ of the run folder"),
    "analyze-into-the-run": (["analyze", "cosine", RUN, "--out", RUN], "would write into the run folder"),
    "splits-into-final": (["data", "splits", "--config", RUN, "--out", f"{RUN}/final"],
                          "would write over final/ of the run folder"),
}


def spelled(argv: list[str], run: Path) -> list[str]:
    return [word.replace(RUN, str(run)).replace("{tmp}", str(run.parent)) for word in argv]


@pytest.mark.parametrize("case", list(COMMAND_CASES))
def test_a_command_never_writes_on_or_into_a_run_it_reads(run, capfd, case):
    argv, says = COMMAND_CASES[case]
    with unchanged(run.parent):
        result = cli(spelled(argv, run), capfd)
    line = assert_one_line(result.code, result.err, says)
    assert str(run) in line or str(run.resolve()) in line, line  # it names the run


def test_a_fit_never_starts_in_another_runs_own_folder(run, small_clip, capfd):
    with unchanged(run.parent):
        result = cli(fit_argv(small_clip, run / "final"), capfd)
    assert_one_line(result.code, result.err, "--out", "would write over final/ of the run folder")


@pytest.mark.parametrize("call", ["merge-over-config", "evaluate-into-the-run"])
def test_the_api_refuses_the_same_outputs(run, call):
    with unchanged(run.parent), pytest.raises(MimaError) as refused:
        if call == "merge-over-config":
            mima.merge(run, "task_arithmetic", output=run / "config.yaml", overwrite=True)
        else:
            mima.evaluate(run, out=run, merges=["uniform"], select=False)
    line = str(refused.value)
    assert "\n" not in line and str(run) in line, line
    assert "would write over config.yaml of the run folder" in line or "would write into the run folder" in line, line


def test_the_places_a_run_keeps_for_its_results_stay_open(run, capfd):
    """`mima evaluate RUN --out RUN/evaluation` (what `mima report` shows) and the default analysis folder."""
    result = cli(["evaluate", run, "--out", run / "evaluation", "--merges", "uniform", "--no-select"], capfd)
    assert result.code == 0, result.err
    assert (run / "evaluation" / "results.json").is_file()
    assert cli(["analyze", "cosine", run], capfd).code == 0
    assert (run / "analysis" / "cosine" / "cosine.json").is_file()
