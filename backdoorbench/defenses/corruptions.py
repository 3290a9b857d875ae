"""The common image corruptions of ImageNet-C, batched in torch, as the `imagecorruptions` package
(bethgelab, v1.1.2, the version TeCo installs) computes them: the same severity tables, the same
steps, on (B, C, H, W) images in [0, 1] of any size (the package refuses images under 32 pixels).

Every function takes `(x, severity, generator)` and returns the corrupted images quantised as the
package's `np.uint8(...)` leaves them (floor to a multiple of 1/255). Randomness is drawn from
`generator` (on the CPU, then moved), one draw per image, where the package draws from numpy's
global stream. A one-channel image is corrupted as one channel (the package stacks it into three
and returns three). `frost` is absent: it blends photographs of frost the package ships, which we
do not. TeCo's ledger (docs/fidelity.md#teco) lists the small departures of each function.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

# The official order (imagecorruptions' `corruption_tuple[:15]`, TeCo's list), frost left out.
COMMON = ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
          "zoom_blur", "snow", "fog", "brightness", "contrast", "elastic_transform", "pixelate",
          "jpeg_compression")
OMITTED = {"frost": "blends photographs of frost shipped with imagecorruptions, which backdoorbench does not ship"}

# Severity tables, imagecorruptions/corruptions.py (one entry per severity 1..5).
GAUSSIAN_NOISE = (0.08, 0.12, 0.18, 0.26, 0.38)
SHOT_NOISE = (60, 25, 12, 5, 3)
IMPULSE_NOISE = (0.03, 0.06, 0.09, 0.17, 0.27)
DEFOCUS_BLUR = ((3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5))  # disk radius, alias blur
GLASS_BLUR = ((0.7, 1, 2), (0.9, 2, 1), (1, 2, 3), (1.1, 3, 2), (1.5, 4, 2))  # sigma, max delta, iterations
MOTION_BLUR = ((10, 3), (15, 5), (15, 8), (15, 12), (20, 15))  # radius, sigma
ZOOM_BLUR = ((1, 1.11, 0.01), (1, 1.16, 0.01), (1, 1.21, 0.02), (1, 1.26, 0.02), (1, 1.31, 0.03))  # np.arange
SNOW = ((0.1, 0.3, 3, 0.5, 10, 4, 0.8), (0.2, 0.3, 2, 0.5, 12, 4, 0.7), (0.55, 0.3, 4, 0.9, 12, 8, 0.7),
        (0.55, 0.3, 4.5, 0.85, 12, 8, 0.65), (0.55, 0.3, 2.5, 0.85, 12, 12, 0.55))
FOG = ((1.5, 2), (2.0, 2), (2.5, 1.7), (2.5, 1.5), (3.0, 1.4))  # strength, wibble decay
BRIGHTNESS = (0.1, 0.2, 0.3, 0.4, 0.5)
CONTRAST = (0.4, 0.3, 0.2, 0.1, 0.05)
ELASTIC_ALPHA = (250 * 0.05, 250 * 0.065, 250 * 0.085, 250 * 0.1, 250 * 0.12)
PIXELATE = (0.6, 0.5, 0.4, 0.3, 0.25)
JPEG_QUALITY = (25, 18, 15, 10, 7)


def quantise(x: Tensor) -> Tensor:
    """[0, 1] -> the package's `np.uint8(x * 255)` (a floor, in float64 as there), back in [0, 1]."""
    return (torch.floor(x.double().clamp(0.0, 1.0) * 255.0) / 255.0).to(x.dtype)


def _uniform(shape, low: float, high: float, generator: torch.Generator, like: Tensor) -> Tensor:
    return (torch.rand(shape, generator=generator, dtype=torch.float64) * (high - low) + low).to(like.device, like.dtype)


