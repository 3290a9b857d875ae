"""CIFAR-style VGG-11 and VGG-16 (with batch norm) and a single linear head, as in LIRA's code."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from backdoorbench.errors import ConfigError
from backdoorbench.models.base import ImageClassifier

NormLayer = Callable[[int], nn.Module]
ActLayer = Callable[[], nn.Module]

# Output channels of each 3x3 conv; "M" is a 2x2 max-pool (Simonyan & Zisserman, configs A and D).
LAYOUTS: dict[str, tuple[int | str, ...]] = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg13": (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
    "vgg19": (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"),
}


class VGG(ImageClassifier):
    """VGG (Simonyan & Zisserman, "Very Deep Convolutional Networks for Large-Scale Image
    Recognition", ICLR 2015) in the CIFAR layout: 3x3 convs with norm + act, five 2x2 max-pools,
    and one linear layer on the flattened maps (512 features at 32 px, 2048 at 64 px).

    This is the VGG the LIRA code (Doan et al., ICCV 2021) trains as its second CIFAR-10 and
    TinyImageNet victim; it departs from the paper's network by batch norm after every conv and
    by dropping the two 4096-unit hidden layers, far too large for 32 px inputs. Pass
    `norm_layer=None` for the batch-norm-free VGG of the paper. `feature_act` is the activation
    of the last conv (before the last pool; default `act_layer`).
    """

    name = "vgg"

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        image_size: int = 32,
        layout: str = "vgg11",
        norm_layer: NormLayer | None = nn.BatchNorm2d,
        act_layer: ActLayer = nn.ReLU,
        head: Callable[[int, int], nn.Module] = nn.Linear,
        feature_act: ActLayer | None = None,
    ) -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ConfigError(f"VGG layout {layout!r} is unknown; choose one of: {', '.join(LAYOUTS)}")
        pools = LAYOUTS[layout].count("M")
        side = image_size // 2**pools
        if side < 1:
            raise ConfigError(f"model {self.name if self.name != VGG.name else layout} needs images of at least {2**pools} px ({pools} max-pools), got {image_size}; for smaller images use mnist_cnn or preact_resnet18")
        convs = [c for c in LAYOUTS[layout] if c != "M"]
        layers: list[nn.Module] = []
        channels = in_channels
        seen = 0
        for entry in LAYOUTS[layout]:
            if entry == "M":
                layers.append(nn.MaxPool2d(2))
                continue
            seen += 1
            # A conv followed by a norm needs no bias of its own.
            layers.append(nn.Conv2d(channels, entry, 3, padding=1, bias=norm_layer is None))
            if norm_layer is not None:
                layers.append(norm_layer(entry))
            layers.append((feature_act or act_layer)() if seen == len(convs) else act_layer())
            channels = entry
        layers.append(nn.Flatten())
        self.features = nn.Sequential(*layers)
        self.num_features = channels * side * side
        self.classifier = head(self.num_features, num_classes)


class VGG11(VGG):
    """VGG-11 (config A) with batch norm: the VGG victim of LIRA."""

    name = "vgg11"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("layout", "vgg11")
        super().__init__(**kwargs)


class VGG16BN(VGG):
    """VGG-16 (config D) with batch norm."""

    name = "vgg16_bn"
    aliases = ("vgg16",)  # model=vgg16 (backdoorbench/registry.py)

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("layout", "vgg16")
        super().__init__(**kwargs)
