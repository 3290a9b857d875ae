"""Stealthiness of a trigger: how far poisoned images are from their clean originals, in pixel units.

`stealth_metrics(clean, poisoned)` compares float images in [0, 1], shape (N, C, H, W), image by
image, and returns the mean and (population) std over the N images of:

- PSNR in dB, 10 log10(1 / MSE), MSE over all pixels and channels (scikit-image's
  `peak_signal_noise_ratio` with data_range=1). Identical images have PSNR = +inf, which JSON can't
  hold, so every value is capped at PSNR_CAP_DB = 100 dB. No real change survives the cap: one pixel
  off by one 8-bit level in a 64x64x3 image is 89 dB. `n_psnr_capped` counts the images at the cap.
- SSIM as scikit-image's `structural_similarity` with its defaults (data_range=1, 7x7 uniform
  window, sample covariance N/(N-1), mean over the region the window fits in without padding, mean
  over channels), computed batched in float64 with pooling/conv2d. `gaussian_weights=True` gives the
  paper's setting (Wang et al., IEEE TIP 2004: 11x11 Gaussian window, sigma 1.5, no N/(N-1)).
- LPIPS v0.1 with the AlexNet trunk (Zhang et al., CVPR 2018), through the `lpips` package. Its
  linear layers ship inside the package; the AlexNet ImageNet weights are torchvision's
  alexnet-owt-7be5be79.pth, found or downloaded once as the `lpips` argument (`eval.lpips`: auto,
  off or a path) says (metrics/lpips_weights.py). Without them LPIPS is None with the reason (and
  one warning where they were wanted): never a number from an untrained network.
  Gray images are repeated to 3 channels; images under 32 px a side (AlexNet's smallest input,
  e.g. 28 px MNIST) are upsampled bilinearly so the short side is 32.
- L_inf and L_2 norms of (poisoned - clean) per image, in [0, 1] pixel units.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from backdoorbench.errors import DataError
from backdoorbench.fileio import torch_load
from backdoorbench.metrics.lpips_weights import (
    ALEXNET_FILE,
    ALEXNET_URL,
    LPIPS_URL_ENV,
    LPIPS_WEIGHTS_ENV,
    alexnet_hub_path,
    resolve_alexnet_weights,
)

PSNR_CAP_DB = 100.0
LPIPS_MIN_SIZE = 32

# skimage.metrics.structural_similarity's constants.
SSIM_K1, SSIM_K2 = 0.01, 0.03
SSIM_UNIFORM_WINDOW = 7
SSIM_GAUSSIAN_SIGMA, SSIM_GAUSSIAN_TRUNCATE = 1.5, 3.5


class LpipsUnavailableWarning(UserWarning):
    """LPIPS was skipped because the AlexNet backbone weights are not on this machine and could not be fetched."""


# ----------------------------------------------------------------------------- pixel metrics


def _as_float(images: Tensor, name: str) -> Tensor:
    if not isinstance(images, Tensor) or images.dim() != 4:
        shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise DataError(f"{name} images must be a tensor of shape (N, C, H, W), got {shape}")
    if images.dtype == torch.uint8:
        return images.float() / 255
    if not images.is_floating_point():
        raise DataError(f"{name} images must be float in [0, 1] or uint8, got {images.dtype}")
    if images.numel() and not (images.min() >= 0 and images.max() <= 1):  # also False for NaN
        raise DataError(
            f"{name} images must lie in [0, 1], got values in [{images.min().item():.4g}, {images.max().item():.4g}]"
        )
    return images


def _check_pair(clean: Tensor, poisoned: Tensor) -> tuple[Tensor, Tensor]:
    clean, poisoned = _as_float(clean, "clean"), _as_float(poisoned, "poisoned")
    if clean.shape != poisoned.shape:
        raise DataError(
            f"clean and poisoned images must have the same shape, got {tuple(clean.shape)} and {tuple(poisoned.shape)}"
        )
    if clean.shape[0] == 0:
        raise DataError("stealth metrics need at least one image pair, got 0")
    return clean, poisoned


def psnr(clean: Tensor, poisoned: Tensor) -> Tensor:
    """PSNR in dB per image (data range 1), capped at PSNR_CAP_DB so identical images stay finite."""
    clean, poisoned = _check_pair(clean, poisoned)
    mse = (poisoned.double() - clean.double()).pow(2).flatten(1).mean(1)
    return (10 * torch.log10(1 / mse)).clamp(max=PSNR_CAP_DB)  # mse = 0 -> inf -> cap


def linf_distance(clean: Tensor, poisoned: Tensor) -> Tensor:
    """max |poisoned - clean| per image."""
    clean, poisoned = _check_pair(clean, poisoned)
    return (poisoned.double() - clean.double()).abs().flatten(1).amax(1)


def l2_distance(clean: Tensor, poisoned: Tensor) -> Tensor:
    """||poisoned - clean||_2 per image, over all pixels and channels."""
    clean, poisoned = _check_pair(clean, poisoned)
    return torch.linalg.vector_norm(poisoned.double() - clean.double(), dim=(1, 2, 3))


def _gaussian_kernel(device: torch.device) -> Tensor:
    """scipy.ndimage.gaussian_filter's 1-D kernel: radius int(truncate * sigma + 0.5), sum 1."""
    radius = int(SSIM_GAUSSIAN_TRUNCATE * SSIM_GAUSSIAN_SIGMA + 0.5)
    x = torch.arange(-radius, radius + 1, dtype=torch.float64, device=device)
    kernel = torch.exp(-0.5 * (x / SSIM_GAUSSIAN_SIGMA) ** 2)
    return kernel / kernel.sum()