def _padded_index(n: int, radius: int, mode: str) -> Tensor:
    """Indices of a length-n axis padded by `radius`: scipy's 'nearest' (edge repeated),
    'reflect' (d c b a | a b c d) or cv2's BORDER_REFLECT_101 ('mirror': d c b | a b c d)."""
    i = torch.arange(-radius, n + radius)
    if mode == "nearest":
        return i.clamp(0, n - 1)
    period = 2 * n if mode == "reflect" else 2 * n - 2
    i = i % period if period > 0 else torch.zeros_like(i)
    if mode == "reflect":
        return torch.where(i < n, i, period - 1 - i)
    return torch.where(i < n, i, period - i)


def _filter_1d(x: Tensor, kernel: Tensor, dim: int, mode: str) -> Tensor:
    """Correlate the last-two-dims images `x` with a 1-D `kernel` along dim -2 or -1."""
    radius = (len(kernel) - 1) // 2
    n = x.shape[dim]
    padded = x.index_select(dim, _padded_index(n, radius, mode).to(x.device))
    windows = padded.unfold(dim, len(kernel), 1)  # (..., n, k) along `dim`
    return (windows * kernel.to(x.device, x.dtype)).sum(-1)


def gaussian_kernel(sigma: float, truncate: float) -> Tensor:
    """scipy.ndimage's Gaussian: radius int(truncate * sigma + 0.5), weights exp(-t^2 / 2 sigma^2), summing to 1."""
    radius = int(truncate * sigma + 0.5)
    t = torch.arange(-radius, radius + 1, dtype=torch.float64)
    k = torch.exp(-0.5 * (t / sigma) ** 2)
    return k / k.sum()


def gaussian_filter(x: Tensor, sigma: tuple[float, float], mode: str = "nearest", truncate: float = 4.0) -> Tensor:
    """skimage.filters.gaussian over the last two dims (its defaults: mode 'nearest', truncate 4)."""
    out = _filter_1d(x, gaussian_kernel(sigma[0], truncate), -2, mode)
    return _filter_1d(out, gaussian_kernel(sigma[1], truncate), -1, mode)


