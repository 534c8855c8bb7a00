"""Split rules shared by all suites (the task_vectors conventions), and the split files of
`mima data splits`.

Validation is carved from a training set exactly as task_vectors' `split_train_into_train_val`
carves it (src/datasets/registry.py; tall_masks keeps the same function):

    val_size = min(int(n * 0.1), 5000); train_size = n - val_size
    trainset, valset = torch.utils.data.random_split(
        train, [train_size, val_size], generator=torch.Generator().manual_seed(0))

`random_split` draws `torch.randperm(n, generator=...)` and cuts it into consecutive slices, so
the training part is the HEAD of the permutation, in permutation order, and validation its TAIL
(for MNIST's 60,000 images the training part starts at index 36044, which task_vectors asserts).
`carve_validation` computes the same permutation the same way, and the splits keep its order, so
`train[i]` of a mima task is `trainset[i]` of task_vectors'. The seed is `data.split_seed`
(default 0, task_vectors' seed); another seed gives another split, no longer task_vectors'.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.utils.data import Dataset, Subset

from mima.core.files import atomic_path
from mima.core.subsets import fixed_order

VALIDATION_FRACTION = 0.1
VALIDATION_MAX = 5000
SPLIT_NAMES = ("train", "val", "test")
# Names the carving rule in cache keys of things fitted on a training split (linear probes): a
# change of rule changes the training examples under the same split seed.
SPLIT_RULE = "task_vectors-random_split"


def validation_size(num_train: int) -> int:
    """Validation is 10% of the training set (rounded down), at most 5000 examples (task_vectors)."""
    return min(int(num_train * VALIDATION_FRACTION), VALIDATION_MAX)


def carve_validation(num_train: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (train, val) into a training set of `num_train` examples, as task_vectors'
    `random_split(train, [num_train - v, v], generator=torch.Generator().manual_seed(seed))` makes
    them: the permutation's head and tail, in permutation order (not sorted)."""
    order = torch.randperm(num_train, generator=torch.Generator().manual_seed(seed))
    cut = num_train - validation_size(num_train)
    return order[:cut], order[cut:]


def holdout_split(num_examples: int, test_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (train, test) for datasets that ship without a test split (sorted; mima's own rule:
    task_vectors has no such dataset)."""
    order = fixed_order(num_examples, seed)
    num_test = int(round(test_fraction * num_examples))
    return order[num_test:].sort().values, order[:num_test].sort().values


# -------------------------------------------------------------------- split files (`mima data splits`)
def base_indices(dataset: Dataset) -> tuple[Dataset, list[int]]:
    """The dataset a split reads (below any Subsets) and the split's indices into it, in order."""
    if isinstance(dataset, Subset):
        base, inner = base_indices(dataset.dataset)
        return base, [inner[int(i)] for i in dataset.indices]
    return dataset, list(range(len(dataset)))


def split_record(task: str, train: Dataset, val: Dataset, test: Dataset, split_seed: int = 0) -> dict:
    """Each split's example indices into the dataset it is read from, as the dataset (torchvision,
    or the folder listing) orders it. `from` names that dataset: "train" (the task's training
    split; for the digits suite, which ships no split, all of its images), "val" (a validation
    split the dataset ships, e.g. EuroSAT's) or "test" (its test split)."""
    bases = {name: base_indices(split) for name, split in zip(SPLIT_NAMES, (train, val, test))}
    named: list[tuple[Dataset, str]] = []
    record: dict = {"task": task, "split_seed": split_seed, "rule": SPLIT_RULE}
    for name in SPLIT_NAMES:
        base, indices = bases[name]
        source = next((label for known, label in named if known is base), None)
        if source is None:
            source = name
            named.append((base, name))
        record[name] = {"from": source, "source_size": len(base), "size": len(indices), "indices": indices}
    return record


def _unchanged(image):
    return image


def task_split_record(spec, root: str | None, split_seed: int) -> dict:
    """`split_record` of a task (a TaskSpec), loaded without decoding any image: the loaders get a
    transform that returns the image as it is (tensor suites are sized to 8 x 8 pixels)."""
    from mima.data.tasks import LoadOptions

    data = spec.load(LoadOptions(root=root, image_size=8, split_seed=split_seed, preprocess=_unchanged))
    return split_record(spec.name, data.train, data.val, data.test, split_seed)


def write_split_file(record: dict, folder: Path) -> Path:
    """FOLDER/<task>.json, written atomically."""
    path = Path(folder) / f"{record['task']}.json"
    with atomic_path(path) as temporary:
        temporary.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    return path
