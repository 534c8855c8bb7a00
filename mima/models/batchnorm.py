"""Frozen BatchNorm statistics: the one place that decides which layers keep theta_0's statistics."""

from __future__ import annotations

from torch import nn


# torch's public BatchNorm classes (the lazy ones and timm's BatchNormAct2d subclass them)
BATCHNORM_CLASSES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def batchnorm_layers(module: nn.Module) -> list[nn.Module]:
    return [layer for layer in module.modules() if isinstance(layer, BATCHNORM_CLASSES)]


def freeze_batchnorm_statistics(module: nn.Module) -> nn.Module:
    """Put every BatchNorm layer in eval mode (running statistics neither used from the batch nor
    updated); their affine weights still train. Call after `module.train()`, which would undo it."""
    for layer in batchnorm_layers(module):
        layer.eval()
    return module


def train_with_frozen_batchnorm(module: nn.Module) -> nn.Module:
    """Train mode for everything but BatchNorm statistics (mima's `model.batchnorm: frozen`)."""
    module.train()
    return freeze_batchnorm_statistics(module)
