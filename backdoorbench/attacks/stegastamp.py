"""StegaStamp's encoder and decoder at any image size, as BackdoorBench's resource/ssba trains them.

The encoder takes a code (bits) and an image and returns the image with the code hidden in it; the
decoder reads the code back. Layer for layer BackdoorBench's resource/ssba/models.py (the PyTorch
port of StegaStamp it ships for SSBA): the code goes through a dense layer to a 16 x 16 map per
channel, is enlarged to the image and joins it into a U-Net (32-64-128-256 channels, four stride-2
convolutions down, four 2x2 convolutions up with skips). Departures, for image sizes that are not
a multiple of 16 (28-px MNIST): the code map is enlarged to the image's size (nearest; the same as
the official integer scale factor at 32 and 64 px), an up-branch one pixel larger than its skip is
cropped to it, and the decoder's dense layer takes the size its convolutions leave (the official
formula assumes a multiple of 32). `base` (32, the official) scales every width: the tests train
narrow ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CODE_MAP = 16  # the code's map side before enlarging (models.py: secret_dense -> (C, 16, 16))


def _fit(x: Tensor, like: Tensor) -> Tensor:
    """Crop an up-branch (2 * ceil(s / 2) px) to its skip's s px (a no-op at multiples of 16)."""
    return x[..., : like.shape[-2], : like.shape[-1]]


class StegaStampEncoder(nn.Module):
    """(code (B, bits) in {0, 1}, image (B, C, H, W) in [0, 1]) -> the encoded image; with
    `residual` the network's output is added to the image (StegaStamp's own mode, BackdoorBench's
    use_residual 1), else it is the encoded image itself through a sigmoid (use_residual 0)."""

    def __init__(self, channels: int, height: int, width: int, code_bits: int, residual: bool = False,
                 base: int = 32) -> None:
        super().__init__()
        self.channels, self.size, self.residual_mode = channels, (height, width), bool(residual)
        b = base  # models.py: 32; every width scales with it (tests train a narrow one)
        self.secret_dense = nn.Linear(code_bits, CODE_MAP * CODE_MAP * channels)
        self.conv1 = nn.Conv2d(2 * channels, b, 3, 1, 1)
        self.conv2 = nn.Conv2d(b, b, 3, 2, 1)
        self.conv3 = nn.Conv2d(b, 2 * b, 3, 2, 1)
        self.conv4 = nn.Conv2d(2 * b, 4 * b, 3, 2, 1)
        self.conv5 = nn.Conv2d(4 * b, 8 * b, 3, 2, 1)
        self.up6 = nn.Conv2d(8 * b, 4 * b, 2, 1)
        self.conv6 = nn.Conv2d(8 * b, 4 * b, 3, 1, 1)
        self.up7 = nn.Conv2d(4 * b, 2 * b, 2, 1)
        self.conv7 = nn.Conv2d(4 * b, 2 * b, 3, 1, 1)
        self.up8 = nn.Conv2d(2 * b, b, 2, 1)
        self.conv8 = nn.Conv2d(2 * b, b, 3, 1, 1)
        self.up9 = nn.Conv2d(b, b, 2, 1)
        self.conv9 = nn.Conv2d(2 * b + 2 * channels, b, 3, 1, 1)
        self.conv10 = nn.Conv2d(b, b, 3, 1, 1)
        self.out = nn.Conv2d(b, channels, 1)

    @staticmethod
    def _up(conv: nn.Conv2d, x: Tensor, like: Tensor) -> Tensor:
        # upsample x2, pad right and bottom by one, a 2x2 convolution: models.py's up6..up9
        return _fit(F.relu(conv(F.pad(F.interpolate(x, scale_factor=2.0, mode="nearest"), (0, 1, 0, 1)))), like)

    def forward(self, code: Tensor, image: Tensor) -> Tensor:
        code_map = F.relu(self.secret_dense(code)).view(-1, self.channels, CODE_MAP, CODE_MAP)
        code_map = F.interpolate(code_map, size=self.size, mode="nearest")
        inputs = torch.cat([code_map, image], 1)
        c1 = F.relu(self.conv1(inputs))
        c2 = F.relu(self.conv2(c1))
        c3 = F.relu(self.conv3(c2))
        c4 = F.relu(self.conv4(c3))
        c5 = F.relu(self.conv5(c4))
        c6 = F.relu(self.conv6(torch.cat([c4, self._up(self.up6, c5, c4)], 1)))
        c7 = F.relu(self.conv7(torch.cat([c3, self._up(self.up7, c6, c3)], 1)))
        c8 = F.relu(self.conv8(torch.cat([c2, self._up(self.up8, c7, c2)], 1)))
        c9 = F.relu(self.conv9(torch.cat([c1, self._up(self.up9, c8, c1), inputs], 1)))
        out = self.out(F.relu(self.conv10(c9)))
        return image + out if self.residual_mode else torch.sigmoid(out)


class StegaStampDecoder(nn.Module):
    """Image (B, C, H, W) -> the code's logits (B, bits): models.py's seven convolutions (five of
    stride 2), a dense layer of 512 and the output layer."""

    def __init__(self, channels: int, height: int, width: int, code_bits: int, base: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        b = base
        widths = [(channels, b, 2), (b, b, 1), (b, 2 * b, 2), (2 * b, 2 * b, 1), (2 * b, 2 * b, 2), (2 * b, 4 * b, 2),
                  (4 * b, 4 * b, 2)]
        h, w = height, width
        for cin, cout, stride in widths:
            layers += [nn.Conv2d(cin, cout, 3, stride, 1), nn.ReLU()]
            h, w = (h - 1) // stride + 1, (w - 1) // stride + 1
        self.decoder = nn.Sequential(*layers)
        self.dense = nn.Sequential(nn.Linear(4 * b * h * w, 16 * b), nn.ReLU(), nn.Linear(16 * b, code_bits))

    def forward(self, image: Tensor) -> Tensor:
        return self.dense(self.decoder(image).flatten(1))
