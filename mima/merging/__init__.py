"""Merge strategies over state dicts, one module each, registered by name.

    from mima.merging import get_method
    merged = get_method("ties")(models, base, lam=1.0)                  # a state dict
    output = get_method("adamerging").merge(models, base, pool=pool)     # MergeOutput(state, notes)
    get_method("tsv").check(models, base, matrix_keys="attn")            # the refusals alone (every merge runs them)

Modules here import only mima.core and mima.merging; data-dependent strategies are given a task pool
(mima.pools.TaskPool, or any object of the shape mima.merging.pool.Pool).

Importing the package itself imports nothing: the command line reads mima.merging.catalogue (names
and hyperparameters, no torch) to build its help. The names below load the registry and every
strategy (mima.merging.registry.load_strategies) when first used.
"""

from __future__ import annotations

import importlib

_REGISTRY_NAMES = ("HYPERPARAMETERS", "MERGE_METHODS", "Hyperparameter", "MergeMethod", "MergeOutput", "get_method",
                   # the kinds of merge method (mima.merging.registry)
                   "DataFreeMerge", "StreamingMerge", "ScaledMerge", "PerTaskMerge", "DataMerge")

__all__ = [*_REGISTRY_NAMES, "Pool"]


def __getattr__(name: str) -> object:
    if name == "Pool":
        return importlib.import_module("mima.merging.pool").Pool
    if name in _REGISTRY_NAMES:
        registry = importlib.import_module("mima.merging.registry")
        registry.load_strategies()
        return getattr(registry, name)
    raise AttributeError(f"module 'mima.merging' has no attribute {name!r}")
