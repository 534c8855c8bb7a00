"""Task arithmetic: theta = theta_0 + lam * sum_t (theta_t - theta_0).

Ilharco et al. 2023, "Editing models with task arithmetic", https://arxiv.org/abs/2212.04089.
lam is searched over 0, 0.05, ..., 1.0 on validation data (paper 001, section 5); 0.4 without
validation. Every floating tensor (matrices, biases, norms, embeddings) follows the same rule;
integer tensors come from theta_0.
"""

from __future__ import annotations

from mima.merging.common import summed_task_vectors
from mima.merging.registry import ScaledMerge, register

def task_arithmetic(models, base):
    """(key, theta_0, sum of task vectors) per key."""
    return summed_task_vectors(models, base)


register(
    ScaledMerge(
        name="task_arithmetic",
        scaled_fn=task_arithmetic,
        entrywise=True,
    )
)