def _local_means(maps: Tensor, gaussian_weights: bool) -> Tensor:
    """Window means of (M, 1, H, W) maps where the window fits: exactly skimage's filter followed by
    its crop of (size - 1) // 2 pixels on each border, which is why no padding mode matters."""
    if not gaussian_weights:
        return F.avg_pool2d(maps, SSIM_UNIFORM_WINDOW, stride=1)  # scipy's uniform_filter
    kernel = _gaussian_kernel(maps.device)
    size = kernel.numel()
    return F.conv2d(F.conv2d(maps, kernel.view(1, 1, size, 1)), kernel.view(1, 1, 1, size))


def ssim(
    clean: Tensor,
    poisoned: Tensor,
    *,
    gaussian_weights: bool = False,
    device: str | torch.device = "cpu",
    batch_size: int = 512,
) -> Tensor:
    """SSIM per image, equal to skimage's structural_similarity(data_range=1, channel_axis=0)
    (and gaussian_weights=True, sigma=1.5, use_sample_covariance=False when asked)."""
    clean, poisoned = _check_pair(clean, poisoned)
    device = torch.device(device)
    size = 2 * int(SSIM_GAUSSIAN_TRUNCATE * SSIM_GAUSSIAN_SIGMA + 0.5) + 1 if gaussian_weights else SSIM_UNIFORM_WINDOW
    # skimage's use_sample_covariance: N/(N-1) with its uniform window; the paper's 1 with Gaussian weights.
    cov_norm = 1.0 if gaussian_weights else size**2 / (size**2 - 1)
    _, channels, height, width = clean.shape
    if min(height, width) < size:
        raise DataError(f"SSIM needs images of at least {size}x{size} pixels, got {height}x{width}")
    c1, c2 = SSIM_K1**2, SSIM_K2**2  # (K * data_range)^2 with data_range = 1
    scores = []
    for start in range(0, len(clean), batch_size):
        n = len(clean[start : start + batch_size])
        # The five maps whose local means SSIM needs, filtered in one call.
        stack = torch.empty(5, n, channels, height, width, dtype=torch.float64, device=device)
        x, y = stack[0], stack[1]
        x.copy_(clean[start : start + n])
        y.copy_(poisoned[start : start + n])
        torch.mul(x, x, out=stack[2])
        torch.mul(y, y, out=stack[3])
        torch.mul(x, y, out=stack[4])
        means = _local_means(stack.view(-1, 1, height, width), gaussian_weights)
        mu_x, mu_y, mu_xx, mu_yy, mu_xy = means.view(5, n, channels, height - size + 1, width - size + 1)
        var_x = cov_norm * (mu_xx - mu_x * mu_x)
        var_y = cov_norm * (mu_yy - mu_y * mu_y)
        cov_xy = cov_norm * (mu_xy - mu_x * mu_y)
        s = ((2 * mu_x * mu_y + c1) * (2 * cov_xy + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
        scores.append(s.mean(dim=(1, 2, 3)).cpu())  # mean per channel, then over channels: same sizes
    return torch.cat(scores)


# ----------------------------------------------------------------------------- LPIPS


def _alexnet_features(path: Path) -> dict[str, Tensor]:
    """The conv weights of AlexNet's `features` from a torchvision checkpoint (full model or features only)."""
    try:
        state = torch_load(path, map_location="cpu")
    except Exception as exc:  # truncated zip, not a checkpoint, pickled objects refused, ...
        raise DataError(f"{path}: cannot be read as torchvision AlexNet weights ({type(exc).__name__}); "
                        f"replace it with {ALEXNET_URL}") from exc
    if not isinstance(state, dict):
        raise DataError(f"{path}: holds a {type(state).__name__}, not an AlexNet state dict; replace it with {ALEXNET_URL}")
    prefix = "features." if any(str(key).startswith("features.") for key in state) else ""
    return {key[len(prefix):]: value for key, value in state.items() if isinstance(key, str) and key.startswith(prefix)}


_LPIPS_CACHE: dict[tuple[str, int, int, str], torch.nn.Module] = {}


def load_lpips(weights: str | os.PathLike, device: str | torch.device = "cpu") -> torch.nn.Module:
    """lpips.LPIPS(net='alex', version='0.1') with its AlexNet trunk loaded from `weights`, built
    without torchvision downloading anything; cached per file and device.

    The network is laid out on the meta device and every tensor is then assigned from the files:
    torchvision would otherwise initialise a whole AlexNet (61M parameters, seconds of CPU) only
    for lpips to keep its 2.5M-parameter trunk and overwrite it."""
    path = Path(weights).expanduser().resolve()
    stat = path.stat()
    key = (str(path), stat.st_mtime_ns, stat.st_size, str(torch.device(device)))
    if key in _LPIPS_CACHE:
        return _LPIPS_CACHE[key]
    import lpips

    features = _alexnet_features(path)  # before building anything: a bad file fails fast
    with warnings.catch_warnings():
        # lpips asks torchvision for alexnet(pretrained=False): deprecated, harmless, and no download.
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torchvision\.models\._utils")
        with torch.device("meta"):
            model = lpips.LPIPS(pretrained=False, net="alex", version="0.1", pnet_rand=True, verbose=False)
    model.scaling_layer = lpips.ScalingLayer()  # its two constant buffers, built for real
    trunk = {}
    for name, param in model.net.state_dict().items():  # e.g. slice2.3.weight <- features 3.weight
        source = name.split(".", 1)[1]
        if source not in features or features[source].shape != param.shape:
            found = tuple(features[source].shape) if source in features else "missing"
            raise DataError(f"{path}: AlexNet layer features.{source} should have shape {tuple(param.shape)}, "
                            f"got {found}; replace it with {ALEXNET_URL}")
        trunk[name] = features[source]
    model.net.load_state_dict(trunk, strict=True, assign=True)

    # The linear layers calibrated on human judgments, shipped inside the lpips package.
    linear_path = Path(lpips.__file__).parent / "weights" / "v0.1" / "alex.pth"
    linear = torch_load(linear_path, map_location="cpu")
    expected = {name for name in model.state_dict() if name.startswith("lin") and not name.startswith("lins.")}
    if set(linear) != expected:  # lins.k are the same parameters as link
        raise DataError(f"{linear_path}: not the lpips v0.1 AlexNet linear layers; reinstall lpips")
    model.load_state_dict(linear, strict=False, assign=True)
    unset = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
    if unset:  # a layer the lpips package added since: never compute with a tensor no file gave
        raise DataError(f"this lpips package has layers no weights file sets ({', '.join(unset)}); install lpips 0.1.4")
    model = model.eval().requires_grad_(False).to(device)
    _LPIPS_CACHE[key] = model
    return model


def _lpips_input(images: Tensor) -> Tensor:
    """[0, 1] images -> 3-channel images in [-1, 1] (what lpips expects), short side >= 32 px."""
    if images.shape[1] == 1:
        images = images.expand(-1, 3, -1, -1)
    height, width = images.shape[-2:]
    if min(height, width) < LPIPS_MIN_SIZE:
        scale = LPIPS_MIN_SIZE / min(height, width)
        size = (max(LPIPS_MIN_SIZE, round(height * scale)), max(LPIPS_MIN_SIZE, round(width * scale)))
        images = F.interpolate(images, size=size, mode="bilinear", align_corners=False)
    return images * 2 - 1


@torch.no_grad()
def lpips_distance(
    clean: Tensor, poisoned: Tensor, model: torch.nn.Module, *, batch_size: int = 256
) -> Tensor:
    """LPIPS per image with a model from `load_lpips`."""
    clean, poisoned = _check_pair(clean, poisoned)
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(clean), batch_size):
        x = _lpips_input(clean[start : start + batch_size].to(device, torch.float32))
        y = _lpips_input(poisoned[start : start + batch_size].to(device, torch.float32))
        out.append(model(x, y).flatten().double().cpu())
    return torch.cat(out)


# ----------------------------------------------------------------------------- all together


def _summary(values: Tensor) -> dict[str, float]:
    values = values.double()
    # Population std (ddof=0): defined for a single image, and describes the images measured.
    return {"mean": float(values.mean()), "std": float(values.std(correction=0))}


def stealth_metrics(
    clean: Tensor,
    poisoned: Tensor,
    *,
    lpips: str | os.PathLike | None = "auto",
    device: str | torch.device = "cpu",
    batch_size: int = 256,
) -> dict[str, Any]:
    """PSNR, SSIM, LPIPS, L_inf and L_2 of `poisoned` against `clean` ((N, C, H, W), [0, 1]),
    each as {"mean", "std"} over the N images; plain floats, valid JSON (no inf/NaN).

    `lpips`: auto (find the AlexNet weights, or download them once), off, or the weights' path.
    LPIPS is None, with `lpips_reason`, when it is off ("off"), when the weights are neither here
    nor downloadable (one LpipsUnavailableWarning) or the images have neither 1 nor 3 channels.
    """
    clean, poisoned = _check_pair(clean, poisoned)
    psnr_values = psnr(clean, poisoned)
    lpips_summary, lpips_reason, lpips_size = None, None, None
    if clean.shape[1] not in (1, 3):
        lpips_reason = f"LPIPS needs 1 or 3 channels, the images have {clean.shape[1]}"
    else:
        weights, lpips_reason = resolve_alexnet_weights(lpips)
        if weights is None and lpips_reason != "off":
            warnings.warn(f"LPIPS not computed: {lpips_reason}", LpipsUnavailableWarning, stacklevel=2)
        elif weights is not None:
            model = load_lpips(weights, device)
            lpips_summary = _summary(lpips_distance(clean, poisoned, model, batch_size=batch_size))
            lpips_size = list(_lpips_input(clean[:1]).shape[-2:])
    return {
        "n": int(len(clean)),
        "psnr": _summary(psnr_values),
        "n_psnr_capped": int((psnr_values >= PSNR_CAP_DB).sum()),  # identical (or nearly) pairs
        "ssim": _summary(ssim(clean, poisoned, device=device, batch_size=batch_size)),
        "lpips": lpips_summary,
        "lpips_reason": lpips_reason,
        "linf": _summary(linf_distance(clean, poisoned)),
        "l2": _summary(l2_distance(clean, poisoned)),
        "settings": {
            "psnr_cap_db": PSNR_CAP_DB,
            "ssim": f"skimage defaults: {SSIM_UNIFORM_WINDOW}x{SSIM_UNIFORM_WINDOW} uniform window, sample covariance",
            "lpips": "lpips v0.1, AlexNet",
            "lpips_input_size": lpips_size,
        },
    }


__all__ = [
    "PSNR_CAP_DB",
    "ALEXNET_FILE",
    "ALEXNET_URL",
    "LPIPS_URL_ENV",
    "LPIPS_WEIGHTS_ENV",
    "LpipsUnavailableWarning",
    "alexnet_hub_path",
    "psnr",
    "ssim",
    "linf_distance",
    "l2_distance",
    "resolve_alexnet_weights",
    "load_lpips",
    "lpips_distance",
    "stealth_metrics",
]
