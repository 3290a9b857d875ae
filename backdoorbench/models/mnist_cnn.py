"""The small MNIST CNN of the WaNet and LIRA papers' MNIST experiments."""

from __future__ import annotations

from typing import Callable

from torch import nn

from backdoorbench.errors import ConfigError
from backdoorbench.models.base import ImageClassifier


class MnistCNN(ImageClassifier):
    """Two 5x5 conv blocks (32, 64 channels) with max-pooling, a 512-unit hidden layer, a linear head.

    The layout follows the MNIST classifier used by WaNet (Nguyen & Tran, ICLR 2021) and LIRA
    (Doan et al., ICCV 2021). `norm_layer`, `act_layer`, `head` and `feature_act` (the activation
    on the penultimate features, default `act_layer`) are arguments so defenses can swap them
    (e.g. a bias-free head on tanh features) without forking the network.
    """

    name = "mnist_cnn"
    aliases = ("cnn",)  # model=cnn (backdoorbench/registry.py)

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: int = 28,
        hidden: int = 512,
        dropout: float = 0.1,
        norm_layer: Callable[[int], nn.Module] = nn.BatchNorm2d,
        act_layer: Callable[[], nn.Module] = nn.ReLU,
        head: Callable[[int, int], nn.Module] = nn.Linear,
        feature_act: Callable[[], nn.Module] | None = None,
    ) -> None:
        super().__init__()
        side = ((image_size - 4) // 2 - 4) // 2  # two valid 5x5 convs, each followed by a 2x2 pool
        if side < 1:
            raise ConfigError(f"model mnist_cnn needs images of at least 16 px, the dataset has {image_size} px; choose another model")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 5),
            norm_layer(32),
            act_layer(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5),
            norm_layer(64),
            act_layer(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(64 * side * side, hidden),
            (feature_act or act_layer)(),
            nn.Dropout(dropout),
        )
        self.classifier = head(hidden, num_classes)
