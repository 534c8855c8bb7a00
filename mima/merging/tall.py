"""TALL masks: one shared multi-task vector plus a binary mask per task; each task gets its model back.

Wang et al. 2024, "Localizing Task Information for Improved Model Merging and Compression",
https://arxiv.org/abs/2405.07813, as the official code (nik-dim/tall_masks): with
tau_MTL = sum_t tau_t (unscaled), task t's mask is m_t = |tau_t| > lam_t * |tau_MTL - tau_t| (strict)
over every floating tensor, and its model is theta_0 + m_t * tau_MTL. lam_t is chosen per task on that
task's validation split from 0.2 .. 0.6 (`mask_lam` may be one value per task); 0.4 without validation.

Index keys: `base/<key>` (theta_0), `sum/<key>` (tau_MTL, float32), `task<i>/<key>/mask` (the mask,
bit-packed with numpy.packbits; the shape comes from `base/<key>`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mima.merging.common import indexed_task_vectors, pack, reconstruct_masked
from mima.merging.consensus import per_task_lams, task_masks
from mima.merging.registry import PerTaskMerge, register


def tall_index(models, base, mask_lam) -> dict[str, torch.Tensor]:
    lams = per_task_lams(mask_lam, len(models))
    index: dict[str, torch.Tensor] = {}
    for key, taus in indexed_task_vectors(models, base, index):
        total = taus.sum(dim=0)
        index[f"sum/{key}"] = total
        for task, mask in enumerate(task_masks(taus, total, lams)):
            index[f"task{task}/{key}/mask"] = pack(mask)
    return index


def tall_reconstruct(index: Mapping[str, torch.Tensor], task: int) -> dict[str, torch.Tensor]:
    return reconstruct_masked(index, task, "sum/")


register(
    PerTaskMerge(
        name="tall",
        index_fn=tall_index,
        reconstruct_fn=tall_reconstruct,
    )
)
