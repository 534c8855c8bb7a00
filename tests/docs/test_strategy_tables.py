"""The merge strategies' tables in README.md and docs/merging.md are the catalogue's: each page's marked
table, read back from the page, equals its rendering from mima.merging.catalogue.STRATEGIES, so a
strategy's name, paper, summary, kind, needs, defaults and grid are written once (issue 48)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mima.merging.catalogue import STRATEGIES
from mima.merging.strategy_tables import PAGES, TABLES, markdown_table, tables_in, with_tables

REPO = Path(__file__).resolve().parents[2]


def rows(table: str) -> list[list[str]]:
    """A Markdown table's cells, row by row (an escaped `\\|` stays inside its cell)."""
    return [[cell.strip() for cell in line.strip().strip("|").replace(r"\|", "\0").split("|")]
            for line in table.splitlines()]


def differing_rows(table: str, other: str) -> list[str]:
    """The first cell of each row where two tables differ (both the same length)."""
    return [mine[0] for mine, theirs in zip(rows(table), rows(other), strict=True) if mine != theirs]


@pytest.mark.parametrize("page", sorted(PAGES))
def test_each_page_shows_the_catalogues_tables(page):
    shown = tables_in((REPO / page).read_text())
    assert tuple(shown) == PAGES[page]
    for name in PAGES[page]:
        table = rows(shown[name])
        expected = rows(TABLES[name](STRATEGIES))
        # one row per strategy, in the catalogue's order, after the header and its rule
        assert [row[0] for row in table[2:]] == [f"`{strategy}`" for strategy in STRATEGIES]
        assert table == expected, (f"{page}'s {name} table differs from the catalogue's; rewrite it with "
                                   "`python -m mima.merging.strategy_tables`")
        assert shown[name] == TABLES[name](STRATEGIES)  # and so is every character between the cells


def test_a_changed_declaration_changes_its_row_alone():
    """The check can fail: one summary, one default or one grid changed in the catalogue renders a table
    that differs from the pages' in that strategy's row only."""
    changes = {"ties": {"summary": "something else"},
               "cart": {"defaults": {**STRATEGIES["cart"].defaults, "rank_ratio": 0.16}},
               "tall": {"grid": {"mask_lam": (0.2, 0.4)}}}
    for strategy, change in changes.items():
        changed = {**STRATEGIES, strategy: replace(STRATEGIES[strategy], **change)}
        rendered_differently = set()
        for page, names in PAGES.items():
            shown = tables_in((REPO / page).read_text())
            for name in names:
                differing = differing_rows(shown[name], TABLES[name](changed))
                assert differing in ([], [f"`{strategy}`"])
                rendered_differently.update(differing)
        assert rendered_differently == {f"`{strategy}`"}  # the reference table shows every one of these


def test_a_page_edited_by_hand_is_caught_and_rewritten():
    page = (REPO / "README.md").read_text()
    summary = STRATEGIES["uniform"].summary
    edited = page.replace(f"| {summary} |", "| the mean of the models |", 1)
    assert edited != page
    assert differing_rows(tables_in(edited)["overview"], TABLES["overview"](STRATEGIES)) == ["`uniform`"]
    assert with_tables(edited) == page  # the rest of the page untouched


def test_a_pipe_in_a_cell_stays_in_its_cell():
    table = markdown_table(("a", "b"), [("x | y", "z")])
    assert table.splitlines()[2] == r"| x \| y | z |"
    assert rows(table)[2] == ["x \0 y", "z"]


def test_the_tables_are_written_without_torch(tmp_path):
    stale = "<!-- strategy table: {} (stale) -->\n| stale |\n"
    for page, names in PAGES.items():
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / page).write_text("# A page\n\n" + "\n".join(stale.format(name) for name in names) + "\nThe end.\n")
    script = ("import sys; sys.modules['torch'] = None; from pathlib import Path; "
              "from mima.merging.strategy_tables import write_tables; "
              f"print(len(write_tables(Path({str(tmp_path)!r}))))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{len(PAGES)}\n"
    for page, names in PAGES.items():
        written = (tmp_path / page).read_text()
        assert written == ("# A page\n\n" + "\n".join(f"<!-- strategy table: {name} (stale) -->\n"
                                                       + TABLES[name](STRATEGIES) + "\n" for name in names)
                           + "\nThe end.\n")
        assert tables_in(written) == {name: TABLES[name](STRATEGIES) for name in names}


def test_an_unknown_table_name_is_refused():
    with pytest.raises(ValueError, match="unknown strategy table 'colours' \\(known: overview, reference\\)"):
        with_tables("<!-- strategy table: colours (no such table) -->\n| x |\n")
