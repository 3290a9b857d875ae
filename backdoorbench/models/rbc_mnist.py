"""The MNIST network of the angular-margin paper's code (Xu, Li, Yang, arXiv 2010.03844)."""

from __future__ import annotations

from typing import Callable

from torch import Tensor, nn

from backdoorbench.errors import ConfigError
from backdoorbench.models.base import ImageClassifier


class NormActLinear(nn.Module):
    """BatchNorm1d -> activation -> linear with bias: the authors' plain head (their `MNIST`
    ends its `dense` block in BatchNorm1d, applies `active` (ReLU), then `fc`)."""

    def __init__(self, in_features: int, num_classes: int, act_layer: Callable[[], nn.Module] = nn.ReLU) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(in_features)
        self.act = act_layer()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, features: Tensor) -> Tensor:
        return self.linear(self.act(self.norm(features)))


class RbcMnist(ImageClassifier):
    """Four 3x3 conv blocks (32, 32, pool, 64, 64, pool), Linear 1024 -> `hidden`, ReLU, BN,
    Linear `hidden` -> `num_features`, then the head.

    The network of MTandHJ/rbc `models/mnist.py` (classes `MNIST` and `MNISTrbc`, d = 200): the
    plain model's head is BN -> ReLU -> Linear with bias (`NormActLinear`); the angular-margin
    defense passes `head=SimplexHead` (BN -> tanh -> bias-free Linear, their `MNISTrbc`). The
    BatchNorm1d that ends the authors' `dense` block lives in the head here, so that one
    constructor gives both of their classes. `feature_act` (identity by default) is accepted for
    the defenses that swap the activation on the features.
    """

    name = "rbc_mnist"

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: int = 28,
        hidden: int = 200,
        num_features: int = 200,
        norm_layer: Callable[[int], nn.Module] = nn.BatchNorm2d,
        act_layer: Callable[[], nn.Module] = nn.ReLU,
        head: Callable[[int, int], nn.Module] | None = None,
        feature_act: Callable[[], nn.Module] = nn.Identity,
    ) -> None:
        super().__init__()
        side = ((image_size - 4) // 2 - 4) // 2  # two valid 3x3 convs, a 2x2 pool, twice
        if side < 1:
            raise ConfigError(f"model rbc_mnist needs images of at least 16 px, the dataset has {image_size} px; choose another model")

        def conv(cin: int, cout: int) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3), norm_layer(cout), act_layer()]

        self.features = nn.Sequential(
            *conv(in_channels, 32), *conv(32, 32), nn.MaxPool2d(2),
            *conv(32, 64), *conv(64, 64), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(64 * side * side, hidden), act_layer(), nn.BatchNorm1d(hidden),
            nn.Linear(hidden, num_features),
            feature_act(),
        )
        self.classifier = head(num_features, num_classes) if head else NormActLinear(num_features, num_classes, act_layer)
