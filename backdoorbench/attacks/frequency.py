"""The frequency-domain triggers of FTrojan and CTRL: a windowed 2-D DCT, the two colour spaces their
official code moves into, and the coefficient bump both attacks are made of.

Both official codes scale images to 0-255, convert RGB to a luma/chroma space, cut each channel into
`window` x `window` tiles, take each tile's orthonormal DCT-II (`cv2.dct` in FTrojan, an FFT-based
`dct_2d(norm='ortho')` in CTRL: the same transform), add `magnitude` to a few coefficients of chosen
channels in every tile, invert, convert back and divide by 255. What differs is the colour space:

- FTrojan (SoftWiser-group/FTrojan, `image.py`): OpenCV's `COLOR_RGB2YCrCb` on 8-bit images, so the
  channels are (Y, Cr, Cb) with chroma offset 128, and every conversion rounds to 8 bits (OpenCV's
  fixed-point arithmetic) and the inverse starts from the tile values truncated to 8 bits
  (`astype(np.uint8)`);
- CTRL (meet-cjli/CTRL, `utils/frequency.py`): kornia 0.6.5's float `rgb_to_yuv` and `yuv_to_rgb`,
  whose rounded coefficients make the round trip approximate (within 0.6 of a level on 0-255).

Pure tensor code (float64 inside, the input's dtype out), on any device; docs/fidelity.md#ftrojan
and #ctrl hold the sources.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

from backdoorbench import checks
from backdoorbench.errors import ConfigError

# The official positions are given in a 32 x 32 tile: (15, 15) a mid and (31, 31) the highest
# frequency of both axes (FTrojan's README; CTRL's `--trigger_position 15 31`).
OFFICIAL_WINDOW = 32
OFFICIAL_POSITIONS = ((15, 15), (31, 31))

# OpenCV's BT.601 RGB <-> YCrCb for 8-bit images (opencv/opencv modules/imgproc/src/color_yuv.simd.hpp):
# Y = 0.299 R + 0.587 G + 0.114 B, Cr = (R - Y) 0.713 + 128, Cb = (B - Y) 0.564 + 128, and back
# R = Y + 1.403 (Cr - 128), G = Y - 0.714 (Cr - 128) - 0.344 (Cb - 128), B = Y + 1.773 (Cb - 128).
_LUMA = (0.299, 0.587, 0.114)
# kornia 0.6.5's kornia/color/yuv.py (CTRL's requirements.txt pins kornia==0.6.5), RGB in, YUV out:
_KORNIA_RGB_TO_YUV = ((0.299, 0.587, 0.114), (-0.147, -0.289, 0.436), (0.615, -0.515, -0.100))
_KORNIA_YUV_TO_RGB = ((1.0, 0.0, 1.14), (1.0, -0.396, -0.581), (1.0, 2.029, 0.0))


@functools.cache
def dct_matrix(n: int) -> Tensor:
    """The n x n orthonormal DCT-II matrix D (float64, CPU): a tile's coefficients are D X D^T and
    the tile is D^T C D, as `cv2.dct`/`cv2.idct` and scipy's `dct(norm='ortho')` compute them."""
    k = torch.arange(n, dtype=torch.float64).view(n, 1)
    i = torch.arange(n, dtype=torch.float64).view(1, n)
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d


