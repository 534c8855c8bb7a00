"""Merge strategies over state dicts, one module each, registered by name.

    from mima.merging import get_method
    merged = get_method("ties")(models, base, lam=1.0)                  # a state dict
    output = get_method("adamerging").merge(models, base, pool=pool)     # MergeOutput(state, notes)
    get_method("tsv").check(models, base, matrix_keys="attn")            # the refusals alone (every merge runs them)

Modules here import only mima.core and mima.merging; data-dependent strategies are given a task pool
(mima.pools.TaskPool, or any object of the shape mima.merging.pool.Pool).
"""

from mima.merging import (  # noqa: F401  (registration)
    ace,
    adamerging,
    breadcrumbs,
    cart,
    cart_indexing,
    consensus,
    dare,
    della,
    emr,
    fisher,
    fw_merging,
    iso_c,
    iso_cts,
    lines,
    magmax,
    model_stock,
    regmean,
    regmean_plus_plus,
    svc,
    tall,
    task_arithmetic,
    ties,
    tsv,
    uniform,
    wudi,
)
from mima.merging.pool import Pool
from mima.merging.registry import HYPERPARAMETERS, MERGE_METHODS, Hyperparameter, MergeMethod, MergeOutput, get_method

__all__ = ["HYPERPARAMETERS", "MERGE_METHODS", "Hyperparameter", "MergeMethod", "MergeOutput", "Pool", "get_method"]
