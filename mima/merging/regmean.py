"""RegMean: merge each linear layer by the least-squares fit to all models' outputs on their data.

Jin et al. 2023, "Dataless Knowledge Fusion by Merging Weights of Language Models",
https://arxiv.org/abs/2212.09849, as the official code and FusionBench: for every nn.Linear module
whose forward runs, the Gram matrix of its inputs G_t = X_t^T X_t / rows is collected on
`examples` training examples of task t (model t, head t; all tokens are rows); off-diagonal entries
are scaled by `alpha`; W* = (sum_t G_t)^-1 sum_t G_t W_t^T, transposed back. Everything else
(biases, norms, embeddings, and linear weights whose module never runs its own forward, such as
nn.MultiheadAttention's in_proj and out_proj in open_clip, which it applies functionally) is
averaged. Defaults: 256 examples per task, alpha 0.6 (FusionBench's CLIP settings). Notes: the
weights merged by RegMean (`linear_layers`).
"""

from __future__ import annotations

import torch
from torch import nn

from mima.core.linalg import solve
from mima.merging.common import tensor_step, mean_tensor
from mima.merging.pool import Pool
from mima.merging.registry import DataMerge, MergeOutput, register


def input_grams(pool: Pool, weights, task: str, examples: int) -> dict[str, torch.Tensor]:
    """Mean outer products of the inputs of each nn.Linear that runs, keyed by its weight's name; the
    forward passes in float32 whatever the models' dtype (float16 or bfloat16 files), as the encoder's."""
    weights = {key: value.float() if value.is_floating_point() else value for key, value in weights.items()}
    grams: dict[str, torch.Tensor] = {}
    rows: dict[str, int] = {}
    handles = []
    for name, module in pool.encoder.named_modules():
        if isinstance(module, nn.Linear):
            key = f"{name}.weight" if name else "weight"  # the encoder itself may be the nn.Linear

            def hook(module, inputs, output, key=key):
                x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
                grams[key] = grams.get(key, 0) + x.T @ x
                rows[key] = rows.get(key, 0) + x.shape[0]

            handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            for images, _ in pool.examples(task, "train", examples):
                pool.logits(weights, task, images)
    finally:
        for handle in handles:
            handle.remove()
    return {key: gram / rows[key] for key, gram in grams.items()}


def reduce_off_diagonal(gram: torch.Tensor, alpha: float) -> torch.Tensor:
    scale = torch.full_like(gram, alpha)
    scale.fill_diagonal_(1.0)
    return gram * scale


def regmean_weight(grams: list[torch.Tensor], weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """W* = (sum_t G_t)^-1 sum_t G_t W_t^T, transposed back, with off-diagonals scaled by alpha (float32).

    A singular sum (an input feature the examples never excite, say activations that underflow) is
    solved in float64, then with mima.core.linalg's ridge toward the average weight: a direction the
    data say nothing about keeps the average, as RegMean keeps it for what it cannot fit."""
    reduced = [reduce_off_diagonal(gram, alpha) for gram in grams]
    rhs = sum(gram @ weight.float().T for gram, weight in zip(reduced, weights))
    average = sum(weight.float().T for weight in weights) / len(weights)
    return solve(sum(reduced), rhs, prior=average).T.contiguous()


def regmean(models, base, pool: Pool, examples: int, alpha: float) -> MergeOutput:
    grams = [input_grams(pool, {key: model[key] for key in model}, task, examples) for model, task in zip(models, pool.tasks)]
    linear = set.intersection(*(set(g) for g in grams)) if grams else set()
    merged = {}
    for key in models[0]:
        if key not in linear:
            merged[key] = mean_tensor(models, key)
            continue
        with tensor_step(key, models):
            weight = regmean_weight([g[key] for g in grams], [model[key] for model in models], alpha)
        merged[key] = weight.to(models[0][key].dtype)
    return MergeOutput(merged, {"linear_layers": sorted(linear)})


register(
    DataMerge(
        name="regmean",
        data_fn=regmean,
    )
)
