"""What mima computes once and caches for every later run (the embedded models' pretraining, the
zero-shot and linear-probe heads) is computed on a fixed number of torch threads.

A reduction that torch splits across threads adds its parts in an order that depends on the thread
count, so a model pretrained with one thread differs in its last bits from one pretrained with two,
and every fine-tuning result built on it moves a little (the README's demo table differed in 2 of
32 cells between machines). With the count fixed, the cache holds the same bytes whatever the
machine's cores or the caller's `threads_per_process` (on the same kind of CPU: another instruction
set can still round differently). Two threads: what the reference numbers were made with, and as
fast as one on a busy machine.
"""

from __future__ import annotations

from mima.core.threads import intra_op_threads

CACHE_BUILD_THREADS = 2


def fixed_threads(count: int = CACHE_BUILD_THREADS):
    """torch computes on `count` intra-op threads inside the block; the caller's count is restored after."""
    return intra_op_threads(count)
