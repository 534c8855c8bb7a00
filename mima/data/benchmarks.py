"""The task lists of the papers' CLIP benchmarks, by name: "8" (task_vectors, TIES, CART, MIMA), "14"
and "20" (TALL masks / Consensus merging). Names only, no imports: `mima data check --benchmark`
offers them before torch is loaded; mima.data.clip_tasks defines the tasks."""

from __future__ import annotations

BENCHMARKS: dict[str, tuple[str, ...]] = {
    "8": ("Cars", "DTD", "EuroSAT", "GTSRB", "MNIST", "RESISC45", "SUN397", "SVHN"),
}
BENCHMARKS["14"] = BENCHMARKS["8"] + ("STL10", "OxfordIIITPet", "Flowers102", "CIFAR100", "PCAM", "FER2013")
BENCHMARKS["20"] = BENCHMARKS["14"] + ("CIFAR10", "Food101", "FashionMNIST", "RenderedSST2", "EMNIST", "KMNIST")
