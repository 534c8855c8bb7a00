"""Uniform weight averaging: theta = mean_t theta_t.

Model soups, Wortsman et al. 2022, https://arxiv.org/abs/2203.05482; the merge MIMA is built
around (paper 001). Every floating tensor is averaged; integer tensors come from the first model.
"""

from __future__ import annotations

from mima.merging.registry import MergeMethod, register
from mima.core.state_dicts import accumulator


def mean_tensor(models, key: str):
    """The mean over models of one tensor, accumulated in float32 or wider, in the input dtype."""
    first = models[0][key]
    if not first.is_floating_point():
        return first.clone()
    total = accumulator(first)
    total += first
    for model in models[1:]:
        total += model[key]
    return (total / len(models)).to(first.dtype)


def uniform(models, base=None):
    for key in models[0]:
        yield key, mean_tensor(models, key)


register(
    MergeMethod(
        name="uniform",
        paper="https://arxiv.org/abs/2203.05482",
        summary="element-wise mean of the fine-tuned models",
        needs_base=False,
        stream_fn=uniform,
    )
)
