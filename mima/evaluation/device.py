"""The device an evaluation process computes on, claimed before anything touches CUDA.

Several evaluation processes on one node take one GPU each, chosen by the process's local rank (its
index among the processes of its node, as mima.core.environment.local_rank reads it). The choice
must be made current (`torch.cuda.set_device`) before the first CUDA call: otherwise the process
opens a context on GPU 0 as well (the DataLoader's pin-memory thread, autocast and every allocation
without an index use the current device), and eight processes crowd one GPU. Where the cluster binds
one GPU to each process (`--gpus-per-task=1`: `CUDA_VISIBLE_DEVICES` has one entry), that GPU is
index 0 in every process, whatever its local rank.
"""

from __future__ import annotations

import torch

from mima.core.errors import MimaError


def device_index(rank_on_node: int, visible_gpus: int) -> int:
    """The GPU index that the process of local rank `rank_on_node` takes among the `visible_gpus` it sees."""
    if visible_gpus == 1:
        return 0  # bound to its own GPU (or a one-GPU node)
    if 0 <= rank_on_node < visible_gpus:
        return rank_on_node
    raise MimaError(f"local rank {rank_on_node}: this process sees {visible_gpus} GPUs (CUDA_VISIBLE_DEVICES); "
                    "give each process one GPU of its own or every GPU of the node")


def claim_device(rank_on_node: int) -> torch.device:
    """This process's device, made the current CUDA device; the CPU (CUDA untouched) where there is no GPU.

    Call it first, before any tensor, model or loader meets CUDA (torch.cuda.is_available and
    device_count open no context)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = device_index(rank_on_node, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
