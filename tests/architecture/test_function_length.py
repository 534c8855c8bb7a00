"""No function in mima/ is longer than 60 lines (issue 48, item 4): each does one job a reader can hold.

The length of a function (or method, or a function nested in one) is the lines from its `def` to its
last line, docstring and comments included, decorators not: `end_lineno - lineno + 1` of the node that
`ast` reads from the source.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "mima"
MAX_FUNCTION_LINES = 60


def long_functions(sources: dict[str, str], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`path:line name (length lines)` of every function over `limit` lines in `sources` (path -> text)."""
    found = []
    for path, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    found.append(f"{path}:{node.lineno} {node.name} ({length} lines)")
    return sorted(found)


def test_no_function_in_mima_is_over_60_lines():
    sources = {str(path.relative_to(PACKAGE.parent)): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
    assert len(sources) > 100
    assert long_functions(sources) == []


def test_a_function_of_61_lines_is_found_and_one_of_60_is_not():
    body = "".join(f"    x{i} = {i}\n" for i in range(59))  # with its def line: 60 lines
    sixty = f"def sixty():\n{body}"
    method = textwrap.indent(f"@staticmethod\ndef longer():\n{body}    return x0\n", "    ")  # 61 lines from the def
    nested = f"def outer():\n{textwrap.indent(f'def inner():{chr(10)}{body}    return 1{chr(10)}', '    ')}    return inner\n"
    sources = {"a.py": sixty, "b.py": f"class Kept:\n{method}", "c.py": nested}
    assert long_functions(sources) == ["b.py:3 longer (61 lines)", "c.py:1 outer (63 lines)", "c.py:2 inner (61 lines)"]
