"""Merge strategies over state dicts, one module each, registered by name.

    from mima.merging import get_method
    merged = get_method("ties")(models, base, lam=1.0)
"""

from mima.merging import (  # noqa: F401  (registration)
    adamerging,
    breadcrumbs,
    cart,
    cart_indexing,
    consensus,
    dare,
    fisher,
    fw_merging,
    regmean,
    tall,
    task_arithmetic,
    ties,
    tsv,
    uniform,
)
from mima.merging.registry import MERGE_METHODS, MergeMethod, get_method

__all__ = ["MERGE_METHODS", "MergeMethod", "get_method"]
