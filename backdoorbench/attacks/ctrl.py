"""CTRL: a bump on two DCT coefficients of the U and V channels of target-class images, labels kept."""

from __future__ import annotations

import torch
from torch import Tensor

from backdoorbench import checks
from backdoorbench.attacks import frequency
from backdoorbench.attacks.base import Attack
from backdoorbench.errors import ConfigError

# BackdoorBench's pratio 0.05 counts the whole training set and draws from the target class: on
# CIFAR-10, 2,500 of its 5,000 images. Ours counts the target class, as every clean-label attack here.
CLEAN_LABEL_RATE = 0.5
DIRTY_LABEL_RATE = 0.1


class CTRL(Attack):
    """CTRL (Li, Pang, Xi, Du, Ji, Yao, Wang, "An Embarrassingly Simple Backdoor Attack on
    Self-supervised Learning", ICCV 2023; official code meet-cjli/CTRL), in BackdoorBench's
    supervised form (attack/ctrl.py).

    The trigger: the image on 0-255 goes to YUV (kornia 0.6.5's float conversion, as the official
    code), each channel is cut into `window` x `window` tiles, `magnitude` is added to the
    orthonormal DCT coefficients at `positions` of every tile of U and V, and the tiles go back to
    pixels and to RGB. With magnitude 100 in a 32-px tile each coefficient moves a pixel's chroma
    by up to 100 * 2 / 32 = 6.25 levels. Clean-label: target-class training images carry it and keep
    their label, so the network ties the pattern to the class.

    Defaults are BackdoorBench's (config/attack/ctrl/default.yaml, utils/bd_img_transform/ctrl.py):
    magnitude 100, channels 1 and 2, positions (15, 15) and (31, 31) in a 32-px window, clean-label,
    target 0, and its pratio 0.05 of the whole set, here 0.5 of the target class (the same 2,500
    images on CIFAR-10; `poison_rate` counts the target class, as every clean-label attack here). The
    official SSL code poisons 1% of the set (`--poison_ratio 0.01`). BackdoorBench truncates the
    triggered images to 8 bits; the official code keeps floats, as our test-time images do (stored
    training images are rounded, as every attack's). On grayscale images (MNIST) there is no colour
    conversion: the trigger goes on the one channel. Images smaller than 32 px take one tile over the
    whole image with the positions rescaled to it (28 px: 13, 27). On 64 px the official code's
    `--window_size 32` tiles the image in four, where BackdoorBench takes one 64-px tile.
    Every value against its source: docs/fidelity.md#ctrl.

    Target modes: a clean-label all2all backdoor is not meaningful (the trigger only ever co-occurs
    with y -> y): all2all needs `clean_label=false`, the dirty-label variant (`poison_rate`, null =
    0.1, of the whole set, drawn from every class, relabelled), as for SIG.
    """

    name = "ctrl"
    family = "frequency"
    clean_label = True  # BackdoorBench's and the official code's setting; `clean_label=False` gives the dirty-label variant

    def __init__(
        self,
        *,
        magnitude: float = 100.0,
        channels: list[int] | None = None,
        window: int | None = None,
        positions: list[list[int]] | None = None,
        yuv: bool = True,
        clean_label: bool = True,
        poison_rate: float | None = None,
        **common,
    ) -> None:
        if poison_rate is None:
            poison_rate = CLEAN_LABEL_RATE if clean_label else DIRTY_LABEL_RATE
        super().__init__(poison_rate=poison_rate, **common)
        self.clean_label = bool(clean_label)
        if self.clean_label and self.target_mode == "all2all":
            raise ConfigError(
                "attack.target_mode=all2all is not meaningful for clean-label CTRL (poisoned images keep their "
                "label, so the trigger never maps y to y+1); use target_mode=all2one or attack.clean_label=false"
            )
        self.magnitude = checks.number("attack", "magnitude", magnitude, 0, low_open=True,
                                       hint="DCT coefficient units on 0-255 images")
        self.yuv = bool(yuv) and self.image_shape[0] == 3  # no colour conversion on grayscale images
        self.window, self.positions, self.channels = frequency.resolve_geometry(
            "attack", self.image_shape, window, positions, channels, chroma=(1, 2))

    @torch.no_grad()
    def apply_trigger(self, x: Tensor) -> Tensor:
        """(B, C, H, W) in [0, 1] -> the same images with the frequency bump."""
        if not self.yuv:
            return frequency.trigger(x, self.magnitude, self.channels, self.window, self.positions)
        return frequency.trigger(x, self.magnitude, self.channels, self.window, self.positions,
                                 frequency.rgb_to_yuv_kornia, frequency.yuv_to_rgb_kornia)

    def describe(self) -> dict:
        return {**super().describe(), "magnitude": self.magnitude, "channels": list(self.channels),
                "window": self.window, "positions": [list(p) for p in self.positions], "yuv": self.yuv}
