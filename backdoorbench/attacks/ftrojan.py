"""FTrojan: a bump on a few DCT coefficients of the chroma channels, invisible in the pixels."""

from __future__ import annotations

import torch
from torch import Tensor

from backdoorbench import checks
from backdoorbench.attacks import frequency
from backdoorbench.attacks.base import Attack


class FTrojan(Attack):
    """FTrojan (Wang, Yao, Xu, An, Tong, Wang, "An Invisible Black-Box Backdoor Attack Through
    Frequency Domain", ECCV 2022; official code SoftWiser-group/FTrojan).

    The trigger: the image on 0-255 goes to YCrCb (OpenCV's 8-bit conversion), each channel is cut
    into `window` x `window` tiles, `magnitude` is added to the orthonormal DCT coefficients at
    `positions` of every tile of the chosen channels (Cr and Cb), and the tiles go back to pixels
    and to RGB. With magnitude 30 in a 32-px tile a coefficient moves each pixel by at most
    30 * 2 / 32 = 1.9 levels: invisible, yet a network learns it. Dirty-label: `poison_rate` of the
    training set, drawn from every class, relabelled by the target rule, so all2one and all2all
    are both the paper's setting (its official code poisons non-target images, relabelled).

    Defaults are BackdoorBench's (config/attack/ftrojannn/default.yaml): magnitude 30 on channels
    1 and 2 (Cr, Cb), window 32, positions (15, 15) and (31, 31), 10% poisoned, target 0. The
    official train.py uses magnitude 20 and 2% poisoned to target 8. `eight_bit` (default true) keeps
    the official code's 8-bit steps: YCrCb rounded after the forward conversion, truncated before
    the inverse one, RGB rounded. On grayscale images (MNIST) there is no colour conversion: the
    trigger goes on the one channel, as the official code's `YUV: False` path (no 8-bit steps).
    Images smaller than 32 px (28-px MNIST) take one tile over the whole image with the positions
    rescaled to it (13, 27): the official code would index past a 28-px tile and BackdoorBench's
    RGB conversion refuses one channel. Every value against its source: docs/fidelity.md#ftrojan.

    Departures: the official code poisons the first images of its index order; ours a seeded
    random draw (the toolkit's rule for every attack). Its clean-label mode (a gradient step against
    a clean model before the bump) is not offered; BackdoorBench runs the dirty-label one.
    """

    name = "ftrojan"
    family = "frequency"
    aliases = ("ftrojann", "ft_trojan")

    def __init__(
        self,
        *,
        magnitude: float = 30.0,
        channels: list[int] | None = None,
        window: int | None = None,
        positions: list[list[int]] | None = None,
        yuv: bool = True,
        eight_bit: bool = True,
        **common,
    ) -> None:
        super().__init__(**common)
        self.magnitude = checks.number("attack", "magnitude", magnitude, 0, low_open=True,
                                       hint="DCT coefficient units on 0-255 images")
        self.yuv = bool(yuv) and self.image_shape[0] == 3  # no colour conversion on grayscale images
        self.eight_bit = bool(eight_bit)
        self.window, self.positions, self.channels = frequency.resolve_geometry(
            "attack", self.image_shape, window, positions, channels, chroma=(1, 2))

    @torch.no_grad()
    def apply_trigger(self, x: Tensor) -> Tensor:
        """(B, C, H, W) in [0, 1] -> the same images with the frequency bump."""
        if not self.yuv:
            return frequency.trigger(x, self.magnitude, self.channels, self.window, self.positions)
        return frequency.trigger(x, self.magnitude, self.channels, self.window, self.positions,
                                 lambda v: frequency.rgb_to_ycrcb(v, self.eight_bit), lambda v: frequency.ycrcb_to_rgb(v, self.eight_bit))

    def describe(self) -> dict:
        return {**super().describe(), "magnitude": self.magnitude, "channels": list(self.channels),
                "window": self.window, "positions": [list(p) for p in self.positions], "yuv": self.yuv,
                "eight_bit": self.eight_bit}
