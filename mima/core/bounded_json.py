"""Reading back a JSON record mima wrote (run folders, results, metrics.jsonl), bounded.

A record may have been damaged, edited into something else, replaced by a huge file or nested deeper
than the parser goes: each read is bounded in size (`MAX_JSON_BYTES`) and every way it can fail is one
line naming the file (and the line of a JSON-lines file), never a traceback. Writing them:
mima.core.files.write_json_atomic.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from mima.core.errors import MimaError


MAX_JSON_BYTES = 256 * 2**20  # the largest JSON file mima reads (a large study's results.json: a few MB)


def parse_json(text: str | bytes, name: str) -> object:
    """json.loads, with every way it can fail on a damaged or hostile text as one line: "`name` is not
    valid JSON (...)" (nesting too deep for the parser is a RecursionError, not a JSONDecodeError)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise MimaError(f"{name} is not valid JSON (nested too deeply for a record of mima's)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MimaError(f"{name} is not valid JSON ({exc})") from None


def read_text_bounded(path: Path, kind: str = "JSON", limit: int = MAX_JSON_BYTES) -> str:
    """A text file of at most `limit` bytes, one line naming it otherwise (or when it cannot be read)."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise MimaError(f"{path}: {size} bytes, more than the {limit} a file of mima's records holds")
        return path.read_text()
    except OSError as exc:
        raise MimaError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise MimaError(f"{path}: not {kind} (not a text file)") from None


def read_json(path: str | os.PathLike, expect: type = dict) -> object:
    """A JSON file that a mima command wrote (run folders, results), or one line naming the file if
    it was damaged, edited into something else, too large or nested too deeply."""
    path = Path(path)
    try:
        value = json.loads(read_text_bounded(path, "valid JSON"))
    except RecursionError:
        raise MimaError(f"{path}: not valid JSON (nested too deeply for a record of mima's)") from None
    except json.JSONDecodeError as exc:
        raise MimaError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, expect):
        raise MimaError(f"{path}: expected a JSON {'object' if expect is dict else 'list'}, found {type(value).__name__}")
    return value


def read_json_lines(path: str | os.PathLike, check: Callable[[dict], str | None] | None = None) -> list[dict]:
    """A JSON-lines file of objects (metrics.jsonl), one line naming the file and line if damaged;
    `check` says why a record cannot be used (None: it can), named with its line the same way."""
    path = Path(path)
    text = read_text_bounded(path, "JSON lines")
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        record = parse_json(line, f"{path}: line {number}")
        if not isinstance(record, dict):
            raise MimaError(f"{path}: line {number} is not a JSON object")
        why = check(record) if check is not None else None
        if why is not None:
            raise MimaError(f"{path}: line {number} {why}")
        records.append(record)
    return records


def short_json(value: object) -> str:
    """A record's value as a message shows it: its JSON, cut to 40 characters."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
