"""Task arithmetic: theta = theta_0 + lam * sum_t (theta_t - theta_0).

Ilharco et al. 2023, "Editing models with task arithmetic", https://arxiv.org/abs/2212.04089.
lam is searched over 0, 0.05, ..., 1.0 on validation data (paper 001, section 5); 0.4 without
validation. Every floating tensor (matrices, biases, norms, embeddings) follows the same rule;
integer tensors come from theta_0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mima.merging.registry import MergeMethod, register
from mima.core.state_dicts import accumulator

# transform(task index, key, tau) -> the tensor that enters the sum (DARE drops, Breadcrumbs masks)
Transform = Callable[[int, str, torch.Tensor], torch.Tensor]


def task_vectors_by_key(models, base):
    """(key, theta_0, [tau_t in float32] or None for integer tensors), one key of `base` at a time."""
    for key in base:
        anchor = base[key]
        if not anchor.is_floating_point():
            yield key, anchor, None
            continue
        yield key, anchor, [model[key].float() - anchor.float() for model in models]


def summed_task_vectors(models, base, transform: Transform | None = None):
    """(key, theta_0, sum_t transform(tau_t) or None) per key, accumulated one task at a time."""
    for key in base:
        anchor = base[key]
        if not anchor.is_floating_point():
            yield key, anchor, None
            continue
        total = accumulator(anchor)
        reference = anchor.to(total.dtype)
        for index, model in enumerate(models):
            tau = model[key] - reference
            total += transform(index, key, tau) if transform is not None else tau
        yield key, anchor, total


def task_arithmetic(models, base):
    """(key, theta_0, sum of task vectors) per key."""
    return summed_task_vectors(models, base)


register(
    MergeMethod(
        name="task_arithmetic",
        paper="https://arxiv.org/abs/2212.04089",
        summary="pretrained model plus lam times the sum of task vectors",
        needs_base=True,
        defaults={"lam": 0.4},
        grid={"lam": tuple(round(0.05 * i, 2) for i in range(21))},
        scaled_fn=task_arithmetic,
    )
)
