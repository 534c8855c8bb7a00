"""Every command lists the options it listed before the command layer was reorganised (issue 37):
tests/fixtures/help_options.json holds, per command, the options its --help printed after issue 36
(2026-11-27), read the same way as here. `mima fit` counts mima's own
options and its model:/data: ones; trainer.* follow the installed Lightning."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from mima.cli import main

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "help_options.json"
EXPECTED: dict[str, list[str]] = json.loads(FIXTURE.read_text())
# an option at the start of an argparse help line ("  -o OUTPUT, --output OUTPUT  ..." or "  --lam LAM ...")
OPTION = re.compile(r"^\s+(?:-\w[\w ]*, )?(--[A-Za-z][\w.-]*)", re.MULTILINE)


def listed_options(argv: list[str]) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*argv, "--help"])
    found = set(OPTION.findall(out.getvalue()))
    if argv == ["fit"]:
        found = {option for option in found if not option.startswith(("--trainer", "--print_config", "--seed_everything"))}
    return sorted(found)


@pytest.mark.parametrize("command", sorted(EXPECTED))
def test_help_lists_the_same_options_as_before(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapped lines: an option begins each line it is listed on
    assert listed_options(command.split()) == EXPECTED[command]
