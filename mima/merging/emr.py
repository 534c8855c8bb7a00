"""EMR-Merging: one elected task vector, plus a mask and a rescaler per task (one model per task).

Huang et al. 2024, "EMR-Merging: Tuning-Free High-Performance Model Merging",
https://arxiv.org/abs/2405.17461, as FusionBench's implementation (fusion_bench/method/emr_merging,
utils.emr_merge), over every floating tensor (integer tensors come from theta_0):
  Elect:   gamma = sign(sum_t tau_t), where a sum of exactly 0 counts as -1 (FusionBench's sign);
           tau_uni = gamma * max_t |tau_t| over the entries of tau_t that agree with gamma (0 if none);
  Mask:    M_t = (tau_t * gamma > 0);
  Rescale: r_t = sum over tensors of mean|tau_t| / sum over tensors of mean|M_t * tau_uni|
           (each tensor's mean counts once, whatever its size, as the reference sums per-tensor means);
  task t's model: theta_0 + r_t * M_t * tau_uni.
One deliberate difference: when M_t * tau_uni is zero everywhere (task t agrees with no elected
sign, or its task vector is zero), the reference divides by zero and its model turns NaN; here
r_t = 0, so task t gets theta_0 back. EMR has no hyperparameters (the paper's point: tuning-free).

Index keys: `base/<key>` (theta_0), `unified/<key>` (tau_uni, float32), `task<i>/<key>/mask` (M_t,
bit-packed as TALL's masks; the shape comes from `base/<key>`), `task<i>/rescaler` (r_t, one float32).
Built in one pass over the keys, holding one key's task vectors at a time.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mima.core.linalg import require_finite
from mima.merging.common import indexed_task_vectors, pack, reconstruct_masked, tensor_step
from mima.merging.registry import PerTaskMerge, register


def elect(taus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gamma, tau_uni, masks) for stacked task vectors [T, ...]; gamma is +1 where the sum is > 0, else -1."""
    gamma = torch.where(taus.sum(dim=0) > 0, 1.0, -1.0)
    masks = taus * gamma > 0
    largest_agreeing = (taus.abs() * masks).amax(dim=0)
    return gamma, gamma * largest_agreeing, masks


def rescalers(task_means: torch.Tensor, masked_means: torch.Tensor) -> torch.Tensor:
    """r_t = task_means_t / masked_means_t, and 0 where task t keeps nothing of tau_uni."""
    safe = torch.where(masked_means > 0, masked_means, torch.ones_like(masked_means))
    return torch.where(masked_means > 0, task_means / safe, torch.zeros_like(task_means))


def emr_index(models, base) -> dict[str, torch.Tensor]:
    tasks = len(models)
    task_means = torch.zeros(tasks, dtype=torch.float64)  # sum over tensors of mean|tau_t| (on the CPU)
    masked_means = torch.zeros(tasks, dtype=torch.float64)  # sum over tensors of mean|M_t * tau_uni|
    index: dict[str, torch.Tensor] = {}
    for key, taus in indexed_task_vectors(models, base, index):
        with tensor_step(key, models, base):  # one NaN or Inf would decide every entry of a task's model
            require_finite(taus, "rescalers (mean |tau_t| over the whole model)")
        _, unified, masks = elect(taus)
        index[f"unified/{key}"] = unified
        flat = taus.reshape(tasks, -1)
        task_means += flat.abs().mean(dim=1).double().to("cpu")
        masked_means += (unified.reshape(1, -1) * masks.reshape(tasks, -1)).abs().mean(dim=1).double().to("cpu")
        for task, mask in enumerate(masks):
            index[f"task{task}/{key}/mask"] = pack(mask)
    for task, value in enumerate(rescalers(task_means, masked_means)):
        index[f"task{task}/rescaler"] = value.reshape(1).float()
    return index


def emr_reconstruct(index: Mapping[str, torch.Tensor], task: int) -> dict[str, torch.Tensor]:
    return reconstruct_masked(index, task, "unified/", float(index[f"task{task}/rescaler"]))


register(
    PerTaskMerge(
        name="emr",
        index_fn=emr_index,
        reconstruct_fn=emr_reconstruct,
    )
)