def gaussian_noise(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    c = GAUSSIAN_NOISE[severity - 1]
    noise = torch.randn(x.shape, generator=generator, dtype=torch.float64).to(x.device, x.dtype)
    return quantise(x + c * noise)


def shot_noise(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    c = SHOT_NOISE[severity - 1]
    counts = torch.poisson((x * c).double().cpu(), generator=generator).to(x.device, x.dtype)
    return quantise(counts / c)


def impulse_noise(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    """skimage's 's&p': each value flipped with probability `amount`, to 1 or 0 with even odds."""
    c = IMPULSE_NOISE[severity - 1]
    flipped = _uniform(x.shape, 0, 1, generator, x) <= c
    salted = _uniform(x.shape, 0, 1, generator, x) <= 0.5
    return quantise(torch.where(flipped, salted.to(x.dtype), x))


def disk_kernel(radius: int, alias_blur: float) -> Tensor:
    """The package's `disk`: a normalised disk on a (17 x 17) grid (radius <= 8) or (2r + 1)^2,
    smoothed by cv2.GaussianBlur (3 x 3, or 5 x 5 past radius 8; BORDER_REFLECT_101)."""
    half = 8 if radius <= 8 else radius
    ksize = 3 if radius <= 8 else 5
    t = torch.arange(-half, half + 1, dtype=torch.float64)
    disk = ((t.view(-1, 1) ** 2 + t.view(1, -1) ** 2) <= radius**2).double()
    disk = (disk / disk.sum()).float().double()  # the package builds it in float32
    u = torch.arange(ksize, dtype=torch.float64) - (ksize - 1) / 2
    g = torch.exp(-(u**2) / (2 * alias_blur**2))
    g = g / g.sum()
    return _filter_1d(_filter_1d(disk, g, -2, "mirror"), g, -1, "mirror")


def defocus_blur(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    radius, alias = DEFOCUS_BLUR[severity - 1]
    kernel = disk_kernel(radius, alias).to(x.device, x.dtype)
    half = kernel.shape[-1] // 2
    rows, cols = (_padded_index(n, half, "mirror").to(x.device) for n in x.shape[-2:])
    padded = x[..., rows, :][..., cols]  # cv2.filter2D's default border, BORDER_REFLECT_101
    b, ch = x.shape[:2]
    out = F.conv2d(padded.reshape(b * ch, 1, *padded.shape[-2:]), kernel[None, None])
    return quantise(out.reshape(x.shape))


def glass_blur(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    """Blur, floor to uint8, then the package's local shuffle: for each iteration, every pixel (h, w)
    from the bottom-right inward is swapped with (h + dy, w + dx), dx, dy drawn in [-d, d); blur again."""
    sigma, delta, iterations = GLASS_BLUR[severity - 1]
    b, ch, h, w = x.shape
    blurred = quantise(gaussian_filter(x, (sigma, sigma)))
    pixels = blurred.permute(0, 2, 3, 1).reshape(b, h * w, ch).contiguous()
    rows, cols = range(h - delta, delta, -1), range(w - delta, delta, -1)
    shifts = torch.randint(-delta, delta, (iterations, len(rows), len(cols), b, 2), generator=generator).to(x.device)
    every = torch.arange(b, device=x.device)
    for it in range(iterations):
        for i, r in enumerate(rows):
            for j, c in enumerate(cols):
                dx, dy = shifts[it, i, j, :, 0], shifts[it, i, j, :, 1]
                here, there = r * w + c, (r + dy) * w + (c + dx)
                kept = pixels[every, here].clone()
                pixels[every, here] = pixels[every, there]
                pixels[every, there] = kept
    shuffled = pixels.reshape(b, h, w, ch).permute(0, 3, 1, 2)
    return quantise(gaussian_filter(shuffled, (sigma, sigma)))


def _motion_offsets(width: int, angles: np.ndarray, height_limit: int, width_limit: int) -> tuple[Tensor, Tensor, Tensor]:
    """The package's `_motion_blur` steps: offsets (dy, dx) of the i-th of `width` shifted copies
    along each angle (degrees), and whether copy i is still added (the loop breaks at the first
    shift that leaves the image)."""
    dys, dxs, keep = [], [], []
    for angle in angles:
        point = (width * np.sin(np.deg2rad(angle)), width * np.cos(np.deg2rad(angle)))
        hypot = math.hypot(point[0], point[1])
        dy = [-math.ceil(((i * point[0]) / hypot) - 0.5) for i in range(width)]
        dx = [-math.ceil(((i * point[1]) / hypot) - 0.5) for i in range(width)]
        inside = np.cumprod([abs(a) < height_limit and abs(b) < width_limit for a, b in zip(dy, dx)]).astype(bool)
        dys.append(dy)
        dxs.append(dx)
        keep.append(inside)
    return torch.tensor(dys), torch.tensor(dxs), torch.tensor(np.array(keep))


def motion_kernel(radius: int, sigma: float) -> Tensor:
    """Weights of the 2r + 1 shifted copies: a half-Gaussian exp(-i^2 / 2 sigma^2), summing to 1."""
    i = torch.arange(2 * radius + 1, dtype=torch.float64)
    k = torch.exp(-(i**2) / (2 * sigma**2)) / (math.sqrt(2 * math.pi) * sigma)
    return k / k.sum()


def motion_blur_with(x: Tensor, radius: int, sigma: float, angles: np.ndarray) -> Tensor:
    """Sum of edge-clamped translations of `x` (B, C, H, W) along each image's angle (unclipped)."""
    b, _, h, w = x.shape
    kernel = motion_kernel(radius, sigma)
    dy, dx, keep = _motion_offsets(len(kernel), angles, h, w)
    out = torch.zeros_like(x)
    every = torch.arange(b, device=x.device).view(b, 1, 1)
    rows, cols = torch.arange(h).view(1, h), torch.arange(w).view(1, w)
    for i in range(len(kernel)):
        if not keep[:, i].any():
            break
        src_r = (rows - dy[:, i : i + 1]).clamp(0, h - 1).to(x.device)  # shift: the edge row repeats
        src_c = (cols - dx[:, i : i + 1]).clamp(0, w - 1).to(x.device)
        moved = x.permute(0, 2, 3, 1)[every, src_r.view(b, h, 1), src_c.view(b, 1, w)].permute(0, 3, 1, 2)
        weight = (kernel[i] * keep[:, i].double()).to(x.device, x.dtype).view(b, 1, 1, 1)
        out = out + weight * moved
    return out


def motion_blur(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    radius, sigma = MOTION_BLUR[severity - 1]
    angles = (torch.rand(len(x), generator=generator, dtype=torch.float64) * 90 - 45).numpy()
    return quantise(motion_blur_with(x, radius, sigma, angles))


def _zoom_axis(n: int, factor: float, device) -> tuple[Tensor, Tensor, Tensor]:
    """The package's `clipped_zoom` along one axis: the central m = ceil(n / factor) pixels zoomed
    by scipy.ndimage.zoom (order 1: round(m * factor) outputs, output o at input coordinate
    o (m - 1) / (out - 1)): (left index, right index, right weight) of every output pixel."""
    m = int(np.ceil(n / float(factor)))
    top = (n - m) // 2
    out = int(round(m * factor))
    coord = np.arange(out, dtype=np.float64) * ((m - 1) / (out - 1) if out > 1 else 0.0)
    left = np.clip(np.floor(coord).astype(np.int64), 0, m - 1)
    right = np.clip(left + 1, 0, m - 1)
    return (torch.from_numpy(left + top).to(device), torch.from_numpy(right + top).to(device),
            torch.from_numpy(coord - left).to(device))


def clipped_zoom(x: Tensor, factor: float) -> Tensor:
    """(..., H, W) -> the centre zoomed by `factor` (at least H x W: zoom_blur keeps its top-left H x W)."""
    r0, r1, rf = _zoom_axis(x.shape[-2], factor, x.device)
    c0, c1, cf = _zoom_axis(x.shape[-1], factor, x.device)
    rf, cf = rf.to(x.dtype).view(-1, 1), cf.to(x.dtype)
    top = x[..., r0, :] * (1 - rf) + x[..., r1, :] * rf
    return top[..., c0] * (1 - cf) + top[..., c1] * cf


def zoom_blur(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    factors = np.arange(*ZOOM_BLUR[severity - 1])
    out = torch.zeros_like(x)
    for factor in factors:
        out = out + clipped_zoom(x, float(factor))[..., : x.shape[-2], : x.shape[-1]]
    return quantise((x + out) / (len(factors) + 1))


def _gray(x: Tensor) -> Tensor:
    """cv2's RGB2GRAY on float images (0.299, 0.587, 0.114); a one-channel image is its own gray."""
    if x.shape[1] == 1:
        return x
    weights = torch.tensor([0.299, 0.587, 0.114], device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
    return (x[:, :3] * weights).sum(1, keepdim=True)


def snow(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    loc, scale, zoom, cut, radius, sigma, keep = SNOW[severity - 1]
    b, _, h, w = x.shape
    layer = (torch.randn((b, h, w), generator=generator, dtype=torch.float64) * scale + loc).to(x.device)
    layer = clipped_zoom(layer, zoom)  # the whole zoomed layer: blurred before the crop
    layer = torch.where(layer < cut, torch.zeros_like(layer), layer).clamp(0, 1)
    angles = (torch.rand(b, generator=generator, dtype=torch.float64) * 90 - 135).numpy()
    layer = motion_blur_with(layer.unsqueeze(1), radius, sigma, angles)
    layer = torch.round(layer * 255) / 255  # np.round: half to even, as torch.round
    layer = layer[..., :h, :w].to(x.dtype)
    x = keep * x + (1 - keep) * torch.maximum(x, _gray(x) * 1.5 + 0.5)
    return quantise(x + layer + torch.flip(layer, dims=(-2, -1)))


def plasma_fractal(count: int, mapsize: int, wibbledecay: float, generator: torch.Generator) -> Tensor:
    """The package's diamond-square height maps, (count, mapsize, mapsize) in [0, 1] (float64)."""
    grid = torch.zeros((count, mapsize, mapsize), dtype=torch.float64)
    step, wibble = mapsize, 100.0

    def wibbled_mean(total: Tensor) -> Tensor:
        return total / 4 + wibble * (torch.rand(total.shape, generator=generator, dtype=torch.float64) * 2 * wibble - wibble)

    while step >= 2:
        half = step // 2
        corners = grid[:, 0:mapsize:step, 0:mapsize:step]
        square = corners + torch.roll(corners, -1, dims=1)
        square = square + torch.roll(square, -1, dims=2)
        grid[:, half:mapsize:step, half:mapsize:step] = wibbled_mean(square)
        centres = grid[:, half:mapsize:step, half:mapsize:step]
        corners = grid[:, 0:mapsize:step, 0:mapsize:step]
        left = centres + torch.roll(centres, 1, dims=1) + corners + torch.roll(corners, -1, dims=2)
        grid[:, 0:mapsize:step, half:mapsize:step] = wibbled_mean(left)
        top = centres + torch.roll(centres, 1, dims=2) + corners + torch.roll(corners, -1, dims=1)
        grid[:, half:mapsize:step, 0:mapsize:step] = wibbled_mean(top)
        step //= 2
        wibble /= wibbledecay
    grid = grid - grid.flatten(1).amin(1).view(-1, 1, 1)
    return grid / grid.flatten(1).amax(1).view(-1, 1, 1)


def fog(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    strength, decay = FOG[severity - 1]
    b, ch, h, w = x.shape
    side = max(h, w, ch)  # the package takes the largest of the array's shape, channels included
    mapsize = 1 if side == 0 else 2 ** (side - 1).bit_length()
    peak = x.flatten(1).amax(1).view(-1, 1, 1, 1)
    layer = plasma_fractal(b, mapsize, decay, generator)[:, None, :h, :w].to(x.device, x.dtype)
    return quantise((x + strength * layer) * peak / (peak + strength))


def brightness(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    """V of HSV raised by c (skimage's rgb2hsv / hsv2rgb): with hue and saturation kept, every
    channel scales with V; a black pixel (V = 0, saturation 0) becomes gray V'."""
    c = BRIGHTNESS[severity - 1]
    if x.shape[1] < 3:
        return quantise(x + c)
    value = x.amax(1, keepdim=True)
    raised = (value + c).clamp(0, 1)
    return quantise(torch.where(value > 0, x * raised / value.clamp_min(1e-12), raised.expand_as(x)))


def contrast(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    c = CONTRAST[severity - 1]
    means = x.mean(dim=(-2, -1), keepdim=True)
    return quantise((x - means) * c + means)


def elastic_transform(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    """Random displacements uniform in +-0.005 H, smoothed (sigma 0.01 of each side, 'reflect',
    truncate 3), times alpha; bilinear resampling with the 'reflect' border."""
    alpha = ELASTIC_ALPHA[severity - 1]
    b, _, h, w = x.shape
    sigma, most = (0.01 * h, 0.01 * w), h * 0.005
    fields = []
    for _ in range(2):  # dx, then dy
        raw = torch.rand((b, h, w), generator=generator, dtype=torch.float64) * 2 * most - most
        fields.append((gaussian_filter(raw, sigma, mode="reflect", truncate=3) * alpha).float().double())
    dx, dy = (f.to(x.device) for f in fields)
    ys = torch.arange(h, device=x.device, dtype=torch.float64).view(1, h, 1) + dy
    xs = torch.arange(w, device=x.device, dtype=torch.float64).view(1, 1, w) + dx
    return quantise(_bilinear_reflect(x, ys, xs))


def _reflect(i: Tensor, n: int) -> Tensor:
    period = 2 * n
    i = i % period
    return torch.where(i < n, i, period - 1 - i)


def _bilinear_reflect(x: Tensor, ys: Tensor, xs: Tensor) -> Tensor:
    b, ch, h, w = x.shape
    y0, x0 = torch.floor(ys), torch.floor(xs)
    fy, fx = (ys - y0).to(x.dtype), (xs - x0).to(x.dtype)
    y0, x0 = y0.long(), x0.long()
    flat = x.reshape(b, ch, h * w)

    def at(yy: Tensor, xx: Tensor) -> Tensor:
        index = (_reflect(yy, h) * w + _reflect(xx, w)).view(b, 1, h * w).expand(b, ch, h * w)
        return flat.gather(2, index).view(b, ch, h, w)

    fy, fx = fy.unsqueeze(1), fx.unsqueeze(1)
    return ((1 - fy) * ((1 - fx) * at(y0, x0) + fx * at(y0, x0 + 1))
            + fy * ((1 - fx) * at(y0 + 1, x0) + fx * at(y0 + 1, x0 + 1)))


def box_weights(n_in: int, n_out: int) -> Tensor:
    """PIL's BOX resampling (downscale) as an (n_out, n_in) matrix: output pixel o averages the
    input pixels whose centres fall in ((o + 0.5) s - s / 2, (o + 0.5) s + s / 2], s = n_in / n_out."""
    scale = n_in / n_out
    support = 0.5 * max(scale, 1.0)
    weights = torch.zeros(n_out, n_in, dtype=torch.float64)
    for o in range(n_out):
        centre = (o + 0.5) * scale
        lo = max(int(centre - support + 0.5), 0)
        hi = min(int(centre + support + 0.5), n_in)
        for i in range(lo, hi):
            t = (i - centre + 0.5) / max(scale, 1.0)
            weights[o, i] = 1.0 if -0.5 < t <= 0.5 else 0.0
    return weights / weights.sum(1, keepdim=True)


def pixelate(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    """PIL: resize to int(side * c) with BOX (two passes, horizontal first, each rounded to 8
    bits), then back with NEAREST (source pixel floor((o + 0.5) * in / out))."""
    c = PIXELATE[severity - 1]
    h, w = x.shape[-2:]
    small_h, small_w = int(h * c), int(w * c)
    pixels = torch.round(x.double() * 255)
    across = box_weights(w, small_w).to(x.device)
    down = box_weights(h, small_h).to(x.device)
    pixels = torch.floor(pixels @ across.T + 0.5)
    pixels = torch.floor(down @ pixels + 0.5)
    rows = ((torch.arange(h, dtype=torch.float64) + 0.5) * small_h / h).floor().long().to(x.device)
    cols = ((torch.arange(w, dtype=torch.float64) + 0.5) * small_w / w).floor().long().to(x.device)
    return (pixels[..., rows, :][..., cols] / 255).to(x.dtype)


def jpeg_compression(x: Tensor, severity: int, generator: torch.Generator) -> Tensor:
    """PIL's JPEG at the severity's quality, image by image (mode RGB, or L for one channel)."""
    quality = JPEG_QUALITY[severity - 1]
    pixels = torch.round(x.clamp(0, 1) * 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    out = []
    for image in pixels:
        buffer = io.BytesIO()
        Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(buffer, "JPEG", quality=quality)
        decoded = np.array(Image.open(buffer))
        out.append(decoded.reshape(image.shape))
    return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).to(x.device, x.dtype) / 255


CORRUPTIONS: dict[str, Callable[[Tensor, int, torch.Generator], Tensor]] = {
    name: globals()[name] for name in COMMON}


def corrupt(x: Tensor, name: str, severity: int, generator: torch.Generator) -> Tensor:
    """`x` (B, C, H, W) in [0, 1] corrupted by `name` at `severity` (1..5)."""
    return CORRUPTIONS[name](x, severity, generator)
