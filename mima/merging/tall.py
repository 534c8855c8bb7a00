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

import numpy as np
import torch

from mima.merging.consensus import per_task_lams, task_masks
from mima.merging.registry import MergeMethod, register
from mima.merging.task_arithmetic import task_vectors_by_key


def pack(mask: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.packbits(mask.reshape(-1).numpy()))


def unpack(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    count = int(torch.Size(shape).numel())
    return torch.from_numpy(np.unpackbits(packed.numpy(), count=count).astype(bool)).reshape(shape)


def tall_index(models, base, mask_lam) -> dict[str, torch.Tensor]:
    lams = per_task_lams(mask_lam, len(models))
    index: dict[str, torch.Tensor] = {}
    for key, anchor, vectors in task_vectors_by_key(models, base):
        index[f"base/{key}"] = anchor
        if vectors is None:
            continue
        taus = torch.stack(vectors)
        total = taus.sum(dim=0)
        index[f"sum/{key}"] = total
        for task, mask in enumerate(task_masks(taus, total, lams)):
            index[f"task{task}/{key}/mask"] = pack(mask)
    return index


def tall_reconstruct(index: Mapping[str, torch.Tensor], task: int) -> dict[str, torch.Tensor]:
    return reconstruct_masked(index, task, "sum/")


def reconstruct_masked(index: Mapping[str, torch.Tensor], task: int, vector: str, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """theta_0 + scale * (task's mask * shared vector) for every key of an index of the form
    base/<key>, <vector><key>, task<t>/<key>/mask (TALL masks; EMR's masks and rescalers); keys
    without a shared vector are theta_0's."""
    model = {}
    for name in index:
        if not name.startswith("base/"):
            continue
        key = name[len("base/") :]
        base = index[name]
        if f"{vector}{key}" not in index:
            model[key] = base.clone()
            continue
        masked = unpack(index[f"task{task}/{key}/mask"], base.shape) * index[f"{vector}{key}"]
        model[key] = (base.float() + (masked if scale == 1.0 else masked * scale)).to(base.dtype)
    return model


register(
    MergeMethod(
        name="tall",
        paper="https://arxiv.org/abs/2405.07813",
        summary="shared sum of task vectors plus a TALL mask per task (one model per task)",
        needs_base=True,
        defaults={"mask_lam": 0.4},
        grid={"mask_lam": (0.2, 0.3, 0.4, 0.5, 0.6)},
        index_fn=tall_index,
        reconstruct_fn=tall_reconstruct,
    )
)
