"""Every option of a run config by the key the config gives it, with the facts of its one declaration:
`model:` (mima.config.model.ModelSettings), `data:` (mima.data.settings.DataSettings), fit's own and
Lightning's (mima.config.fit_options). What reads an option's facts by its key reads them here: the
resume rule (mima.config.config_changes), a range checked by key (`check_value`), and the table of
options in docs/configuration.md (`options_table`, which tests/architecture/test_stated_once.py holds the page to).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from mima.config.fit_options import LIGHTNING_OPTIONS, LIGHTNINGS, RUN_OPTIONS, FitOptions
from mima.config.model import ModelSettings
from mima.core.settings import OptionFacts, ValueRange, declared_options
from mima.data.settings import DataSettings

# the settings dataclasses and the prefix of their keys in a config
SECTIONS: tuple[tuple[type, str], ...] = ((ModelSettings, "model."), (DataSettings, "data."), (FitOptions, ""))
OPTIONS: dict[str, OptionFacts] = {
    **{key: facts for settings, prefix in SECTIONS for key, facts in declared_options(settings, prefix).items()},
    **RUN_OPTIONS,
}


def declared(key: str) -> OptionFacts | None:
    """The facts of `key`: its own, or those of the option whose value it is part of (model.steps.TASK:
    model.steps; trainer.logger.init_args.save_dir: trainer.logger); None for an undeclared key."""
    parts = key.split(".")
    for length in range(len(parts), 0, -1):
        facts = OPTIONS.get(".".join(parts[:length]))
        if facts is not None:
            return facts
    return None


def check_value(key: str, value: object) -> None:
    """Refuse, in one line, a value of the option `key` out of its declared range; `key` may also name
    an entry of a map option (model.sync_merge_args.lam)."""
    if key in OPTIONS:
        OPTIONS[key].check(key, value)
        return
    parent, _, entry = key.rpartition(".")
    OPTIONS[parent].check(parent, {entry: value})


# ------------------------------------------------------------------ the table in docs/configuration.md
TABLE_HEADER = ("| option | default | range | a resume that changes it | runs written before the option |\n"
                "| --- | --- | --- | --- | --- |")
RESUME_WORDS = {
    "fixed": "is refused",
    "may change": "goes on (recorded)",
    "same processes": "goes on where the number of processes stays the same",
    "not compared": "not compared",
}


def defaults() -> dict[str, object]:
    """The default of every option, by key (a Lightning option that mima leaves alone: LIGHTNINGS)."""
    fields = {f"{prefix}{field.name}": field.default for settings, prefix in SECTIONS
              for field in dataclasses.fields(settings)}
    return {**fields, **{key: declared.default for key, declared in LIGHTNING_OPTIONS.items()}}


def shown(value: object) -> str:
    """A value as a YAML config writes it, as code."""
    if value is LIGHTNINGS:
        return str(value)
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return f"`{text}`"


def range_words(facts: OptionFacts) -> str:
    def words(bounds: ValueRange) -> str:
        return bounds.words(bounds.high)

    if isinstance(facts.entries, Mapping):
        return "; ".join(f"{name}: {words(bounds)}" for name, bounds in facts.entries.items())
    return words(facts.bounds) if facts.bounds is not None else ""


def options_table() -> str:
    """The Markdown table of every option: its default, its range, what a resume that changes it does,
    and the value that runs written before it existed are read with."""
    rows = [TABLE_HEADER]
    for key, default in defaults().items():
        facts = OPTIONS[key]
        older = "" if facts.older_runs is None else shown(facts.older_runs)
        rows.append(f"| `{key}` | {shown(default)} | {range_words(facts)} | {RESUME_WORDS[facts.resume]} | {older} |")
    return "\n".join(rows) + "\n"
