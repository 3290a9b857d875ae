"""What every classifier exposes, and the wrapper that owns input normalization."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ImageClassifier(nn.Module):
    """A network split into `features` (image -> penultimate vector) and `classifier` (-> logits).

    Defenses reach in through these two names: fine-pruning prunes the last convolution inside
    `features`, the angular-margin penalty reads `classifier.weight`, WB aligns `features` outputs.
    """

    name: str = "classifier"
    features: nn.Module
    classifier: nn.Module

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class Normalized(nn.Module):
    """Normalizes [0, 1] pixels with the dataset's mean/std, then runs the wrapped classifier.

    Normalization lives here so attacks, eps bounds and stealth metrics all work in pixel units.
    """

    def __init__(self, net: ImageClassifier, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    @property
    def name(self) -> str:
        return self.net.name

    def normalize(self, x: Tensor) -> Tensor:
        return (x - self.mean) / self.std

    def features(self, x: Tensor) -> Tensor:
        """Penultimate features of [0, 1] images."""
        return self.net.features(self.normalize(x))

    @property
    def classifier(self) -> nn.Module:
        return self.net.classifier

    def forward(self, x: Tensor) -> Tensor:
        return self.net(self.normalize(x))
