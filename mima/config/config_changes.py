"""What a resumed run may change in its config: the rule `mima fit --ckpt_path last` applies.

A run folder's config.yaml is the config that produced its weights, and must go on reproducing them
bit for bit. A resume therefore compares the config it is given with the stored one, key by key
(nested sections flattened to dotted keys, lists compared whole):

- a key that cannot change the weights (`HARMLESS`: progress bars, logging, data-loader workers, the
  checkpoint interval, timeouts, caches, callbacks) may change; the run folder records each such change
  (config_changes.jsonl) and config.yaml takes the new value;
- the process layout (`LAYOUT`: trainer.devices, trainer.num_nodes) may change only where the layout
  check allows it: today, when the number of processes stays the same (elastic resume will widen
  this);
- any other change (every model: and data: value that shapes the training, seed_everything, the
  accelerator, precision, threads per process, a key unknown to this list) is refused before anything
  is written, in one line naming each changed key with its old and new value.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mima.core.errors import MimaError

# How this command was called, not what it computes: never compared (the run folder is the same by
# construction, whatever --out template named it).
INVOCATION = frozenset({"config", "out", "ckpt_path", "overwrite", "accept_data_change"})
# Keys (or sections: a prefix covers every key under it) whose value cannot change the weights.
HARMLESS = frozenset({
    "checkpoint_every", "keep_checkpoints", "collective_timeout",  # when states are saved, how long to wait
    "trainer.enable_progress_bar", "trainer.enable_model_summary", "trainer.logger", "trainer.log_every_n_steps",
    "trainer.enable_checkpointing", "trainer.default_root_dir", "trainer.profiler", "trainer.callbacks",
    "data.num_workers", "data.eval_batch_size", "data.download", "data.cache_dir",  # workers; evaluation only
    "model.cache_dir",  # where the embedded models and heads are cached (the same bytes wherever they are)
    "model.grad_checkpointing",  # the same activations, recomputed in the backward pass instead of kept
})
# Options added after runs were written, with the value that does what the runs written before did:
# a stored config without the key equals one with that value.
ADDED_LATER = {
    "model.quick_gelu": "auto",  # the activation as a tag says; a weight file was refused or now says it
    "model.proximal_mu": 0.0,  # no proximal term: MIMA's loss
    # "auto" is eager on the CPU, as every run before the option was; a GPU run written before it (eager)
    # and resumed with "auto" compiles from the resume on: say --model.compile false to keep it eager
    "model.compile": "auto",
    # every run before the option stepped its tasks one after another: "auto" is off on the CPU, and a
    # resume's state says how the run stepped (MimaModule refuses a resume that would step otherwise)
    "model.batch_tasks": "auto",
}
# Keys that may change only where the layout check passes (the same number of processes, for now).
LAYOUT = frozenset({"trainer.devices", "trainer.num_nodes"})

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


def _covered(key: str, names: frozenset[str]) -> bool:
    parts = key.split(".")
    return any(".".join(parts[:length]) in names for length in range(1, len(parts) + 1))


def compare_configs(stored: Mapping, new: Mapping, same_layout: Callable[[Mapping, Mapping], bool]) -> ConfigChanges:
    """Classify every key whose value differs between `stored` (config.yaml) and `new`. `same_layout`
    says whether the two configs' process layouts allow the resume (it sees both whole configs)."""
    old_flat, new_flat = flatten(stored), flatten(new)
    changes = ConfigChanges()
    layout_allowed = same_layout(stored, new)
    for key in sorted(set(old_flat) | set(new_flat)):
        old, value = old_flat.get(key, ADDED_LATER.get(key, ABSENT)), new_flat.get(key, ABSENT)
        if old == value or (_empty(old) and _empty(value)) or _covered(key, INVOCATION):
            continue
        if _covered(key, HARMLESS) or (_covered(key, LAYOUT) and layout_allowed):
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
