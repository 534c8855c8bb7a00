"""The documentation site builds with `mkdocs build --strict`, and a broken link or anchor fails it.

mkdocs.yml sets `validation:` so that a link to a missing page, a missing anchor or an unrecognised
link is a warning, which --strict turns into a failed build. The API pages are generated from the
docstrings by mkdocstrings, which reads the source with griffe: the build must not import torch.

Without the docs packages (pip install -e '.[docs]'; the `test` extra includes them) these tests
skip, and fail under CI (tests/ci_mode.py): CI installs them, so a skip there would hide a broken install.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.ci_mode import require

REPO = Path(__file__).resolve().parents[2]
DOCS_PACKAGES = {"mkdocs": "mkdocs", "material": "mkdocs-material", "mkdocstrings": "mkdocstrings",
                 "mkdocstrings_handlers.python": "mkdocstrings-python"}
# mkdocs run with torch made unimportable: the API pages must come from the source alone
_MKDOCS_WITHOUT_TORCH = "import sys; sys.modules['torch'] = None; from mkdocs.__main__ import cli; cli()"


def _require_docs_packages() -> None:
    def installed(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package is missing
            return False
    missing = [package for module, package in DOCS_PACKAGES.items() if not installed(module)]
    require(f"the documentation packages are not installed ({', '.join(missing)}): pip install -e '.[docs]'"
            if missing else None)


def _build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about its successor
    return subprocess.run([sys.executable, "-c", _MKDOCS_WITHOUT_TORCH, "build", "--strict", "--config-file",
                           str(project / "mkdocs.yml"), "--site-dir", str(site)],
                          capture_output=True, text=True, timeout=300, cwd=project, env=environment)


def _docstring_first_line(path: Path, name: str) -> str:
    """The first line of the docstring of class `name` in `path`, read with ast (not through mkdocstrings)."""
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    return ast.get_docstring(node).splitlines()[0]


def test_the_site_builds_strict_and_its_api_pages_come_from_the_docstrings(tmp_path):
    _require_docs_packages()
    result = _build(REPO, tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "WARNING" not in output, output[-3000:]

    # the API pages hold the docstrings as the source has them (a module griffe could not find would
    # have failed the build; this checks that the text arrived)
    config_page = (tmp_path / "site" / "api" / "config" / "index.html").read_text()
    first_line = _docstring_first_line(REPO / "mima" / "config" / "model.py", "ModelSettings")
    assert first_line.split(" (")[0] in config_page
    assert "optimizer_state" in config_page and "OptimizerState" in config_page
    merging_page = (tmp_path / "site" / "api" / "merging" / "index.html").read_text()
    assert _docstring_first_line(REPO / "mima" / "merging" / "catalogue.py", "Hyperparameter") in merging_page
    # the benchmarks page includes benchmarks/README.md whole
    benchmarks_page = (tmp_path / "site" / "benchmarks" / "index.html").read_text()
    assert "Checkpoint schedules, retention and stall" in benchmarks_page


def _copy_of_the_project(destination: Path) -> Path:
    """What the build reads: mkdocs.yml, docs/, the included benchmarks/README.md and the source that the
    API pages document."""
    destination.mkdir()
    shutil.copy(REPO / "mkdocs.yml", destination / "mkdocs.yml")
    shutil.copytree(REPO / "docs", destination / "docs")
    (destination / "benchmarks").mkdir()
    shutil.copy(REPO / "benchmarks" / "README.md", destination / "benchmarks" / "README.md")
    shutil.copytree(REPO / "mima", destination / "mima", ignore=shutil.ignore_patterns("__pycache__"))
    return destination


def _replace_once(page: Path, old: str, new: str) -> None:
    text = page.read_text()
    assert text.count(old) == 1, f"{page.name} should hold {old!r} once"
    page.write_text(text.replace(old, new))


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    _require_docs_packages()
    project = _copy_of_the_project(tmp_path / "project")
    # one link to a page that does not exist, one to an anchor that does not exist (both links work as written)
    _replace_once(project / "docs" / "clusters.md", "[Checkpoints](api/checkpoints.md)", "[Checkpoints](api/checkpoint.md)")
    _replace_once(project / "docs" / "data.md", "(results.md#the-decoded-image-cache)", "(results.md#the-image-cache)")

    result = _build(project, tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert ("Doc file 'clusters.md' contains a link 'api/checkpoint.md', but the target is not found among "
            "documentation files.") in output
    assert ("Doc file 'data.md' contains a link 'results.md#the-image-cache', but the doc 'results.md' does not "
            "contain an anchor '#the-image-cache'.") in output
    assert "Aborted with 2 warnings in strict mode!" in output



def test_ci_runs_the_readmes_test_command():
    """`.ci/run` runs, as one of its lines, exactly the README's test command (the fenced line that runs pytest)."""
    readme_commands = [line for line in (REPO / "README.md").read_text().splitlines()
                       if line.startswith("python3 -m venv .venv") and "pytest" in line]
    assert len(readme_commands) == 1
    assert readme_commands[0] in (REPO / ".ci" / "run").read_text().splitlines()
