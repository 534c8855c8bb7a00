"""Fingerprints of the image listings a run was trained on, so that a changed folder is seen.

A task read from a folder (a custom task) is split by the folder's listing: the test holdout and the
validation carve are index permutations of it. Files added, removed or renamed between a stop and its
resume would move images across splits (test images trained on), and an evaluation of a run on a
changed folder would measure other images than the run was split on. Each split folder's listing is
fingerprinted when the task is read (file paths relative to the task folder, labels and sizes; not
modification times, which a copy to another machine changes), recorded in the run folder, and
compared by `mima fit --ckpt_path` and `mima evaluate`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path


def listing_fingerprint(samples: Sequence[tuple[str, int]], root: Path) -> dict:
    """{"files": n, "sha256": ...} of (path below `root`, label, size in bytes) of each sample, in order."""
    digest = hashlib.sha256()
    for path, label in samples:
        try:
            size = os.stat(path).st_size
        except OSError:
            size = -1
        relative = os.path.relpath(path, root)
        digest.update(f"{relative}\t{label}\t{size}\n".encode("utf-8", "surrogateescape"))
    return {"files": len(samples), "sha256": digest.hexdigest()}


def listing_changes(recorded: Mapping[str, Mapping[str, Mapping]], current: Mapping[str, Mapping[str, Mapping]]) -> list[str]:
    """What differs between two {task: {split: fingerprint}} maps, one phrase per task and split, for
    the tasks both know of (a task only one of them has is the config's business)."""
    changes = []
    for task in sorted(set(recorded) & set(current)):
        for split in sorted(set(recorded[task]) | set(current[task])):
            then, now = recorded[task].get(split), current[task].get(split)
            if then == now:
                continue
            if then is None or now is None:
                changes.append(f"task '{task}' ({split}): the split folder {'appeared' if then is None else 'is gone'}")
            elif then.get("files") != now.get("files"):
                changes.append(f"task '{task}' ({split}): {then.get('files')} image files then, {now.get('files')} now")
            else:
                changes.append(f"task '{task}' ({split}): as many files ({now.get('files')}), but names, classes or "
                               "sizes differ")
    return changes
