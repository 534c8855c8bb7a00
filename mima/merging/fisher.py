"""Fisher merging: a per-parameter weighted average, weights from each model's diagonal Fisher.

Matena & Raffel 2022, "Merging Models with Fisher-Weighted Averaging", https://arxiv.org/abs/2111.09832,
as the official code: for task t, on `examples` training examples of that task and with the task's
own head, F_t = (1/n) sum_x sum_c p_t(c|x) (d log p_t(c|x) / d theta)^2, the exact expectation under
the model's predicted distribution (one backward pass per example and class; labels are not used).
theta = sum_t w_t (F_t + 1e-6) theta_t / sum_t w_t (F_t + 1e-6) with w_t = 1 / ||F_t|| (the official
normalize_fishers), for every trainable tensor; other floating tensors (buffers) are averaged.
Default 256 examples per task (FusionBench's CLIP setting; the paper used 4096). Notes: each task's
Fisher norm ||F_t|| (the inverse of its weight w_t).
"""

from __future__ import annotations

import torch

from mima.merging.common import mean_tensor
from mima.merging.pool import Pool
from mima.merging.registry import DataMerge, MergeOutput, floating_keys, register

FISHER_FLOOR = 1e-6


def diagonal_fisher(pool: Pool, weights: dict[str, torch.Tensor], keys, task: str, examples: int) -> dict[str, torch.Tensor]:
    params = {key: weights[key].detach().float().requires_grad_(True) for key in keys}
    full = {**weights, **params}
    fisher = {key: torch.zeros_like(value) for key, value in params.items()}
    seen = 0
    for images, _ in pool.examples(task, "train", examples, batch_size=1):
        log_probs = pool.logits(full, task, images).log_softmax(dim=1)[0]
        probs = log_probs.exp().detach()
        for c in range(log_probs.shape[0]):
            grads = torch.autograd.grad(log_probs[c], list(params.values()), retain_graph=c < log_probs.shape[0] - 1)
            for key, grad in zip(params, grads):
                fisher[key] += probs[c] * grad.pow(2)
        seen += 1
    return {key: value / max(seen, 1) for key, value in fisher.items()}


def fisher_merging(models, base, pool: Pool, examples: int) -> MergeOutput:
    trainable = {name for name, p in pool.encoder.named_parameters()}
    keys = [key for key in floating_keys(models[0]) if key in trainable]
    weighted = {key: torch.zeros_like(models[0][key], dtype=torch.float32) for key in keys}
    totals = {key: torch.zeros_like(models[0][key], dtype=torch.float32) for key in keys}
    norms = []
    for model, task in zip(models, pool.tasks):
        weights = {key: model[key] for key in model}
        fisher = diagonal_fisher(pool, weights, keys, task, examples)
        norm = float(torch.sqrt(sum(value.pow(2).sum() for value in fisher.values())))
        norms.append(norm)
        scale = 1.0 / max(norm, 1e-12)
        for key in keys:
            factor = scale * (fisher[key] + FISHER_FLOOR)
            weighted[key] += factor * model[key].float()
            totals[key] += factor
    merged = {}
    for key in models[0]:
        if key in weighted:
            merged[key] = (weighted[key] / totals[key]).to(models[0][key].dtype)
        else:
            merged[key] = mean_tensor(models, key)
    return MergeOutput(merged, {"fisher_norms": dict(zip(pool.tasks, norms))})


register(
    DataMerge(
        name="fisher",
        data_fn=fisher_merging,
    )
)
