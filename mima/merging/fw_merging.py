"""FW-Merging: Frank-Wolfe over the convex hull of the checkpoints.

Chen et al. 2025, "FW-Merging: Scaling Model Merging with Frank-Wolfe Optimization",
https://arxiv.org/abs/2503.12649 (paper 002, appendix), as the official vision code (fw_hard, fw_soft):

hard (`mode="hard"`): start from an initial merge (`start`: AdaMerging for vision, as the paper;
  or task arithmetic, or theta_0). Each iteration t computes the gradient g of the cross-entropy
  (true labels) on `examples` calibration examples per task (train split), summed over tasks; the
  linear minimisation oracle picks, among the fine-tuned models and the initial merge, the vertex
  s with the smallest sum over tensors of cos(g_p, s_p) (the vertex most aligned with -g); then
  theta <- theta + gamma (s - theta) with gamma = 2 / (t + 2) * step_size * lam.
soft (`mode="soft"`): start from theta_0. Each iteration, every task's own gradient picks its
  best vertex (no vertex twice); the coefficients of the chosen vertices' differences s_j - theta
  are then learnt layer-wise by AdaMerging (`ada_steps` Adam steps on the prediction entropy,
  starting at 0.3 in the first iteration and 1e-8 afterwards, unclamped), and theta moves there.
Defaults: hard 3 iterations, soft 10; step_size 0.1, lam 0.3, 100 examples per task.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mima.merging.adamerging import adapt_coefficients, adamerging, combine_weights
from mima.merging.registry import MergeMethod, floating_keys, register
from mima.merging.task_arithmetic import task_arithmetic

CANDIDATE_INITIAL = "initial merge"


def calibration_gradient(context, weights: dict[str, torch.Tensor], keys, tasks, examples: int) -> dict[str, torch.Tensor]:
    """Gradient of the mean cross-entropy (true labels) over `examples` train examples of each task,
    divided by the number of tasks (as the official code scales it)."""
    params = {key: weights[key].detach().float().requires_grad_(True) for key in keys}
    full = {**weights, **params}
    gradient = {key: torch.zeros_like(value) for key, value in params.items()}
    for task in tasks:
        for images, labels in context.examples(task, "train", examples):
            loss = F.cross_entropy(context.logits(full, task, images), labels, reduction="sum") / (examples * len(tasks))
            for key, grad in zip(params, torch.autograd.grad(loss, list(params.values()))):
                gradient[key] += grad
    return gradient


def vertex_scores(gradient: dict[str, torch.Tensor], candidates: list[dict[str, torch.Tensor]]) -> list[float]:
    """For each candidate: sum over tensors of cos(gradient_p, candidate_p). The smallest is the
    candidate most aligned with the negative gradient."""
    scores = []
    for candidate in candidates:
        total = 0.0
        for key, grad in gradient.items():
            total += float(F.cosine_similarity(grad.reshape(1, -1), candidate[key].float().reshape(1, -1), eps=1e-12))
        scores.append(total)
    return scores


def _initial(models, base, context, start: str, examples: int):
    state = {key: base[key] for key in base}
    if start == "pretrained":
        return {key: value.float() if value.is_floating_point() else value for key, value in state.items()}
    if start == "task_arithmetic":
        merged = {key: a if d is None else a.float() + 0.3 * d for key, a, d in task_arithmetic(models, state)}
        return merged
    merged = adamerging(models, state, context, granularity="layer", steps=500, lr=1e-3, prior=0.3, adapt_on="test")
    return {key: value.float() if value.is_floating_point() else value for key, value in merged.items()}


def fw_hard(models, base, context, iterations, step_size, lam, examples, start):
    keys = floating_keys({key: base[key] for key in base})
    theta = _initial(models, base, context, start, examples)
    vertices = [{key: model[key].float() for key in keys} for model in models]
    vertices.append({key: theta[key].clone() for key in keys})
    names = [*context.tasks, CANDIDATE_INITIAL]
    chosen = []
    for t in range(iterations):
        gradient = calibration_gradient(context, theta, keys, context.tasks, examples)
        scores = vertex_scores(gradient, vertices)
        pick = min(range(len(vertices)), key=scores.__getitem__)
        chosen.append({"iteration": t, "vertex": names[pick], "scores": scores})
        gamma = 2.0 / (t + 2) * step_size * lam
        for key in keys:
            theta[key] = theta[key] + gamma * (vertices[pick][key] - theta[key])
    context.notes["fw_merging"] = {"mode": "hard", "start": start, "steps": chosen}
    return _finish(theta, base)


def fw_soft(models, base, context, iterations, examples, ada_steps, lr):
    keys = floating_keys({key: base[key] for key in base})
    theta = _initial(models, base, context, "pretrained", examples)
    vertices = [{key: model[key].float() for key in keys} for model in models]
    chosen = []
    for t in range(iterations):
        picks: list[int] = []
        for task in context.tasks:
            gradient = calibration_gradient(context, theta, keys, [task], examples)
            scores = vertex_scores(gradient, vertices)
            for index in sorted(range(len(vertices)), key=scores.__getitem__):
                if index not in picks:
                    picks.append(index)
                    break
        anchor = {key: theta[key].detach() for key in keys}
        directions = [{key: vertices[p][key] - anchor[key] for key in keys} for p in picks]
        adapted = adapt_coefficients(
            context, anchor, directions, keys, "layer", ada_steps, lr, 0.3 if t == 0 else 1e-8,
            (float("-inf"), float("inf")), "test", seed=t,
        )
        with torch.no_grad():
            theta.update(combine_weights(anchor, directions, adapted.coefficients, keys))
        chosen.append({"iteration": t, "vertices": [context.tasks[p] for p in picks], "entropy_after": adapted.entropy_after})
    context.notes["fw_merging"] = {"mode": "soft", "steps": chosen}
    return _finish(theta, base)


def _finish(theta, base):
    return {key: (theta[key].detach().to(base[key].dtype) if base[key].is_floating_point() else base[key].clone()) for key in base}


def fw_merging(models, base, context, mode, iterations, step_size, lam, examples, start, ada_steps, lr):
    if mode == "hard":
        return fw_hard(models, base, context, iterations, step_size, lam, examples, start)
    return fw_soft(models, base, context, iterations, examples, ada_steps, lr)


register(
    MergeMethod(
        name="fw_merging",
        paper="https://arxiv.org/abs/2503.12649",
        summary="Frank-Wolfe over the checkpoints' convex hull (hard: one vertex per step; soft: AdaMerging over chosen vertices)",
        needs_base=True,
        defaults={"mode": "hard", "iterations": 3, "step_size": 0.1, "lam": 0.3, "examples": 100,
                  "start": "adamerging", "ada_steps": 500, "lr": 1e-3},
        data_fn=fw_merging,
    )
)
