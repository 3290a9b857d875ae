"""The SupCon training views D-ST's secure training draws (the official `ST/train_extractor.py`'s
transform, from HobbitLong/SupContrast): RandomResizedCrop(size, scale=(0.2, 1)), a horizontal flip,
ColorJitter(0.4, 0.4, 0.4, 0.1) with probability 0.8 and RandomGrayscale(0.2), batched on float
tensors in [0, 1], every draw on a CPU generator. One channel images (MNIST) skip saturation, hue and
grayscale, as torchvision does on an `L` image."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

SCALE = (0.2, 1.0)
RATIO = (3 / 4, 4 / 3)
JITTER = (0.4, 0.4, 0.4, 0.1)  # brightness, contrast, saturation, hue
JITTER_P = 0.8
GRAYSCALE_P = 0.2
GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale


def resized_crop_boxes(count: int, height: int, width: int, generator: torch.Generator) -> Tensor:
    """(top, left, h, w) per image as torchvision's RandomResizedCrop.get_params draws them: up to 10
    tries of an area share in SCALE and a log-uniform aspect in RATIO, the first that fits, else the
    centre crop clamped to RATIO. Long (count, 4)."""
    area = height * width
    shares = torch.empty(count, 10, dtype=torch.float64).uniform_(*SCALE, generator=generator)
    logs = torch.empty(count, 10, dtype=torch.float64).uniform_(math.log(RATIO[0]), math.log(RATIO[1]), generator=generator)
    where = torch.rand(count, 10, 2, generator=generator, dtype=torch.float64)
    aspect = logs.exp()
    w = torch.round(torch.sqrt(area * shares * aspect)).long()
    h = torch.round(torch.sqrt(area * shares / aspect)).long()
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    top = (where[..., 0] * (height - h + 1).clamp(min=1)).long()
    left = (where[..., 1] * (width - w + 1).clamp(min=1)).long()
    # the centre crop when no try fits
    ratio = width / height
    if ratio < RATIO[0]:
        cw, ch = width, int(round(width / RATIO[0]))
    elif ratio > RATIO[1]:
        ch, cw = height, int(round(height * RATIO[1]))
    else:
        cw, ch = width, height
    first = torch.where(fits.any(1), fits.long().argmax(1), torch.full((count,), -1))
    rows = torch.arange(count)
    pick = first.clamp(min=0)
    boxes = torch.stack([top[rows, pick], left[rows, pick], h[rows, pick], w[rows, pick]], 1)
    fallback = torch.tensor([(height - ch) // 2, (width - cw) // 2, ch, cw])
    return torch.where((first < 0)[:, None], fallback, boxes)


def resized_crop(x: Tensor, boxes: Tensor, mode: str = "bilinear") -> Tensor:
    """Each image's box (top, left, h, w) resized back to the image size, bilinearly (or `mode`
    "bicubic", clamped to [0, 1] as PIL's bicubic is to its pixel range)."""
    batch, channels, height, width = x.shape
    top, left, h, w = (boxes[:, i].to(x.device, torch.float32) for i in range(4))
    # output pixel centre -> input coordinate, in affine_grid's [-1, 1] units (align_corners=False)
    theta = torch.zeros(batch, 2, 3, device=x.device)
    theta[:, 0, 0], theta[:, 0, 2] = w / width, (2 * left + w) / width - 1
    theta[:, 1, 1], theta[:, 1, 2] = h / height, (2 * top + h) / height - 1
    grid = F.affine_grid(theta, [batch, channels, height, width], align_corners=False)
    with torch.autocast(x.device.type, enabled=False):
        out = F.grid_sample(x.float(), grid, mode=mode, padding_mode="border", align_corners=False)
    return out.clamp_(0, 1) if mode == "bicubic" else out


def grayscale(x: Tensor) -> Tensor:
    """(B, 1, H, W) luma of RGB images; one-channel images as they are."""
    if x.shape[1] == 1:
        return x
    r, g, b = x.unbind(1)
    return (GRAY_WEIGHTS[0] * r + GRAY_WEIGHTS[1] * g + GRAY_WEIGHTS[2] * b).unsqueeze(1)


