"""AdaMerging: merging coefficients learnt by minimising prediction entropy on unlabelled inputs.

Yang et al. 2024, "AdaMerging: Adaptive Model Merging for Multi-Task Learning",
https://arxiv.org/abs/2310.02575, as the official code (main_task_wise / main_layer_wise):
theta = theta_0 + sum_t lam_t^l tau_t^l, one coefficient per task (`granularity="task"`) or per task
and tensor (`"layer"`: every floating tensor of the image encoder's state dict is a layer),
initialised at `prior` = 0.3 and clamped to [0, 1] in the forward pass. Adam (lr 1e-3) for 500
steps; each step the loss is the sum over tasks of the mean Shannon entropy of the task head's
predictions on two batches of 16 unlabelled inputs, drawn from each task's test split as the paper
does (`adapt_on` can name val or train instead). Labels are never read.

`adamerging_cart` applies the same to CART's centered, rank-reduced vectors (paper 000, eq. 8):
theta = theta_avg + sum_t lam_t^l SVD_r(theta_t - theta_avg), coefficients starting at CART's
lam = 1 and clamped to [0, 3] (the range of CART's lam grid); the low-rank matrices are CART's (the
official code's rule: 2-D, key with `attn` or `mlp` and neither `ln` nor `bias`; `matrix_keys`
overrides it, and a pattern selecting nothing is an error); the other tensors use their full
centered difference.

All T task vectors are held in memory (the optimisation needs them at every step). The notes
returned with the merge: the summed entropy on a fixed probe (2 batches per task) before and after,
and the learnt coefficients (rows: the tensors listed in `layers`, or one row task-wise; columns: tasks).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from mima.core.linalg import low_rank
from mima.merging.cart import cart_matrices, cart_rank
from mima.merging.common import tensor_step, mean_tensor
from mima.merging.pool import Pool
from mima.merging.registry import DataMerge, MergeOutput, floating_keys, register

BATCH_SIZE, BATCHES_PER_TASK = 16, 2


@dataclass
class Adapted:
    coefficients: torch.Tensor  # [layers or 1, T], after clamping
    entropy_before: float
    entropy_after: float


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Mean Shannon entropy of the softmax predictions."""
    return -(logits.softmax(dim=1) * logits.log_softmax(dim=1)).sum(dim=1).mean()


def _unlabelled(pool: Pool, split: str, seed: int) -> dict[str, Iterator]:
    def cycle(task: str):
        epoch = 0
        while True:
            for images, _ in pool.loader(task, split, BATCH_SIZE, shuffle=True, seed=seed + epoch):
                yield images
            epoch += 1

    return {task: cycle(task) for task in pool.tasks}


