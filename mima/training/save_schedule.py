"""When each process saves its state: `--checkpoint_every` read into a `SaveSchedule`.

Its own module (torch- and Lightning-free) because two readers need it: the checkpoint callback
(mima.training.checkpoint_callback, which acts on it during a run) and the plan (mima.training.resource_plan,
which counts the files it writes before a run), which must not load a Lightning callback to do so.

The forms: "segment" (every task segment end, so a crash loses at most K steps), "phase" or
"k phases" (at every k-th sync), a number n (every n process steps and at every sync), a time such as
"30min" (at the first sync after that much time since the last save), or 0 (never); `mima fit`'s
default "auto" is settled by the plan (mima.training.plan_choices). What each form costs and loses:
the checkpoint callback's module docstring.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mima.config.defaults import CHECKPOINT_EVERY_ON_CPU
from mima.core.errors import MimaError

SCHEDULE_FORMS = ("'segment', 'phase', a number of steps, 'K phases' (K >= 1), a time such as 90s, 30min or 2h, "
                  "or 0 (never)")
SECONDS_PER_UNIT = {"s": 1.0, "sec": 1.0, "min": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class SaveSchedule:
    """--checkpoint_every, read: when each process saves its state (see the module docstring)."""

    kind: str  # "segment", "phases", "steps", "seconds" or "never"
    amount: float = 0.0  # k phases, n steps or seconds

    @staticmethod
    def parse(value: str | int | None) -> SaveSchedule:
        """The schedule a --checkpoint_every value names; anything else is one line naming the forms."""
        text = CHECKPOINT_EVERY_ON_CPU if value is None else str(value).strip().lower()
        if text == "segment":
            return SaveSchedule("segment")
        if text == "phase":
            return SaveSchedule("phases", 1)
        if text.isdigit():
            return SaveSchedule("steps", int(text)) if int(text) else SaveSchedule("never")
        phases = re.fullmatch(r"(\d+)\s*phases?", text)
        if phases and int(phases.group(1)) >= 1:
            return SaveSchedule("phases", int(phases.group(1)))
        interval = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|h)", text)
        if interval and float(interval.group(1)) > 0:
            return SaveSchedule("seconds", float(interval.group(1)) * SECONDS_PER_UNIT[interval.group(2)])
        raise MimaError(f"--checkpoint_every must be {SCHEDULE_FORMS}, got {value!r}")

    @property
    def saves(self) -> bool:
        return self.kind != "never"
