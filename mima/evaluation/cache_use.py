"""Whether an evaluation reads the decoded-image cache (`mima evaluate --cache auto|on|off`).

The one place where the switch's spellings and their meaning are written; light (no torch), so that
`mima evaluate --help` and its argument errors answer before torch loads.

  on    every task's validation and test splits come from the decoded-image cache
        (mima.data.cache_store; built where missing), read as whole uint8 batches and normalised on
        the evaluation device (mima.evaluation.cached_batches); several merged models are evaluated
        on each batch read; on CUDA the encoder is compiled for inference. A task the cache cannot
        hold (a tensor suite: `digits`, `synthetic`) is one line.
  auto  `on` where the evaluation device is a GPU, except that tasks the cache cannot hold keep their
        own path (their images are tensors in memory already: nothing to decode); `off` on the CPU.
  off   the evaluation as it always ran: each split through the run's own data settings, item by
        item in the loader workers (a run trained with `data.cache: true` reads its cached images
        that way, normalised on the CPU).

Both paths apply the same float32 operations to the same pixels (x / 255, then (x - mean) / std), so
on the CPU their results are equal (tests/evaluation/test_evaluate_cache.py); on a GPU the compiled encoder may
differ from the uncompiled one in the last bits of its features.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mima.core.errors import MimaError

CACHE_MODES = ("auto", "on", "off")  # `--cache`; the first is the default
MODELS_PER_PASS = 8  # merged models evaluated on each batch read (the cache path): 8 encoder copies on the device


@dataclass(frozen=True)
class CacheUse:
    """What an evaluation process does with the cache, once its device is known: one of the three below."""

    OFF: ClassVar[CacheUse]  # the run's own data path
    WHERE_POSSIBLE: ClassVar[CacheUse]  # the cache for every task it can hold, the own path for the others
    EVERY_TASK: ClassVar[CacheUse]  # the cache for every task; a task it cannot hold is refused
    value: str

    @property
    def models_per_pass(self) -> int:
        """How many models one pass over a split evaluates on each batch it reads."""
        return 1 if self == CacheUse.OFF else MODELS_PER_PASS


CacheUse.OFF = CacheUse("off")
CacheUse.WHERE_POSSIBLE = CacheUse("where possible")
CacheUse.EVERY_TASK = CacheUse("every task")


def cache_use(mode: str, device_type: str) -> CacheUse:
    """`--cache MODE` on an evaluation device of type `device_type` ("cuda", "cpu", ...)."""
    if mode == "on":
        return CacheUse.EVERY_TASK
    if mode == "auto" and device_type == "cuda":
        return CacheUse.WHERE_POSSIBLE
    if mode in CACHE_MODES:
        return CacheUse.OFF
    raise MimaError(f"--cache {mode}: expected one of {', '.join(CACHE_MODES)}")


def manifest_entry(use: CacheUse, device_type: str) -> dict[str, str]:
    """What an evaluation's manifest (mima.evaluation.cells) records of the input path: nothing for
    `off` (so evaluations from before the option resume as they were), else the cache use and
    whether the encoder is compiled (on CUDA). A later session of the same --out with another input
    path is then another evaluation, refused in one line: a compiled encoder's features may differ in
    their last bits, and cells of two paths would be published side by side."""
    if use == CacheUse.OFF:
        return {}
    return {"inputs": f"decoded-image cache ({use.value})" + (", compiled encoder" if device_type == "cuda" else "")}