def combine_weights(anchor, vectors, coefficients, keys, buffer_keys: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    """anchor + sum_t c[l, t] * vector_t for every key (row l of c, or row 0 for task-wise). Buffers
    (BatchNorm's running statistics) take the mean row, detached: they are no parameter to learn a
    coefficient for, and batch_norm refuses running statistics that carry a gradient."""
    weights = dict(anchor)
    for layer, key in enumerate(keys):
        row = coefficients[layer if coefficients.shape[0] > 1 else 0]
        weights[key] = anchor[key] + sum(row[t] * vectors[t][key] for t in range(len(vectors)))
    if buffer_keys:
        mean_row = coefficients.detach().mean(dim=0)
        for key in buffer_keys:
            weights[key] = anchor[key] + sum(mean_row[t] * vectors[t][key] for t in range(len(vectors)))
    return weights


def split_buffers(pool: Pool, keys: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the keys that are the encoder's parameters, the floating buffers among `keys`)."""
    parameters = {name for name, _ in pool.encoder.named_parameters()}
    return [key for key in keys if key in parameters], [key for key in keys if key not in parameters]


def total_entropy(pool: Pool, anchor, vectors, coefficients, keys, batches: dict[str, list],
                  buffer_keys: Sequence[str] = ()) -> torch.Tensor:
    weights = combine_weights(anchor, vectors, coefficients, keys, buffer_keys)
    return sum(entropy(pool.logits(weights, task, images)) for task in pool.tasks for images in batches[task])


def adapt_coefficients(
    pool: Pool, anchor, vectors, keys, granularity: str, steps: int, lr: float, prior: float,
    limits: tuple[float, float], adapt_on: str, seed: int = 0, buffer_keys: Sequence[str] = (),
) -> Adapted:
    rows = len(keys) if granularity == "layer" else 1
    raw = torch.full((rows, len(vectors)), float(prior), requires_grad=True)
    optimizer = torch.optim.Adam([raw], lr=lr, betas=(0.9, 0.999))
    streams = _unlabelled(pool, adapt_on, seed)
    probe = {task: [next(streams[task]) for _ in range(BATCHES_PER_TASK)] for task in pool.tasks}
    with torch.no_grad():
        before = float(total_entropy(pool, anchor, vectors, raw.clamp(*limits), keys, probe, buffer_keys))
    for _ in range(steps):
        batches = {task: [next(streams[task]) for _ in range(BATCHES_PER_TASK)] for task in pool.tasks}
        loss = total_entropy(pool, anchor, vectors, raw.clamp(*limits), keys, batches, buffer_keys)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    coefficients = raw.detach().clamp(*limits)
    with torch.no_grad():
        after = float(total_entropy(pool, anchor, vectors, coefficients, keys, probe, buffer_keys))
    return Adapted(coefficients, before, after)


def notes_of(adapted: Adapted, keys, granularity: str) -> dict[str, object]:
    notes: dict[str, object] = {
        "granularity": granularity,
        "entropy_before": adapted.entropy_before,
        "entropy_after": adapted.entropy_after,
        "coefficients": adapted.coefficients.tolist(),
    }
    if granularity == "layer":
        notes["layers"] = list(keys)
    return notes


def _merge(anchor_state, vectors, keys, adapted: Adapted, buffer_keys: Sequence[str] = ()) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        weights = combine_weights({k: anchor_state[k].float() for k in [*keys, *buffer_keys]}, vectors,
                                  adapted.coefficients, keys, buffer_keys)
    return {key: (weights[key].to(value.dtype) if key in weights else value.clone()) for key, value in anchor_state.items()}


def task_vectors(models: Sequence, base, keys) -> list[dict[str, torch.Tensor]]:
    return [{key: model[key].float() - base[key].float() for key in keys} for model in models]


def adamerging(models, base, pool: Pool, granularity: str, steps: int, lr: float, prior: float, adapt_on: str) -> MergeOutput:
    base_state = {key: base[key] for key in base}
    every_key = floating_keys(base_state)
    keys, buffer_keys = split_buffers(pool, every_key)
    vectors = task_vectors(models, base_state, every_key)
    anchor = {key: base_state[key].float() for key in every_key}
    adapted = adapt_coefficients(pool, anchor, vectors, keys, granularity, steps, lr, prior, (0.0, 1.0), adapt_on,
                                 buffer_keys=buffer_keys)
    return MergeOutput(_merge(base_state, vectors, keys, adapted, buffer_keys), notes_of(adapted, keys, granularity))


def centered_low_rank_vectors(models, rank_ratio: float, matrix_keys: str):
    """(theta_avg, [SVD_r(theta_t - theta_avg) per task]) with full centered differences off the
    matrices (CART's rule, mima.merging.cart.cart_matrix_key, or the pattern `matrix_keys`)."""
    matrices = set(cart_matrices("adamerging_cart", models, matrix_keys))
    average = {key: mean_tensor(models, key) for key in models[0]}
    keys = floating_keys(average)
    vectors = []
    for model in models:
        vector = {}
        for key in keys:
            centered = model[key].float() - average[key].float()
            if key in matrices:
                with tensor_step(key, models):
                    centered = low_rank(centered, cart_rank(centered.shape, rank_ratio))
            vector[key] = centered
        vectors.append(vector)
    return average, keys, vectors


def adamerging_cart(models, base, pool: Pool, granularity: str, steps: int, lr: float, prior: float, adapt_on: str,
                    rank_ratio: float, matrix_keys: str) -> MergeOutput:
    average, every_key, vectors = centered_low_rank_vectors(models, rank_ratio, matrix_keys)
    keys, buffer_keys = split_buffers(pool, every_key)
    anchor = {key: average[key].float() for key in every_key}
    adapted = adapt_coefficients(pool, anchor, vectors, keys, granularity, steps, lr, prior, (0.0, 3.0), adapt_on,
                                 buffer_keys=buffer_keys)
    return MergeOutput(_merge(average, vectors, keys, adapted, buffer_keys), notes_of(adapted, keys, granularity))


register(
    DataMerge(
        name="adamerging",
        data_fn=adamerging,
    )
)
register(
    DataMerge(
        name="adamerging_cart",
        data_fn=adamerging_cart,
    )
)
