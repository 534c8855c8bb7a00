"""How the command lines spell two things, checked without torch or argparse, so that a command's
parser and the Python API (through mima.services) word a mistake alike: the known option nearest to
a mistyped one, and a device's spelling (whether the machine has that device is checked where the
work runs: mima.merging.engine.merge_device)."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable

SUGGESTION_CUTOFF = 0.6  # difflib's similarity ratio: --methd and --method are 0.91, --foo and --out 0.33
DEVICE_SPELLINGS = "auto, cpu, cuda or cuda:N"  # how a device is spelled, in messages


def suggest_option(word: str, known: Iterable[str]) -> str | None:
    """The known option nearest to WORD, a mistyped option ("--methd", or "--methd=ties": the part
    before "="), or None when none is close; compared without their leading dashes, which every
    option shares. Of the close ones, the one sharing the longest start with WORD (a shortened name,
    --model.iters, means --model.iterations, not the as similar --model.steps), then the most similar."""
    name = word.split("=", 1)[0].lstrip("-")
    candidates = {option.lstrip("-"): option for option in known}
    close = difflib.get_close_matches(name, list(candidates), n=max(len(candidates), 1), cutoff=SUGGESTION_CUTOFF)
    if not close:
        return None
    return candidates[max(close, key=lambda option: len(os.path.commonprefix([name, option])))]  # max: the first of ties


def check_device_spelling(text: str) -> str:
    """`text` when it spells a device as the merge commands take it (auto, cpu, cuda, cuda:N, any case);
    else a ValueError saying what was expected."""
    if re.fullmatch(r"auto|cpu|cuda(:\d+)?", text.strip().lower()) is None:
        raise ValueError(f"expected {DEVICE_SPELLINGS}, got {text!r}")
    return text
