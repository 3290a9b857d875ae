"""PreAct ResNet-18, the CIFAR-10 / GTSRB victim of the WaNet, Input-aware and LIRA papers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from backdoorbench.errors import ConfigError
from backdoorbench.models.base import ImageClassifier

NormLayer = Callable[[int], nn.Module]
ActLayer = Callable[[], nn.Module]


class PreActBlock(nn.Module):
    """norm -> act -> 3x3 conv -> norm -> act -> 3x3 conv, plus the (projected) input.

    As in He et al. (2016), a projection shortcut reads the pre-activated input, not the raw one.
    """

    def __init__(self, in_planes: int, planes: int, stride: int, norm_layer: NormLayer, act_layer: ActLayer) -> None:
        super().__init__()
        self.bn1 = norm_layer(in_planes)
        self.act1 = act_layer()
        # The shortcut is registered before conv2 so that, module by module, a block's last
        # convolution is conv2 (fine-pruning looks for the last Conv2d in `features`).
        self.shortcut = (
            nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False)
            if stride != 1 or in_planes != planes
            else None
        )
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = norm_layer(planes)
        self.act2 = act_layer()
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out = self.act1(self.bn1(x))
        shortcut = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(self.act2(self.bn2(out)))
        return out + shortcut


class PreActResNet(ImageClassifier):
    """Pre-activation ResNet (He, Zhang, Ren, Sun, "Identity Mappings in Deep Residual Networks",
    ECCV 2016) in the CIFAR layout the backdoor papers train: a 3x3 stride-1 stem (no max-pool),
    four stages of 64/128/256/512 channels, global average pooling and a linear head.

    Departure from He et al., kept on purpose: like the code released with WaNet (Nguyen & Tran,
    ICLR 2021), LIRA (Doan et al., ICCV 2021) and BackdoorBench, there is no final norm + act
    after the last stage, so victims match the ones those papers report on. `feature_act` is the
    activation on that last stage's output, before pooling (default: none, as in those papers);
    pass e.g. `nn.ReLU` to get He et al.'s final activation. Global pooling is adaptive, so 32 px
    (CIFAR-10, GTSRB) gives the papers' 4x4 average pool and larger images also work.
    """

    name = "preact_resnet"

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        image_size: int = 32,
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
        layers: list[nn.Module] = [nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)]
        in_planes = width
        for stage, count in enumerate(blocks):
            planes = width * 2**stage
            stage_blocks = []
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                stage_blocks.append(PreActBlock(in_planes, planes, stride, norm_layer, act_layer))
                in_planes = planes
            layers.append(nn.Sequential(*stage_blocks))
        layers += [(feature_act or nn.Identity)(), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.num_features = in_planes
        self.classifier = head(in_planes, num_classes)


class PreActResNet18(PreActResNet):
    """PreAct ResNet-18 (2-2-2-2 basic blocks, about 11.2M parameters for 10 classes)."""

    name = "preact_resnet18"
    aliases = ("preactresnet18", "preact_rn18")  # model=preactresnet18 (backdoorbench/registry.py)

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("blocks", (2, 2, 2, 2))
        super().__init__(**kwargs)
