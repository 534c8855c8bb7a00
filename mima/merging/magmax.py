"""MagMax: per entry, the task-vector value of largest magnitude; theta = theta_0 + lam * that.

Marczak et al. 2024, "MagMax: Leveraging Model Merging for Seamless Continual Learning",
https://arxiv.org/abs/2407.06322, as FusionBench's `magmax` (fusion_bench/method/magmax/magmax.py)
and the authors' `merge_max_abs` (github.com/danielm1405/magmax, src/merging/task_vectors.py):
  * tau_max[j] = tau_{t*}[j] with t* = argmax_t |tau_t[j]|, folded over the tasks in order with
    `>=`, so on equal magnitudes the later task wins;
  * every floating tensor follows this rule (matrices, biases, norms, embeddings); integer tensors
    come from theta_0.
lam = 0.5 without validation (the authors' 8-dataset script and FusionBench's default). The
authors' script also holds a search over 0.05, 0.1, .., 1.0 (np.linspace(0, 1, 21)[1:], commented
out in the released version); that is mima's validation grid.
Streams one key at a time.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mima.merging.registry import ScaledMerge, register


def max_magnitude(taus: Iterable[torch.Tensor]) -> torch.Tensor:
    """Entry-wise the tau_t of largest |tau_t|, holding one task vector at a time; a later task
    replaces the current choice when its magnitude is greater than or equal to it."""
    iterator = iter(taus)
    chosen = next(iterator).clone()
    for tau in iterator:
        chosen = torch.where(tau.abs() >= chosen.abs(), tau, chosen)
    return chosen


def magmax(models, base):
    """(key, theta_0, tau_max or None) per key, reading one task vector of the key at a time."""
    for key in base:
        anchor = base[key]
        if not anchor.is_floating_point():
            yield key, anchor, None
            continue
        reference = anchor.float()
        yield key, anchor, max_magnitude(model[key].float() - reference for model in models)


register(
    ScaledMerge(
        name="magmax",
        scaled_fn=magmax,
        entrywise=True,
    )
)
