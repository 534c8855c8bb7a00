"""Whether two input files hold the same bytes: the same file under two names (a symlink, a hard link,
another spelling of the path) or a copy. A merge given one model twice would weigh it twice without a
word, so its inputs are compared before any work.

Files of different sizes differ. Of equal sizes, the same inode means the same file; otherwise a few
evenly spread blocks are compared first (two fine-tuned models differ in nearly every block, so this
settles the common case in microseconds), and only files whose sampled blocks all agree are compared in
full, so a "same" answer is always exact.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

SAMPLED_BLOCKS = 64
BLOCK_BYTES = 4096
FULL_COMPARE_CHUNK = 1 << 24  # 16 MiB per read when files are compared in full


def first_duplicate(paths: Sequence[Path]) -> tuple[int, int] | None:
    """(i, j), i < j, of the first pair of `paths` that hold the same bytes; None when all differ."""
    stats = [os.stat(path) for path in paths]
    for j in range(len(paths)):
        for i in range(j):
            if stats[i].st_size == stats[j].st_size and same_bytes(paths[i], paths[j], stats[i], stats[j]):
                return i, j
    return None


def same_bytes(first: Path, second: Path, first_stat: os.stat_result, second_stat: os.stat_result) -> bool:
    """Whether two files of the same size hold the same bytes (exact)."""
    if (first_stat.st_dev, first_stat.st_ino) == (second_stat.st_dev, second_stat.st_ino):
        return True
    size = first_stat.st_size
    with open(first, "rb") as a, open(second, "rb") as b:
        step = max(size // SAMPLED_BLOCKS, 1)
        for offset in range(0, size, step):
            if os.pread(a.fileno(), BLOCK_BYTES, offset) != os.pread(b.fileno(), BLOCK_BYTES, offset):
                return False
        while True:
            chunk = a.read(FULL_COMPARE_CHUNK)
            if chunk != b.read(FULL_COMPARE_CHUNK):
                return False
            if not chunk:
                return True
