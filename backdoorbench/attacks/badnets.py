"""BadNets: a small fixed patch stamped onto the image."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from backdoorbench import checks
from backdoorbench.attacks.base import Attack
from backdoorbench.attacks.patterns import load_pattern
from backdoorbench.errors import ConfigError

CORNERS = ("bottom_right", "bottom_left", "top_right", "top_left")


class BadNets(Attack):
    """BadNets (Gu, Dolan-Gavitt, Garg, "BadNets: Identifying Vulnerabilities in the Machine
    Learning Model Supply Chain", arXiv 2017 / IEEE Access 2019).

    A `patch_size` x `patch_size` pattern replaces the pixels at a fixed location of a fraction of
    the training images, whose labels go to the target; at test time the same patch triggers it.
    conf/attack/badnets.yaml's default is BackdoorBench's (resource/badnet/trigger_image.png) and
    BackdoorBox's trigger: a 3x3 white square in the bottom-right corner, no margin; the paper's
    MNIST triggers are a single white pixel or a small white pattern near the corner. The class
    default stays the 3x3 black/white checkerboard some re-implementations use, which the defenses'
    synthetic unit tests are built on (a white corner is matched by their bright clean images).
    Departure: BackdoorBench resizes its 32x32 trigger image to the dataset (a 6x6 square on
    64 px Tiny-ImageNet); our patch keeps `patch_size` pixels on any image size. Every value
    against its source: docs/fidelity.md#badnets.
    """

    name = "badnets"
    family = "patch"
    aliases = ("badnet",)

    def __init__(
        self,
        *,
        patch_size: int = 3,
        location: str | Sequence[int] = "bottom_right",
        margin: int = 0,
        pattern: str = "checkerboard",
        seed: int = 0,
        **common,
    ) -> None:
        super().__init__(**common)
        channels, height, width = self.image_shape
        checks.integer("attack", "patch_size", patch_size, 1, min(height, width))
        self.top, self.left = _patch_origin(location, margin, patch_size, height, width)
        self.patch_size = patch_size
        if pattern == "checkerboard":
            rows = torch.arange(patch_size).view(-1, 1)
            cols = torch.arange(patch_size).view(1, -1)
            patch = ((rows + cols) % 2 == 0).float().expand(channels, -1, -1)
        elif pattern == "white":
            patch = torch.ones(channels, patch_size, patch_size)
        elif pattern == "black":
            patch = torch.zeros(channels, patch_size, patch_size)
        else:  # 'random', a scikit-image sample or an image file, resized to the patch
            patch = load_pattern(pattern, (channels, patch_size, patch_size), seed=seed)
        self.patch = patch.contiguous()

    def apply_trigger(self, x: Tensor) -> Tensor:
        out = x.clone()
        s = self.patch_size
        out[..., self.top : self.top + s, self.left : self.left + s] = self.patch.to(x.device, x.dtype)
        return out

    def patch_mask(self) -> Tensor:
        """(H, W) bool mask of the pixels the trigger overwrites."""
        _, height, width = self.image_shape
        mask = torch.zeros(height, width, dtype=torch.bool)
        mask[self.top : self.top + self.patch_size, self.left : self.left + self.patch_size] = True
        return mask


def _patch_origin(location, margin: int, size: int, height: int, width: int) -> tuple[int, int]:
    if isinstance(location, str):
        if location not in CORNERS:
            raise ConfigError(
                f"attack.location={location!r} is unknown; choose one of: {', '.join(CORNERS)}, or [row, col]"
            )
        top = margin if location.startswith("top") else height - size - margin
        left = margin if location.endswith("left") else width - size - margin
    else:
        top, left = (int(v) for v in location)
    if not (0 <= top <= height - size and 0 <= left <= width - size):
        raise ConfigError(
            f"attack.location={location!r} with margin {margin} puts the {size}x{size} patch outside the "
            f"{height}x{width} image; use row in [0, {height - size}] and col in [0, {width - size}]"
        )
    return top, left
