"""The image classifier used for training and evaluation: encoder features against a frozen head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ZeroShotClassifier(nn.Module):
    """logits = normalize(encoder(x)) @ head.T, where head rows are (already scaled) class embeddings.

    The head is a non-persistent buffer: frozen, moved with the module, never in a checkpoint.
    """

    def __init__(self, encoder: nn.Module, head: torch.Tensor) -> None:
        super().__init__()
        self.encoder = encoder
        self.register_buffer("head", head.detach().clone(), persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return classify(self.encoder, self.head, images)


def classify(encoder: nn.Module, head: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    features = F.normalize(encoder(images), dim=-1)
    return features @ head.to(features.dtype).T
