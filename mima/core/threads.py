"""torch's intra-op thread count, set for a while and then restored: the merge engine computes on one
core fewer beside its reader, and what mima caches is computed on a fixed count (mima.models.fixed_threads)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def intra_op_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to `count` inside the block (unchanged for None), then restored."""
    if count is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
