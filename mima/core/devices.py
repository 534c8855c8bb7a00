"""How mima's command lines spell a device (`mima merge --device`, `mima evaluate --merge-device`),
checked without torch; whether this machine has the device is checked where it is used
(mima.merging.engine.merge_device)."""

from __future__ import annotations

import re

DEVICE_SPELLING = re.compile(r"auto|cpu|cuda(:\d+)?")


def misspelled_device(text: str) -> str | None:
    """What is wrong with `text` as a device ("expected auto, cpu, cuda or cuda:N, got 'gpu'"), None
    when it spells one (in any case, with spaces around)."""
    if DEVICE_SPELLING.fullmatch(text.strip().lower()) is None:
        return f"expected auto, cpu, cuda or cuda:N, got {text!r}"
    return None
