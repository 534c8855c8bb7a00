"""Split rules shared by all suites (the task_vectors conventions)."""

from __future__ import annotations

import torch

from mima.core.subsets import fixed_order

VALIDATION_FRACTION = 0.1
VALIDATION_MAX = 5000


def validation_size(num_train: int) -> int:
    """Validation is 10% of the training set, at most 5000 examples (as task_vectors does)."""
    return min(VALIDATION_MAX, int(VALIDATION_FRACTION * num_train))


def carve_validation(num_train: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (train, val) of a fixed-seed random split of a training set of `num_train` examples."""
    order = fixed_order(num_train, seed)
    num_val = validation_size(num_train)
    return order[num_val:].sort().values, order[:num_val].sort().values


def holdout_split(num_examples: int, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (train, test) for datasets that ship without a test split."""
    order = fixed_order(num_examples, seed)
    num_test = int(round(test_fraction * num_examples))
    return order[num_test:].sort().values, order[:num_test].sort().values
