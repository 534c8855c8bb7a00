"""What a resumed run may change in its config: the rule `mima fit --ckpt_path last` applies.

A run folder's config.yaml is the config that produced its weights, and must go on reproducing them
bit for bit. A resume therefore compares the config it is given with the stored one, key by key
(nested sections flattened to dotted keys, lists compared whole), and treats each changed key as its
option's declaration says (`resume`, mima.core.settings.ResumeRule; read through mima.config.options):

- "may change": the key cannot change the weights (progress bars, logging, data-loader workers, the
  checkpoint interval, timeouts, caches, callbacks); the run folder records each such change
  (config_changes.jsonl) and config.yaml takes the new value;
- "same processes" (trainer.devices, trainer.num_nodes): may change only where the layout check allows
  it: today, when the number of processes stays the same (elastic resume will widen this);
- "not compared": how this command was called (--out, --ckpt_path, --overwrite, ...), never compared;
- "fixed", and any key no option declares (every model: and data: value that shapes the training,
  seed_everything, the accelerator, precision, threads per process): a change is refused before
  anything is written, in one line naming each changed key with its old and new value.

A stored config without an option that was added after it was written reads as the option's
`older_runs` value (the value that does what those runs did).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mima.config.options import OPTIONS, declared
from mima.core.errors import MimaError
from mima.core.settings import ResumeRule

ABSENT = "(not set)"


@dataclass
class ConfigChanges:
    """The differences between a run's stored config and the config of its resume."""

    harmless: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    refused: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    def record(self) -> dict:
        """The history entry of the accepted changes (key -> [old, new])."""
        return {key: [old, new] for key, (old, new) in self.harmless.items()}


def flatten(config: Mapping, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of nested mappings; lists and other values are leaves."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def resume_rule(key: str) -> ResumeRule:
    """What a resume may do with a changed `key` (that of the option it belongs to; "fixed" if none)."""
    facts = declared(key)
    return "fixed" if facts is None else facts.resume


def older_runs_value(key: str) -> Any:
    """What a stored config without the option `key` means: its value for runs written before it, else ABSENT."""
    facts = OPTIONS.get(key)
    return ABSENT if facts is None or facts.older_runs is None else facts.older_runs


def compare_configs(stored: Mapping, new: Mapping, same_layout: Callable[[Mapping, Mapping], bool]) -> ConfigChanges:
    """Classify every key whose value differs between `stored` (config.yaml) and `new`. `same_layout`
    says whether the two configs' process layouts allow the resume (it sees both whole configs)."""
    old_flat, new_flat = flatten(stored), flatten(new)
    changes = ConfigChanges()
    layout_allowed = same_layout(stored, new)
    for key in sorted(set(old_flat) | set(new_flat)):
        old, value, rule = old_flat.get(key, older_runs_value(key)), new_flat.get(key, ABSENT), resume_rule(key)
        if old == value or (_empty(old) and _empty(value)) or rule == "not compared":
            continue
        if rule == "may change" or (rule == "same processes" and layout_allowed):
            changes.harmless[key] = (old, value)
        else:
            changes.refused[key] = (old, value)
    return changes


def _empty(value: Any) -> bool:
    """None, an absent key and an empty section or list all mean "not set"."""
    return value is None or value == ABSENT or value == {} or value == []


def _show(value: Any) -> str:
    if value == ABSENT:
        return ABSENT
    try:
        return json.dumps(value, sort_keys=True)
    except TypeError:
        return repr(value)


def refuse_changes(changes: ConfigChanges, config_file: str) -> None:
    """One line naming every refused key with its stored and new value (nothing if none)."""
    if not changes.refused:
        return
    listed = ", ".join(f"{key}: {_show(old)} -> {_show(new)}" for key, (old, new) in changes.refused.items())
    raise MimaError(
        f"--ckpt_path: the run in {config_file} was trained with other values of keys that change the weights "
        f"({listed}); resume with the run's own values, or start a new run (another --out, or --overwrite)"
    )
