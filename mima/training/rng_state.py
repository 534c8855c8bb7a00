"""A process's random states (torch, Python, NumPy and, once initialised, CUDA), captured into and
restored from a process state (mima.training.checkpoint_callback), as tensors and plain values that
`torch.load(weights_only=True)` accepts. The plan (mima.training.plan_measures) serialises one to
size a process state file."""

from __future__ import annotations

import random

import numpy as np
import torch


def capture_rng() -> dict:
    """Every random state a step could touch, as tensors and plain values (loadable with weights_only)."""
    numpy_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [numpy_state[0], torch.from_numpy(numpy_state[1].astype(np.int64)), *numpy_state[2:]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Put back the random states `capture_rng` captured."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
