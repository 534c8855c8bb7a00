"""Uniform weight averaging: theta = mean_t theta_t.

Model soups, Wortsman et al. 2022, https://arxiv.org/abs/2203.05482; the merge MIMA is built
around (paper 001). Every floating tensor is averaged; integer tensors come from the first model.
"""

from __future__ import annotations

from mima.merging.common import mean_tensor
from mima.merging.registry import StreamingMerge, register


def uniform(models, base=None):
    for key in models[0]:
        yield key, mean_tensor(models, key)


register(
    StreamingMerge(
        name="uniform",
        stream_fn=uniform,
        entrywise=True,
    )
)
