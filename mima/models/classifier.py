"""The image classifier used for training and evaluation: encoder features against a frozen head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def classify(encoder: nn.Module, head: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """logits = normalize(encoder(images)) @ head.T; head rows are scaled class embeddings."""
    features = F.normalize(encoder(images), dim=-1)
    return features @ head.to(features.dtype).T
