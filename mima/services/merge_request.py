"""What a merge is asked to do: `mima merge`'s parsed command line (mima.commands.merge) and
`mima.merge`'s arguments (mima.api) alike, which mima.services.merge runs. Imports nothing heavy, so
that `mima merge --help` and its argument errors answer before torch is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mima.evaluation.cache_use import CACHE_MODES

SELECT_ON = ("val",)  # --select-on's choices: the split the hyperparameters are chosen on


@dataclass(frozen=True)
class MergeRequest:
    """One merge: its inputs, where it goes and how it is computed."""

    method: str  # a declared strategy's name
    models: tuple[Path, ...]  # safetensors state dicts, or one `mima fit` run folder
    output: Path | None = None  # the file (with format "open-clip": the folder); None: merged in memory (mima.merge)
    base: Path | None = None
    config: Path | None = None  # a mima fit config or run folder: the tasks' model and data
    select_on: str | None = None  # "val": choose the hyperparameters on the validation splits
    overwrite: bool = False
    allow_non_finite: bool = False
    device: str = "auto"  # as --device spells it (auto, cpu, cuda, cuda:N)
    format: str = "safetensors"  # --format: "safetensors" (the image encoder) or "open-clip" (a full CLIP folder)
    log_to_tracker: bool = False  # the results also go to the tracker runs of the run folder's fit
    cache: str = CACHE_MODES[0]  # --cache: whether the task pool reads the decoded-image cache (mima.evaluation.cache_use)
    # the hyperparameters given, {name: value} as the strategy takes them (unchecked against the method)
    hyperparameters: dict[str, object] = field(default_factory=dict)
