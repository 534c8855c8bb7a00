"""The Markdown tables of the merge strategies that README.md (`overview`) and docs/merging.md
(`reference`) show, rendered from the catalogue (mima.merging.catalogue) alone, without torch: a page
says what the code declares, and a strategy's facts are written once.

In a page, each table follows its marker line and runs to the first line that is not a table row:

    <!-- strategy table: overview (python -m mima.merging.strategy_tables) -->

tests/docs/test_strategy_tables.py holds each page's table to its rendering. After changing a declaration,
in a checkout:

    python -m mima.merging.strategy_tables      # rewrite the tables of README.md and docs/merging.md
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from mima.merging.catalogue import HYPERPARAMETERS, KINDS, PATTERN_MEANINGS, STRATEGIES, Paper, Strategy

Strategies = Mapping[str, Strategy]

# A marker line and the table rows after it: group 1 the marker, group 2 the table's name, group 3 the rows.
TABLE = re.compile(r"^(<!-- strategy table: (\w+) [^\n]*-->\n)((?:\|[^\n]*(?:\n|$))*)", re.MULTILINE)
# a grid this long or shorter is listed whole; a longer evenly spaced one as "first, second .. last"
LISTED_WHOLE = 4


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """The table's lines; a `|` in a cell is escaped, so that it cannot split the cell."""
    lines = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(cell.replace("|", r"\|") for cell in line) + " |" for line in lines)


def value_text(value: object) -> str:
    """A default or grid value as a table shows it: numbers as Python writes them, a default pattern in
    words, any other string as code."""
    if isinstance(value, str):
        return PATTERN_MEANINGS.get(value, f"`{value}`" if value else "`''`")
    return repr(value)


def evenly_spaced(values: Sequence[object]) -> bool:
    numbers = [value for value in values if isinstance(value, (int, float)) and not isinstance(value, bool)]
    if len(numbers) != len(values) or len(values) < 3:
        return False
    steps = [later - earlier for earlier, later in zip(numbers, numbers[1:])]
    return all(math.isclose(step, steps[0], rel_tol=1e-6, abs_tol=1e-12) for step in steps)


def grid_text(values: Sequence[object]) -> str:
    """The values a grid searches: all of them, or "first, second .. last" for a long even grid."""
    texts = [value_text(value) for value in values]
    if len(values) > LISTED_WHOLE and evenly_spaced(values):
        return f"{texts[0]}, {texts[1]} .. {texts[-1]}"
    return ", ".join(texts)


def hyperparameters_text(strategy: Strategy) -> str:
    """Each hyperparameter's flag and default, with the values `--select-on val` searches where it has a grid."""
    parts = []
    for name, default in strategy.defaults.items():
        text = f"`{HYPERPARAMETERS[name].flag}` {value_text(default)}"
        if name in strategy.grid:
            text += f" (searched: {grid_text(strategy.grid[name])})"
        parts.append(text)
    return "; ".join(parts) or "none"


def needs_text(strategy: Strategy) -> str:
    """What it needs beside the task models."""
    needs = ["theta_0"] * strategy.needs_base + ["task data"] * strategy.needs_data
    return ", ".join(needs) or "the models only"


def paper_text(paper: Paper) -> str:
    link = f"[{paper.title}]({paper.url})"
    return link if paper.number is None else f"{link} (paper {paper.number})"


def overview_table(strategies: Strategies) -> str:
    """README.md's table: what each strategy does, its kind, what it needs and its paper."""
    header = ("`--method`", "what it does", "kind", "needs", "paper")
    rows = ((f"`{name}`", strategy.summary, KINDS[strategy.kind], needs_text(strategy), paper_text(strategy.paper))
            for name, strategy in strategies.items())
    return markdown_table(header, rows)


def reference_table(strategies: Strategies) -> str:
    """docs/merging.md's table: the overview's columns and every hyperparameter's flag, default and grid."""
    header = ("method", "what it does", "kind", "needs", "hyperparameters (`--flag` default; searched: the values "
              "`--select-on val` tries)", "paper")
    rows = ((f"`{name}`", strategy.summary, KINDS[strategy.kind], needs_text(strategy), hyperparameters_text(strategy),
             paper_text(strategy.paper))
            for name, strategy in strategies.items())
    return markdown_table(header, rows)


# table name (as its marker gives it) -> its rendering
TABLES: dict[str, Callable[[Strategies], str]] = {"overview": overview_table, "reference": reference_table}


def rendering(name: str, strategies: Strategies) -> str:
    if name not in TABLES:
        raise ValueError(f"unknown strategy table '{name}' (known: {', '.join(TABLES)})")
    return TABLES[name](strategies)


def tables_in(page: str) -> dict[str, str]:
    """{table name: its rows as the page has them} for every marked table of a page."""
    return {match.group(2): match.group(3).rstrip("\n") for match in TABLE.finditer(page)}


def with_tables(page: str, strategies: Strategies = STRATEGIES) -> str:
    """The page with each marked table replaced by its rendering from `strategies`; the rest unchanged."""
    def rendered(match: re.Match[str]) -> str:
        ending = "\n" if match.group(3).endswith("\n") else ""
        return match.group(1) + rendering(match.group(2), strategies) + ending

    return TABLE.sub(rendered, page)


# page (relative to the repository's root) -> the tables it shows
PAGES: dict[str, tuple[str, ...]] = {"README.md": ("overview",), "docs/merging.md": ("reference",)}
# a checkout's root: the package's parent
ROOT = Path(__file__).resolve().parents[2]


def write_tables(root: Path = ROOT, strategies: Strategies = STRATEGIES) -> list[Path]:
    """Rewrite the marked tables of the PAGES under `root` from `strategies`; the pages that changed."""
    changed = []
    for name in PAGES:
        page = root / name
        text = page.read_text()
        if with_tables(text, strategies) != text:
            page.write_text(with_tables(text, strategies))
            changed.append(page)
    return changed


if __name__ == "__main__":
    for written in write_tables():
        print(f"rewrote {written}")
