"""Poison Ink's trigger machinery: the edge map, its colouring, and the two networks (the injection
U-Net and the extraction residual network), laid out as the official code's so that its weights load.

Kept apart from `poison_ink.py` (the attack) as `input_aware_nets.py` is from Input-aware.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

# ITU-R 601 luma, the official `0.299 * R + 0.587 * G + 0.114 * B` on the 0-255 image.
LUMA = (0.299, 0.587, 0.114)
WHITE = 1.0  # the official background of the watermark where there is no edge (BB: torch.ones)


def grey_255(x: Tensor) -> Tensor:
    """(B, C, H, W) in [0, 1] -> (B, H, W) luma in 0-255 units (a grayscale image: its channel)."""
    if x.shape[1] == 3:
        weights = torch.tensor(LUMA, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
        return (x * weights).sum(1) * 255
    return x.mean(1) * 255


def sobel_magnitude(grey: Tensor) -> Tensor:
    """scikit-image's `filters.sobel` on a batch (B, H, W): the two 3x3 Sobel kernels divided by 4,
    `mode='reflect'` borders (one pixel: the edge pixel repeated), sqrt((gx^2 + gy^2) / 2)."""
    smooth = torch.tensor([1.0, 2.0, 1.0], device=grey.device, dtype=grey.dtype) / 4
    derive = torch.tensor([1.0, 0.0, -1.0], device=grey.device, dtype=grey.dtype)
    horizontal = (derive[:, None] * smooth[None, :]).view(1, 1, 3, 3)
    vertical = (smooth[:, None] * derive[None, :]).view(1, 1, 3, 3)
    padded = F.pad(grey[:, None], (1, 1, 1, 1), mode="replicate")
    gx = F.conv2d(padded, horizontal)
    gy = F.conv2d(padded, vertical)
    return ((gx ** 2 + gy ** 2) / 2).sqrt()[:, 0]


def canny_map(grey: Tensor, sigma: float) -> Tensor:
    """scikit-image's `feature.canny` (default hysteresis thresholds) on each (H, W) image of the
    batch, scaled to [0, 1]; computed on the CPU."""
    from skimage.feature import canny

    images = (grey / 255).detach().to("cpu", torch.float64).numpy()
    maps = np.stack([canny(image, sigma=sigma) for image in images])
    return torch.from_numpy(maps).to(grey.device)


def edge_mask(x: Tensor, *, detector: str = "sobel", threshold: float = 28.0, sigma: float = 1.0) -> Tensor:
    """The edge map of each image, (B, 1, H, W) of 0/1: the official Sobel magnitude of the 0-255
    luma above `threshold` (28), or scikit-image's Canny (`sigma`)."""
    grey = grey_255(x.float())
    edges = sobel_magnitude(grey) > threshold if detector == "sobel" else canny_map(grey, sigma)
    return edges[:, None].to(x.dtype)


def watermark(mask: Tensor, colours: Tensor) -> Tensor:
    """The coloured edge map: each image's colour (B, 3) in 0-255 levels on its edges, white elsewhere;
    (B, 3, H, W) in [0, 1]. Always three channels: the colour is the code, whatever the image's channels."""
    ink = colours.to(mask.dtype).view(-1, 3, 1, 1) / 255
    return ink * mask + WHITE * (1 - mask)


# ------------------------------------------------------------------------------ injection network

class DoubleConv(nn.Sequential):
    """(3x3 conv, batch norm, ReLU) twice, the official `DoubleConv` (its one attribute `double_conv`)."""

    def __init__(self, inputs: int, outputs: int, middle: int | None = None) -> None:
        super().__init__()
        middle = middle or outputs
        self.double_conv = nn.Sequential(
            nn.Conv2d(inputs, middle, 3, padding=1), nn.BatchNorm2d(middle), nn.ReLU(inplace=True),
            nn.Conv2d(middle, outputs, 3, padding=1), nn.BatchNorm2d(outputs), nn.ReLU(inplace=True))


class Down(nn.Module):
    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.maxpool_conv = nn.Sequential(nn.MaxPool2d(2), DoubleConv(inputs, outputs))

    def forward(self, x: Tensor) -> Tensor:
        return self.maxpool_conv(x)


