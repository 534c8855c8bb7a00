"""Merge strategies over state dicts, one module each, registered by name.

    from mima.merging import get_method
    merged = get_method("ties")(models, base, lam=1.0)
"""

from mima.merging import cart, task_arithmetic, ties, uniform  # noqa: F401  (registration)
from mima.merging.registry import MERGE_METHODS, MergeMethod, get_method

__all__ = ["MERGE_METHODS", "MergeMethod", "get_method"]
