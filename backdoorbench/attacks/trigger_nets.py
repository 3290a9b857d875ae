"""Trigger generators of the learnable-noise attacks (LIRA, WB): image in [0, 1] -> tanh map in [-1, 1].

The attack scales the map by its eps and adds it to the image, so ||delta||_inf <= eps by
construction. The layouts follow the LIRA authors' code (Doan et al., ICCV 2021;
github.com/khoadoan106/backdoor_attacks, python/attack_models/): a small autoencoder for 28x28
gray digits (`MNISTAutoencoder` there), a stride-2 convolutional autoencoder for colour images
(`Autoencoder`, the default of its `--attack_model` and BackdoorBench's generator for every
dataset) and a four-level U-Net (`UNet`, what its CIFAR-10 code path builds). Widths are
arguments so a CPU run can use a narrower net than the paper's. docs/fidelity.md, section lira,
says which one each dataset uses in the official code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.errors import ConfigError

GENERATORS = ("auto", "autoencoder", "mnist_autoencoder", "unet")


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


class ColourAutoencoder(nn.Module):
    """LIRA's colour autoencoder: four stride-2 4x4 convs (batch norm, ReLU) down to 1/16 of the
    side, four stride-2 4x4 transposed convs back, tanh; no batch norm before the tanh, as in the
    authors' code.

    With `width=16` the channels are 16-32-64-128 | 64-32-16-C, the authors' and BackdoorBench's
    (`SCLBD/BackdoorBench` attack/lira.py `Autoencoder(channels)`). The layout is exact for sides
    that are multiples of 16 (32, 64); other sizes (e.g. 28) are resized back to the input size
    (bilinear, which keeps the tanh output inside [-1, 1]).
    """

    def __init__(self, in_channels: int = 3, width: int = 16) -> None:
        super().__init__()
        widths = [width, 2 * width, 4 * width, 8 * width]
        down: list[nn.Module] = []
        for c_in, c_out in zip([in_channels, *widths[:-1]], widths):
            down += _conv_bn_relu(nn.Conv2d(c_in, c_out, 4, stride=2, padding=1), c_out)
        up: list[nn.Module] = []
        for c_in, c_out in zip(widths[:0:-1], widths[-2::-1]):
            up += _conv_bn_relu(nn.ConvTranspose2d(c_in, c_out, 4, stride=2, padding=1), c_out)
        self.encoder = nn.Sequential(*down)
        self.decoder = nn.Sequential(*up, nn.ConvTranspose2d(width, in_channels, 4, stride=2, padding=1), nn.Tanh())

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
    """`auto` picks the MNIST autoencoder for 1-channel data and the colour autoencoder otherwise
    (the authors' `--attack_model autoencoder` default and BackdoorBench's choice; their CIFAR-10
    runs used the U-Net, which `paper_attack/lira/cifar10` selects). `width=None` takes the
    paper's width (16 for both autoencoders, 64 for the U-Net)."""
    if kind not in GENERATORS:
        raise ConfigError(f"attack.generator={kind!r} is unknown; choose one of: {', '.join(GENERATORS)}")
    channels, height, width_px = image_shape
    if kind == "auto":
        kind = "mnist_autoencoder" if channels == 1 else "autoencoder"
    checks.integer("attack", "generator_width", width, 1, allow_none=True)
    if kind in ("autoencoder", "mnist_autoencoder"):
        if min(height, width_px) < 16:
            raise ConfigError(f"attack.generator={kind} needs images of at least 16 px, got {height}x{width_px}")
        if kind == "mnist_autoencoder":
            return MnistAutoencoder(channels, width or 16)
        return ColourAutoencoder(channels, width or 16)
    if min(height, width_px) < 8:
        raise ConfigError(f"attack.generator=unet needs images of at least 8 px, got {height}x{width_px}")
    return UNet(channels, width or 64)
