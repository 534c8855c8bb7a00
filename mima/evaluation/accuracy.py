"""Top-1 accuracy of an image encoder on tasks, each against its own frozen zero-shot head."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy

from mima.models.classifier import classify


@torch.no_grad()
def task_accuracy(encoder: nn.Module, head: torch.Tensor, loader: DataLoader) -> float:
    device = next(encoder.parameters()).device
    metric = MulticlassAccuracy(num_classes=head.shape[0], average="micro").to(device)
    was_training = encoder.training
    encoder.eval()
    for images, labels in loader:
        logits = classify(encoder, head.to(device), images.to(device))
        metric.update(logits, labels.to(device))
    encoder.train(was_training)
    return float(metric.compute())


class TaskEvaluator:
    """Holds one working encoder, the tasks' heads and loaders; evaluates any encoder state dict."""

    def __init__(
        self,
        encoder: nn.Module,
        heads: Mapping[str, torch.Tensor],
        datasets: Mapping[str, Dataset],
        batch_size: int = 512,
    ) -> None:
        self.encoder = encoder
        self.heads = dict(heads)
        self.loaders = {name: DataLoader(ds, batch_size=batch_size) for name, ds in datasets.items()}

    def load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load weights strictly: a merged state dict must fit the encoder exactly."""
        self.encoder.load_state_dict(state_dict, strict=True)

    def accuracy(self, state_dict: Mapping[str, torch.Tensor], tasks: list[str] | None = None) -> dict[str, float]:
        self.load(state_dict)
        names = tasks if tasks is not None else list(self.loaders)
        return {name: task_accuracy(self.encoder, self.heads[name], self.loaders[name]) for name in names}

    def mean_accuracy(self, state_dict: Mapping[str, torch.Tensor]) -> float:
        scores = self.accuracy(state_dict)
        return sum(scores.values()) / len(scores)