class Up(nn.Module):
    """Bilinear x2 (align_corners=True), padded to the skip's size, concatenated after it, DoubleConv."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
        self.conv = DoubleConv(inputs, outputs, inputs // 2)

    def forward(self, x: Tensor, skip: Tensor) -> Tensor:
        x = self.up(x)
        dy, dx = skip.shape[2] - x.shape[2], skip.shape[3] - x.shape[3]
        x = F.pad(x, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        return self.conv(torch.cat([skip, x], 1))


class InjectionUNet(nn.Module):
    """The official injection network (`models/up_UNet.py`, bilinear): `depth` max-pool halvings
    from `width` channels, doubling each, and back; a 1x1 convolution out, no output activation (the
    image is clamped to [0, 1] where it is used). width 64, depth 4, 6 -> 3 channels: the official
    network, whose saved weights load as they are."""

    def __init__(self, inputs: int, outputs: int, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.depth = depth
        self.inc = DoubleConv(inputs, width)
        for level in range(1, depth + 1):
            factor = 2 if level == depth else 1
            self.add_module(f"down{level}", Down(width * 2 ** (level - 1), width * 2 ** level // factor))
        for level in range(1, depth + 1):
            channels = width * 2 ** (depth - level + 1)
            out = width if level == depth else channels // 4
            self.add_module(f"up{level}", Up(channels, out))
        self.outc = nn.Module()
        self.outc.conv = nn.Conv2d(width, outputs, 1)

    def forward(self, x: Tensor) -> Tensor:
        skips = [self.inc(x)]
        for level in range(1, self.depth + 1):
            skips.append(getattr(self, f"down{level}")(skips[-1]))
        y = skips.pop()
        for level in range(1, self.depth + 1):
            y = getattr(self, f"up{level}")(y, skips.pop())
        return self.outc.conv(y)


# ------------------------------------------------------------------------------ extraction network

class ResidualBlock(nn.Module):
    """Two dilated 3x3 convolutions with instance norm, added to the input (the official block)."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, 1, padding=dilation, dilation=dilation, bias=False)
        self.norm1 = nn.InstanceNorm2d(channels, affine=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, padding=dilation, dilation=dilation, bias=False)
        self.norm2 = nn.InstanceNorm2d(channels, affine=True)

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.norm1(self.conv1(x)))
        return F.relu(x + self.norm2(self.conv2(y)))


OFFICIAL_DILATIONS = (2, 2, 2, 4, 4, 4, 1)


class ExtractionNet(nn.Module):
    """The official guidance extractor (`models/HidingRes.py`, `HidingRes`): two 3x3 convolutions, a
    stride-2 one, seven dilated residual blocks (2, 2, 2, 4, 4, 4, 1), a transposed convolution back
    to full size, a 3x3 and a 1x1 convolution, ReLU out. `width` channels (official 128); an
    odd-sized image is cropped back to its size after the transposed convolution."""

    def __init__(self, inputs: int, outputs: int = 3, width: int = 128,
                 dilations: tuple[int, ...] = OFFICIAL_DILATIONS) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, width, 3, 1, 1, bias=False)
        self.norm1 = nn.InstanceNorm2d(width, affine=True)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.norm2 = nn.InstanceNorm2d(width, affine=True)
        self.conv3 = nn.Conv2d(width, width, 3, 2, 1, bias=False)
        self.norm3 = nn.InstanceNorm2d(width, affine=True)
        self.blocks = len(dilations)
        for k, dilation in enumerate(dilations, 1):
            self.add_module(f"res{k}", ResidualBlock(width, dilation))
        self.deconv3 = nn.ConvTranspose2d(width, width, 4, 2, 1)
        self.norm4 = nn.InstanceNorm2d(width, affine=True)
        self.deconv2 = nn.Conv2d(width, width, 3, 1, 1)
        self.norm5 = nn.InstanceNorm2d(width, affine=True)
        self.deconv1 = nn.Conv2d(width, outputs, 1)

    def forward(self, x: Tensor) -> Tensor:
        height, width = x.shape[-2:]
        y = F.relu(self.norm1(self.conv1(x)))
        y = F.relu(self.norm2(self.conv2(y)))
        y = F.relu(self.norm3(self.conv3(y)))
        for k in range(1, self.blocks + 1):
            y = getattr(self, f"res{k}")(y)
        y = F.relu(self.norm4(self.deconv3(y)))[..., :height, :width]
        y = F.relu(self.norm5(self.deconv2(y)))
        return F.relu(self.deconv1(y))