def rgb_to_hsv(x: Tensor) -> Tensor:
    r, g, b = x.unbind(1)
    maxc, minc = x.max(1).values, x.min(1).values
    span = maxc - minc
    s = span / torch.where(maxc == 0, torch.ones_like(maxc), maxc)
    safe = torch.where(span == 0, torch.ones_like(span), span)
    rc, gc, bc = (maxc - r) / safe, (maxc - g) / safe, (maxc - b) / safe
    h = torch.where(maxc == r, bc - gc, torch.where(maxc == g, 2.0 + rc - bc, 4.0 + gc - rc))
    h = torch.where(span == 0, torch.zeros_like(h), h)
    return torch.stack([(h / 6.0) % 1.0, s, maxc], 1)


def hsv_to_rgb(x: Tensor) -> Tensor:
    h, s, v = x.unbind(1)
    sector = torch.floor(h * 6.0)
    f = h * 6.0 - sector
    sector = sector.long() % 6
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    table = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)]
    out = torch.zeros_like(x)
    for i, (r, g, b) in enumerate(table):
        chosen = (sector == i).unsqueeze(1)
        out = torch.where(chosen, torch.stack([r, g, b], 1), out)
    return out


def _brightness(x: Tensor, f: Tensor) -> Tensor:
    return (x * f).clamp(0, 1)


def _contrast(x: Tensor, f: Tensor) -> Tensor:
    mean = grayscale(x).mean((1, 2, 3), keepdim=True)
    return (f * x + (1 - f) * mean).clamp(0, 1)


def _saturation(x: Tensor, f: Tensor) -> Tensor:
    if x.shape[1] == 1:
        return x
    return (f * x + (1 - f) * grayscale(x)).clamp(0, 1)


def _hue(x: Tensor, f: Tensor) -> Tensor:
    if x.shape[1] == 1:
        return x
    hsv = rgb_to_hsv(x)
    hsv = torch.cat([(hsv[:, :1] + f) % 1.0, hsv[:, 1:]], 1)
    return hsv_to_rgb(hsv)


def color_jitter(x: Tensor, generator: torch.Generator) -> Tensor:
    """ColorJitter(0.4, 0.4, 0.4, 0.1) on each image with probability 0.8: brightness, contrast and
    saturation factors uniform in [0.6, 1.4], a hue shift uniform in [-0.1, 0.1], the four applied in
    an order drawn per image (torchvision's `fn_idx`). Writes into `x`."""
    batch = len(x)
    on = torch.rand(batch, generator=generator) < JITTER_P
    factors = torch.stack([torch.empty(batch).uniform_(1 - JITTER[0], 1 + JITTER[0], generator=generator),
                           torch.empty(batch).uniform_(1 - JITTER[1], 1 + JITTER[1], generator=generator),
                           torch.empty(batch).uniform_(1 - JITTER[2], 1 + JITTER[2], generator=generator),
                           torch.empty(batch).uniform_(-JITTER[3], JITTER[3], generator=generator)], 1)
    order = torch.argsort(torch.rand(batch, 4, generator=generator), dim=1)
    on, factors, order = on.to(x.device), factors.to(x.device), order.to(x.device)
    ops = (_brightness, _contrast, _saturation, _hue)
    for position in range(4):
        for op_index, op in enumerate(ops):
            chosen = on & (order[:, position] == op_index)
            if chosen.any():
                x[chosen] = op(x[chosen], factors[chosen, op_index].view(-1, 1, 1, 1))
    return x


def supcon_view(x: Tensor, generator: torch.Generator, hflip: bool, mode: str = "bilinear") -> Tensor:
    """One SupCon view of each image of `x` (float in [0, 1], (B, C, H, W)); `hflip` False leaves
    the flip out (a dataset whose classes a flip changes); `mode` the crop's interpolation."""
    batch, channels, height, width = x.shape
    x = resized_crop(x, resized_crop_boxes(batch, height, width, generator), mode)
    if hflip:
        flips = (torch.rand(batch, generator=generator) < 0.5).to(x.device)
        x = torch.where(flips[:, None, None, None], x.flip(3), x)
    x = color_jitter(x.clone(), generator)
    if channels == 3:
        gray = (torch.rand(batch, generator=generator) < GRAYSCALE_P).to(x.device)
        x = torch.where(gray[:, None, None, None], grayscale(x).expand_as(x), x)
    return x