def _tiles(x: Tensor, window: int) -> Tensor:
    """(B, C, H, W) -> (B, C, H/w, W/w, w, w), each tile's rows and columns last."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h // window, window, w // window, window).permute(0, 1, 2, 4, 3, 5)


def _untile(t: Tensor) -> Tensor:
    b, c, nh, nw, window, _ = t.shape
    return t.permute(0, 1, 2, 4, 3, 5).reshape(b, c, nh * window, nw * window)


def block_dct(x: Tensor, window: int) -> Tensor:
    """The orthonormal 2-D DCT-II of every `window` x `window` tile of (B, C, H, W), in place of the tile."""
    d = dct_matrix(window).to(x.device, torch.float64)
    return _untile(d @ _tiles(x.to(torch.float64), window) @ d.T)


def block_idct(coefficients: Tensor, window: int) -> Tensor:
    """The inverse of `block_dct`."""
    d = dct_matrix(window).to(coefficients.device, torch.float64)
    return _untile(d.T @ _tiles(coefficients.to(torch.float64), window) @ d)


def rgb_to_ycrcb(rgb: Tensor, eight_bit: bool = True) -> Tensor:
    """OpenCV's `COLOR_RGB2YCrCb`: (B, 3, H, W) RGB levels 0-255 -> (Y, Cr, Cb) levels. `eight_bit`:
    as on 8-bit images, the input rounded to levels, Y rounded before the chroma, each output rounded
    and saturated to 0-255, as the conversion stores them; else the float formula."""
    if eight_bit:
        rgb = rgb.round().clamp(0, 255)
    r, g, b = rgb.unbind(1)
    y = _LUMA[0] * r + _LUMA[1] * g + _LUMA[2] * b
    y = y.round() if eight_bit else y
    out = torch.stack([y, (r - y) * 0.713 + 128, (b - y) * 0.564 + 128], 1)
    return out.round().clamp(0, 255) if eight_bit else out


def ycrcb_to_rgb(ycc: Tensor, eight_bit: bool = True) -> Tensor:
    """OpenCV's `COLOR_YCrCb2RGB`: (Y, Cr, Cb) levels -> RGB levels. `eight_bit`: the input first
    made 8-bit levels, the output rounded and saturated; else the float formula.

    The official code makes the levels with `astype(np.uint8)`, a truncation, of the inverse DCT's
    floats: an untouched level k comes back as k - 1e-13 as often as k + 1e-13, so truncation takes
    one level off about half the pixels of every channel, a darkening set by float error. We round
    (and saturate, where numpy's out-of-range cast is undefined): docs/fidelity.md#ftrojan."""
    if eight_bit:
        ycc = ycc.clamp(0, 255).round()
    y, cr, cb = ycc.unbind(1)
    out = torch.stack([y + 1.403 * (cr - 128), y - 0.714 * (cr - 128) - 0.344 * (cb - 128),
                       y + 1.773 * (cb - 128)], 1)
    return out.round().clamp(0, 255) if eight_bit else out


def _mix(x: Tensor, matrix: tuple[tuple[float, ...], ...]) -> Tensor:
    m = torch.tensor(matrix, dtype=x.dtype, device=x.device)
    return torch.einsum("oc,bchw->bohw", m, x)


def rgb_to_yuv_kornia(rgb: Tensor) -> Tensor:
    """kornia 0.6.5's `rgb_to_yuv` (float, no offset), on any scale."""
    return _mix(rgb, _KORNIA_RGB_TO_YUV)


def yuv_to_rgb_kornia(yuv: Tensor) -> Tensor:
    """kornia 0.6.5's `yuv_to_rgb`: not the exact inverse of its `rgb_to_yuv` (rounded coefficients)."""
    return _mix(yuv, _KORNIA_YUV_TO_RGB)


def bump(coefficients: Tensor, channels: tuple[int, ...], window: int, positions: tuple[tuple[int, int], ...],
         magnitude: float) -> Tensor:
    """`magnitude` added to coefficient (u, v) of every tile of each channel in `channels`, for each
    (u, v) in `positions`, as both official loops do (a new tensor)."""
    out = coefficients.clone()
    for channel in channels:
        for u, v in positions:
            out[:, channel, u::window, v::window] += magnitude
    return out


@functools.lru_cache(maxsize=16)
def bump_pattern(shape: tuple[int, int, int], channels: tuple[int, ...], window: int,
                 positions: tuple[tuple[int, int], ...], magnitude: float) -> Tensor:
    """The bump in the pixel domain: `block_idct` of `bump` on all-zero coefficients, (1, C, H, W)
    float64 on the CPU. The windowed DCT being linear, idct(dct(x) + bump) = x + this pattern (to
    float64's rounding, ~1e-13 of a level), so `trigger` adds it and skips both transforms."""
    zeros = torch.zeros((1, *shape), dtype=torch.float64)
    return block_idct(bump(zeros, channels, window, positions, magnitude), window)


def trigger(x: Tensor, magnitude: float, channels: tuple[int, ...], window: int,
            positions: tuple[tuple[int, int], ...], to_space=None, from_space=None) -> Tensor:
    """Both official pipelines: (B, C, H, W) in [0, 1] to 0-255, into the colour space (`to_space`,
    None: none), the bump on every tile's coefficients, back (`from_space`), / 255, clipped to [0, 1].
    The bump is added as `bump_pattern`, the same sum without the two transforms of every image
    (tested equal to the transform-bump-invert pipeline)."""
    levels = x.to(torch.float64) * 255.0
    if to_space is not None:
        levels = to_space(levels)
    pattern = bump_pattern(tuple(levels.shape[1:]), tuple(channels), window, tuple(map(tuple, positions)), float(magnitude))
    levels = levels + pattern.to(levels.device)
    if from_space is not None:
        levels = from_space(levels)
    return (levels / 255.0).clamp(0.0, 1.0).to(x.dtype)


def _plain(value: Any) -> Any:
    """A value as the user wrote it: any list (OmegaConf's ListConfig too), nested, as a plain list."""
    return [_plain(v) for v in value] if checks.is_list(value) else value


def _shown(value: Any) -> str:
    return repr(_plain(value))


def resolve_geometry(group: str, image_shape: tuple[int, int, int], window: int | None,
                     positions: list | None, channels: list | None, chroma: tuple[int, ...]
                     ) -> tuple[int, tuple[tuple[int, int], ...], tuple[int, ...]]:
    """Checked (window, positions, channels) for `image_shape`, each refusal one line.

    `window` null: the official 32, or the whole image where it is smaller (28 px MNIST), so that
    tiles cover the image (64 px: four tiles, as the official loop cuts them). `positions` null: the
    official (15, 15) and (31, 31), rescaled to a smaller window as p * window // 32 (28 px: 13, 27),
    so that they keep their place in the spectrum. `channels` null: `chroma` on colour images, the
    only channel on grayscale ones."""
    c, h, w = image_shape
    if window is None:
        window = min(OFFICIAL_WINDOW, h, w)
    window = checks.integer(group, "window", window, 2, min(h, w), hint="the DCT tile's side in pixels")
    if h % window or w % window:
        raise ConfigError(f"{group}.window={window} does not tile {h}x{w} images; use a divisor of {math.gcd(h, w)}")
    if positions is None:
        positions = [[p * window // OFFICIAL_WINDOW for p in pair] for pair in OFFICIAL_POSITIONS]
    if not checks.is_list(positions) or not positions or not all(
            checks.is_list(p) and len(p) == 2 and all(checks.is_integer(i) and 0 <= i < window for i in p)
            for p in positions):
        raise ConfigError(f"{group}.positions={_shown(positions)} is invalid; use a list of [row, column] coefficient "
                          f"indices in [0, {window - 1}], e.g. [[15, 15], [31, 31]] in a 32-pixel window")
    if channels is None:
        channels = list(chroma) if c == 3 else [0]
    if not checks.is_list(channels) or not channels or not all(
            checks.is_integer(i) and 0 <= i < c for i in channels) or len(set(channels)) != len(channels):
        raise ConfigError(f"{group}.channels={_shown(channels)} is invalid for {c}-channel images; use distinct "
                          f"channel indices in [0, {c - 1}]")
    return window, tuple((int(u), int(v)) for u, v in positions), tuple(int(i) for i in channels)
