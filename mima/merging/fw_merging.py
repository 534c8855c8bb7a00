"""FW-Merging: Frank-Wolfe over the convex hull of the checkpoints.

Chen et al. 2025, "FW-Merging: Scaling Model Merging with Frank-Wolfe Optimization",
https://arxiv.org/abs/2503.12649 (paper 002, appendix), as the official vision code (fw_hard, fw_soft):

hard (`mode="hard"`): start from an initial merge (`start`): AdaMerging for vision as the paper
  (layer-wise, prior 0.3, on the test split, `ada_steps` Adam steps at `lr`), or task arithmetic
  theta_0 + lam * sum_t tau_t (the official code's start, scaled by the same lam), or theta_0.
  Each iteration t computes the gradient g of the cross-entropy (true labels) on `examples`
  calibration examples per task (train split), summed over tasks; the linear minimisation oracle
  picks, among the fine-tuned models and the initial merge, the vertex s with the smallest sum over
  tensors of cos(g_p, s_p) (the vertex most aligned with -g); then theta <- theta + gamma (s - theta)
  with gamma = 2 / (t + 2) * step_size * lam.
  Uses: iterations, step_size, lam, examples, start, and ada_steps and lr when start is adamerging.
soft (`mode="soft"`): start from theta_0 (the paper's vision setting). Each iteration, every task's
  own gradient picks its best vertex (no vertex twice); the coefficients of the chosen vertices'
  differences s_j - theta are then learnt layer-wise by AdaMerging (`ada_steps` Adam steps at `lr`
  on the prediction entropy of test inputs, starting at 0.3 in the first iteration and 1e-8
  afterwards, unclamped, as the official code), and theta moves there.
  Uses: iterations, examples, ada_steps, lr. step_size, lam and start are hard-mode options: giving
  one with mode="soft" is an error (the official soft code's AdaMerging step uses none of them).
Defaults: mode hard; iterations follow the mode when not given: 3 for hard, 15 for soft (paper
002, appendix: on vision tasks FW_hard runs 3 iterations from the AdaMerging merge, FW_soft 15
from the pre-trained model; ITERATIONS); start adamerging, step_size 0.1, lam 0.3, 100 examples
per task, ada_steps 500, lr 1e-3. The registry's `defaults["iterations"]` holds hard mode's 3 (the
declared default mode); a given `iterations` (`mima merge --iterations`) applies to either mode.

Notes returned with the merge: the mode, each iteration's chosen vertex (hard, with every vertex's
score) or vertices and learnt coefficients (soft), and the AdaMerging start's notes (hard).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from mima.merging.adamerging import adapt_coefficients, adamerging, combine_weights, notes_of
from mima.merging.catalogue import ITERATIONS
from mima.merging.pool import Pool
from mima.merging.registry import DataMerge, MergeOutput, floating_keys, register
from mima.merging.task_arithmetic import task_arithmetic

CANDIDATE_INITIAL = "initial merge"


def calibration_gradient(pool: Pool, weights: dict[str, torch.Tensor], keys, tasks, examples: int) -> dict[str, torch.Tensor]:
    """Gradient of the mean cross-entropy (true labels) over `examples` train examples of each task,
    divided by the number of tasks (as the official code scales it)."""
    params = {key: weights[key].detach().float().requires_grad_(True) for key in keys}
    full = {**weights, **params}
    gradient = {key: torch.zeros_like(value) for key, value in params.items()}
    for task in tasks:
        for images, labels in pool.examples(task, "train", examples):
            loss = F.cross_entropy(pool.logits(full, task, images), labels, reduction="sum") / (examples * len(tasks))
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


SOFT_PRIOR_FIRST, SOFT_PRIOR_LATER = 0.3, 1e-8  # the official fw_soft's initial AdaMerging coefficients
START_PRIOR = 0.3  # the AdaMerging start: layer-wise, from 0.3, on the test split (the paper's setting)


def _float_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.float() if value.is_floating_point() else value for key, value in state.items()}


def _initial(models, base, pool: Pool, start: str, lam: float, ada_steps: int | None, lr: float | None):
    """(initial merge in float32, notes of its AdaMerging or None)."""
    state = {key: base[key] for key in base}
    if start == "pretrained":
        return _float_state(state), None
    if start == "task_arithmetic":
        return {key: a if d is None else a.float() + lam * d for key, a, d in task_arithmetic(models, state)}, None
    output = adamerging(models, state, pool, granularity="layer", steps=ada_steps, lr=lr, prior=START_PRIOR, adapt_on="test")
    return _float_state(output.state), output.notes


def fw_hard(models, base, pool: Pool, iterations: int, step_size: float, lam: float, examples: int, start: str,
            ada_steps: int | None = None, lr: float | None = None) -> MergeOutput:
    """Hard FW; `ada_steps` and `lr` are those of the AdaMerging start (only with start="adamerging")."""
    if start == "adamerging" and (ada_steps is None or lr is None):
        raise ValueError("fw_hard with start='adamerging' needs ada_steps and lr")
    keys = floating_keys({key: base[key] for key in base})
    theta, start_notes = _initial(models, base, pool, start, lam, ada_steps, lr)
    vertices = [{key: model[key].float() for key in keys} for model in models]
    vertices.append({key: theta[key].clone() for key in keys})
    names = [*pool.tasks, CANDIDATE_INITIAL]
    chosen = []
    for t in range(iterations):
        gradient = calibration_gradient(pool, theta, keys, pool.tasks, examples)
        scores = vertex_scores(gradient, vertices)
        pick = min(range(len(vertices)), key=scores.__getitem__)
        gamma = 2.0 / (t + 2) * step_size * lam
        chosen.append({"iteration": t, "vertex": names[pick], "scores": scores, "gamma": gamma})
        for key in keys:
            theta[key] = theta[key] + gamma * (vertices[pick][key] - theta[key])
    notes: dict[str, object] = {"mode": "hard", "start": start, "steps": chosen}
    if start_notes is not None:
        notes["start_adamerging"] = start_notes
    return MergeOutput(_finish(theta, base), notes)


def fw_soft(models, base, pool: Pool, iterations: int, examples: int, ada_steps: int, lr: float) -> MergeOutput:
    keys = floating_keys({key: base[key] for key in base})
    theta = _float_state({key: base[key] for key in base})
    vertices = [{key: model[key].float() for key in keys} for model in models]
    chosen = []
    for t in range(iterations):
        picks: list[int] = []
        for task in pool.tasks:
            gradient = calibration_gradient(pool, theta, keys, [task], examples)
            scores = vertex_scores(gradient, vertices)
            for index in sorted(range(len(vertices)), key=scores.__getitem__):
                if index not in picks:
                    picks.append(index)
                    break
        anchor = {key: theta[key].detach() for key in keys}
        directions = [{key: vertices[p][key] - anchor[key] for key in keys} for p in picks]
        adapted = adapt_coefficients(
            pool, anchor, directions, keys, "layer", ada_steps, lr, SOFT_PRIOR_FIRST if t == 0 else SOFT_PRIOR_LATER,
            (float("-inf"), float("inf")), "test", seed=t,
        )
        with torch.no_grad():
            theta.update(combine_weights(anchor, directions, adapted.coefficients, keys))
        step = notes_of(adapted, keys, "layer")
        chosen.append({"iteration": t, "vertices": [pool.tasks[p] for p in picks], **step})
    return MergeOutput(_finish(theta, base), {"mode": "soft", "steps": chosen})


def _finish(theta, base):
    return {key: (theta[key].detach().to(base[key].dtype) if base[key].is_floating_point() else base[key].clone()) for key in base}


def used_hyperparameters(values: Mapping[str, object]) -> set[str]:
    """The hyperparameters that `values`' mode (and start) use."""
    if values["mode"] == "soft":
        return {"mode", "iterations", "examples", "ada_steps", "lr"}
    used = {"mode", "iterations", "step_size", "lam", "examples", "start"}
    if values["start"] == "adamerging":
        used |= {"ada_steps", "lr"}
    return used


def fw_merging(models, base, pool: Pool, mode: str, **values) -> MergeOutput:
    """`values` are exactly the hyperparameters `mode` uses (see used_hyperparameters)."""
    if mode == "hard":
        return fw_hard(models, base, pool, **values)
    return fw_soft(models, base, pool, **values)


class FrankWolfeMerge(DataMerge):
    """FW-Merging's DataMerge: its mode (and start) decide which hyperparameters it uses, and its
    `iterations`, when not given, is the mode's default (ITERATIONS); every other rule (checks, unknown
    and unused hyperparameters) is the registry's."""

    def used(self, values: Mapping[str, object]) -> set[str]:
        return used_hyperparameters(values)

    def hyperparameters(self, given: Mapping[str, object], *args, **kwargs) -> dict[str, object]:
        values = super().hyperparameters(given, *args, **kwargs)
        if "iterations" not in given:
            values["iterations"] = ITERATIONS[values["mode"]]
        return values


register(
    FrankWolfeMerge(
        name="fw_merging",
        data_fn=fw_merging,
    )
)
