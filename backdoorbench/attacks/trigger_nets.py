"""Trigger generators of the learnable-noise attacks (LIRA, WB): image in [0, 1] -> tanh map in [-1, 1].

The attack scales the map by its eps and adds it to the image, so ||delta||_inf <= eps by
construction. The layouts follow the LIRA authors' code (Doan et al., ICCV 2021,
github.com/sunbelbd/invisible_backdoor_attacks): a small convolutional autoencoder for 28x28
gray digits and a four-level U-Net for colour images. Widths are arguments so a CPU run can
use a narrower net than the paper's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.errors import ConfigError

GENERATORS = ("auto", "autoencoder", "unet")


def _conv_bn_relu(conv: nn.Module, channels: int) -> list[nn.Module]:
    return [conv, nn.BatchNorm2d(channels), nn.ReLU(inplace=True)]


class MnistAutoencoder(nn.Module):
    """LIRA's MNIST generator: two strided convs down to 2x2, three transposed convs back to 28x28.

    With `width=16` the channels are 16, 64 | 128, 64, C as in the authors' code. The layout is
    exact for 28x28 inputs; other sizes are resized back to the input size (bilinear, which keeps
    the tanh output inside [-1, 1]).
    """

    def __init__(self, in_channels: int = 1, width: int = 16) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            *_conv_bn_relu(nn.Conv2d(in_channels, width, 3, stride=3, padding=1), width),
            nn.MaxPool2d(2, stride=2),
            *_conv_bn_relu(nn.Conv2d(width, 4 * width, 3, stride=2, padding=1), 4 * width),
            nn.MaxPool2d(2, stride=1),
        )
        self.decoder = nn.Sequential(
            *_conv_bn_relu(nn.ConvTranspose2d(4 * width, 8 * width, 3, stride=2), 8 * width),
            *_conv_bn_relu(nn.ConvTranspose2d(8 * width, 4 * width, 5, stride=3, padding=1), 4 * width),
            nn.ConvTranspose2d(4 * width, in_channels, 2, stride=2, padding=1),
            nn.BatchNorm2d(in_channels),
            nn.Tanh(),
        )

    def forward(self, x: Tensor) -> Tensor:
        out = self.decoder(self.encoder(x))
        if out.shape[-2:] != x.shape[-2:]:
            out = F.interpolate(out, size=x.shape[-2:], mode="bilinear", align_corners=False)
        return out


def _double_conv(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        *_conv_bn_relu(nn.Conv2d(in_channels, out_channels, 3, padding=1), out_channels),
        *_conv_bn_relu(nn.Conv2d(out_channels, out_channels, 3, padding=1), out_channels),
    )


class UNet(nn.Module):
    """LIRA's colour generator: a 4-level U-Net (double 3x3 convs, average-pool down, bilinear up,
    skip concatenations), a 1x1 conv with batch norm, and tanh.

    `width=64` gives the authors' 64-128-256-512 channels (7.8M parameters). Upsampling goes to
    the skip connection's size, so sides that are not multiples of 8 (e.g. 28) work too.
    """

    def __init__(self, in_channels: int = 3, width: int = 64) -> None:
        super().__init__()
        w = width
        self.down1 = _double_conv(in_channels, w)
        self.down2 = _double_conv(w, 2 * w)
        self.down3 = _double_conv(2 * w, 4 * w)
        self.bottom = _double_conv(4 * w, 8 * w)
        self.up3 = _double_conv(8 * w + 4 * w, 4 * w)
        self.up2 = _double_conv(4 * w + 2 * w, 2 * w)
        self.up1 = _double_conv(2 * w + w, w)
        self.head = nn.Sequential(nn.Conv2d(w, in_channels, 1), nn.BatchNorm2d(in_channels), nn.Tanh())

    @staticmethod
    def _up_cat(x: Tensor, skip: Tensor) -> Tensor:
        x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=True)
        return torch.cat([x, skip], dim=1)

    def forward(self, x: Tensor) -> Tensor:
        skip1 = self.down1(x)
        skip2 = self.down2(F.avg_pool2d(skip1, 2))
        skip3 = self.down3(F.avg_pool2d(skip2, 2))
        x = self.bottom(F.avg_pool2d(skip3, 2))
        x = self.up3(self._up_cat(x, skip3))
        x = self.up2(self._up_cat(x, skip2))
        x = self.up1(self._up_cat(x, skip1))
        return self.head(x)


def build_trigger_generator(kind: str, image_shape: tuple[int, int, int], width: int | None = None) -> nn.Module:
    """`auto` picks the autoencoder for 1-channel data and the U-Net otherwise, as LIRA does for
    MNIST and CIFAR10. `width=None` takes the paper's width (16 / 64)."""
    if kind not in GENERATORS:
        raise ConfigError(f"attack.generator={kind!r} is unknown; choose one of: {', '.join(GENERATORS)}")
    channels, height, width_px = image_shape
    if kind == "auto":
        kind = "autoencoder" if channels == 1 else "unet"
    checks.integer("attack", "generator_width", width, 1, allow_none=True)
    if kind == "autoencoder":
        if min(height, width_px) < 16:
            raise ConfigError(f"attack.generator=autoencoder needs images of at least 16 px, got {height}x{width_px}")
        return MnistAutoencoder(channels, width or 16)
    if min(height, width_px) < 8:
        raise ConfigError(f"attack.generator=unet needs images of at least 8 px, got {height}x{width_px}")
    return UNet(channels, width or 64)
