"""ResNet-18 with a small-image stem, the TinyImageNet (64 px) victim of the backdoor papers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from backdoorbench.errors import ConfigError
from backdoorbench.models.base import ImageClassifier

NormLayer = Callable[[int], nn.Module]
ActLayer = Callable[[], nn.Module]


class BasicBlock(nn.Module):
    """3x3 conv -> norm -> act -> 3x3 conv -> norm, plus the (projected) input, then `out_act`."""

    def __init__(
        self, in_planes: int, planes: int, stride: int, norm_layer: NormLayer, act_layer: ActLayer, out_act: ActLayer
    ) -> None:
        super().__init__()
        # The projection shortcut is registered first so a block's last Conv2d is conv2, the one
        # whose channels are the block's output channels (fine-pruning prunes the last conv).
        self.shortcut = (
            nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), norm_layer(planes))
            if stride != 1 or in_planes != planes
            else None
        )
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = norm_layer(planes)
        self.act1 = act_layer()
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = norm_layer(planes)
        self.act2 = out_act()

    def forward(self, x: Tensor) -> Tensor:
        shortcut = self.shortcut(x) if self.shortcut is not None else x
        out = self.act1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.act2(out + shortcut)


class ResNet(ImageClassifier):
    """ResNet (He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition", CVPR 2016)
    with basic blocks, for small images.

    Departure from the ImageNet network, as in the TinyImageNet victim of LIRA's released code
    (Doan et al., ICCV 2021: torchvision's ResNet-18 with its stem swapped): a 3x3 stride-1 stem
    and no max-pool, so a 64x64 image reaches the last stage at 8x8 instead of 2x2 and keeps the
    spatial detail a small trigger lives in; global pooling is adaptive. Unlike that code, the
    stem conv has no bias (a norm follows it, as everywhere else in a ResNet). For the ImageNet
    layout (7x7 stride-2 stem + max-pool) use `model=timm model.name=resnet18`.
    `feature_act` is the activation that ends the last block, before pooling (default `act_layer`).
    """

    name = "resnet"

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 200,
        image_size: int = 64,
        blocks: tuple[int, ...] = (2, 2, 2, 2),
        width: int = 64,
        norm_layer: NormLayer = nn.BatchNorm2d,
        act_layer: ActLayer = nn.ReLU,
        head: Callable[[int, int], nn.Module] = nn.Linear,
        feature_act: ActLayer | None = None,
    ) -> None:
        super().__init__()
        if image_size < 8:
            raise ConfigError(f"model {self.name} needs images of at least 8 px (three stride-2 stages), got {image_size}")
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False),
            norm_layer(width),
            act_layer(),
        ]
        in_planes = width
        for stage, count in enumerate(blocks):
            planes = width * 2**stage
            stage_blocks = []
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                last = stage == len(blocks) - 1 and i == count - 1
                out_act = (feature_act or act_layer) if last else act_layer
                stage_blocks.append(BasicBlock(in_planes, planes, stride, norm_layer, act_layer, out_act))
                in_planes = planes
            layers.append(nn.Sequential(*stage_blocks))
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.num_features = in_planes
        self.classifier = head(in_planes, num_classes)


class ResNet18(ResNet):
    """ResNet-18 (2-2-2-2 basic blocks, about 11.2M parameters plus 513 per class)."""

    name = "resnet18"

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("blocks", (2, 2, 2, 2))
        super().__init__(**kwargs)
