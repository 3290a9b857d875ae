"""Refool: reflections of other scenes (ghosted or out of focus) blended into the image."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from backdoorbench import checks
from backdoorbench.attacks.clean_label import default_poison_rate
from backdoorbench.attacks.base import Attack
from backdoorbench.attacks.patterns import load_pattern
from backdoorbench.errors import ConfigError

REFLECTION_MODELS = ("ghost", "focal_blur", "in_focus")
DEFAULT_REFLECTIONS = ("astronaut", "coffee", "rocket", "chelsea", "camera")


def ghost_reflection(r: Tensor, offset: tuple[int, int], weight: float) -> Tensor:
    """Ghost effect, kernel k = weight * delta + (1 - weight) * delta_offset: the reflection plus a
    copy shifted by `offset` = (rows, cols) >= 0 (zeros enter at the border). `r` is (..., H, W)."""
    dy, dx = offset
    height, width = r.shape[-2:]
    shifted = torch.zeros_like(r)
    shifted[..., dy:, dx:] = r[..., : height - dy, : width - dx]
    return weight * r + (1.0 - weight) * shifted


def gaussian_blur(r: Tensor, sigma: float) -> Tensor:
    """Focal blur: `r` (C, H, W) convolved with a Gaussian of std `sigma` px (radius 2 sigma, as
    the official code's kernel size 2 * ceil(2 sigma) + 1), edges replicated."""
    radius = max(1, math.ceil(2 * sigma))
    taps = torch.arange(-radius, radius + 1, dtype=r.dtype)
    kernel = torch.exp(-(taps**2) / (2 * sigma**2))
    kernel = kernel / kernel.sum()
    channels = r.shape[0]
    x = F.pad(r.unsqueeze(0), (radius, radius, radius, radius), mode="replicate")
    x = F.conv2d(x, kernel.view(1, 1, 1, -1).expand(channels, 1, 1, -1), groups=channels)
    x = F.conv2d(x, kernel.view(1, 1, -1, 1).expand(channels, 1, -1, 1), groups=channels)
    return x.squeeze(0)


def blend(x: Tensor, reflection: Tensor, alpha_t: Tensor | float, gamma: float) -> Tensor:
    """Image with reflection, in linear light: (alpha_t * x^gamma + (1 - alpha_t) * R)^(1/gamma),
    clipped to [0, 1]. `reflection` R is already the kernel-filtered, linearized layer k * r^gamma."""
    mixed = alpha_t * x.clamp(0.0, 1.0) ** gamma + (1.0 - alpha_t) * reflection
    return mixed.clamp(0.0, 1.0) ** (1.0 / gamma)


class Refool(Attack):
    """Refool (Liu, Ma, Bailey, Lu, "Reflection Backdoor: A Natural Backdoor Attack on Deep
    Neural Networks", ECCV 2020).

    The trigger is a reflection: an image of another scene r, filtered by one of the paper's
    reflection models, x_adv = x + k * r, with k a two-pulse kernel (ghost effect: a copy shifted
    and attenuated), a Gaussian (focal blur: reflection out of focus) or the identity (both in
    focus); the blend is computed in linear light (gamma 2.2) with the transmission weighted by
    alpha_t, as the official code does. By default (`clean_label=True`, the paper's setting) only
    target-class images are poisoned and keep their labels; `clean_label=False` is the
    dirty-label variant BackdoorBench runs by default.

    Reflections: `num_variants` seeded draws of (source image, model, alpha_t, offset, weight,
    sigma); the image at position i of any batch gets variant i mod num_variants, so test-time
    triggering is reproducible and needs no image index.

    Departures: the paper picks its reflection images from a large photo set by their attack
    strength on a surrogate (adversarial reflection selection); we use a fixed handful of
    scikit-image samples (offline). The official code blends at 560 px and resizes; we blend at
    the dataset's resolution, so the ghost offsets (px) and blur sigmas (px) are scaled to small
    images, and we drop the official focal-blur code's brightness re-ranging and vignette mask.
    Target modes: clean-label all2all is not meaningful (labels are kept, so the trigger can't
    teach y -> y+1) and raises a ConfigError; use clean_label=false for all2all.
    """

    name = "refool"
    clean_label = True

    def __init__(
        self,
        *,
        reflections: Sequence[str] = DEFAULT_REFLECTIONS,
        models: Sequence[str] = ("ghost", "focal_blur"),
        alpha_t: Sequence[float] = (0.55, 0.95),
        ghost_offset: Sequence[int] = (1, 3),
        ghost_weight: Sequence[float] = (0.15, 0.5),
        blur_sigma: Sequence[float] = (0.5, 1.5),
        gamma: float = 2.2,
        num_variants: int = 256,
        clean_label: bool = True,
        poison_rate: float | None = None,
        seed: int = 0,
        **common,
    ) -> None:
        super().__init__(poison_rate=default_poison_rate(poison_rate, bool(clean_label)), **common)
        self.clean_label = bool(clean_label)
        if self.clean_label and self.target_mode == "all2all":
            raise ConfigError(
                "attack.target_mode=all2all is not meaningful for clean-label Refool (poisoned images keep their "
                "label, so the trigger never maps y to y+1); use target_mode=all2one or attack.clean_label=false"
            )
        reflections = [str(r) for r in reflections]
        models = [str(m) for m in models]
        if not reflections:
            raise ConfigError("attack.reflections is empty; give at least one scikit-image sample name or image path")
        unknown = [m for m in models if m not in REFLECTION_MODELS]
        if unknown or not models:
            raise ConfigError(f"attack.models={models!r} is invalid; choose from: {', '.join(REFLECTION_MODELS)}")
        _, height, width = self.image_shape
        self.alpha_t = _range("alpha_t", alpha_t, 0.0, 1.0)
        self.ghost_offset = tuple(int(v) for v in _range("ghost_offset", ghost_offset, 0, min(height, width) - 1))
        self.ghost_weight = _range("ghost_weight", ghost_weight, 0.0, 1.0)
        self.blur_sigma = _range("blur_sigma", blur_sigma, 1e-3, float(max(height, width)))
        checks.number("attack", "gamma", gamma, 0, low_open=True, hint="2.2 for sRGB, 1 for none")
        checks.integer("attack", "num_variants", num_variants, 1)
        self.reflections = reflections
        self.models = models
        self.gamma = float(gamma)
        self.num_variants = num_variants
        self.seed = seed
        sources = [load_pattern(spec, self.image_shape, seed=seed) for spec in reflections]
        self.variants, self.layers, self.alphas = self._draw_variants(sources, torch.Generator().manual_seed(seed))

    def _draw_variants(self, sources: list[Tensor], generator: torch.Generator) -> tuple[list[dict], Tensor, Tensor]:
        """Seeded reflection layers (V, C, H, W), linearized and filtered, and their alpha_t (V,)."""
        def uniform(low: float, high: float) -> float:
            return low + (high - low) * float(torch.rand((), generator=generator))

        variants, layers = [], []
        for _ in range(self.num_variants):
            source = int(torch.randint(len(sources), (), generator=generator))
            model = self.models[int(torch.randint(len(self.models), (), generator=generator))]
            linear = sources[source] ** self.gamma
            variant = {"source": self.reflections[source], "model": model, "alpha_t": uniform(*self.alpha_t)}
            if model == "ghost":
                low, high = self.ghost_offset
                offset = tuple(int(torch.randint(low, high + 1, (), generator=generator)) for _ in range(2))
                weight = uniform(*self.ghost_weight)
                if float(torch.rand((), generator=generator)) < 0.5:  # either copy may be the brighter one
                    weight = 1.0 - weight
                variant.update(offset=offset, weight=weight)
                layer = ghost_reflection(linear, offset, weight)
            elif model == "focal_blur":
                variant["sigma"] = uniform(*self.blur_sigma)
                layer = gaussian_blur(linear, variant["sigma"])
            else:
                layer = linear
            variants.append(variant)
            layers.append(layer)
        alphas = torch.tensor([v["alpha_t"] for v in variants], dtype=torch.float32)
        return variants, torch.stack(layers), alphas

    def apply_trigger(self, x: Tensor) -> Tensor:
        """Blend variant (i mod num_variants) into the image at batch position i."""
        which = torch.arange(len(x)) % self.num_variants
        layers = self.layers[which].to(x.device, x.dtype)
        alphas = self.alphas[which].to(x.device, x.dtype).view(-1, 1, 1, 1)
        return blend(x, layers, alphas, self.gamma)

    def describe(self) -> dict:
        return {
            **super().describe(),
            "reflections": list(self.reflections),
            "models": list(self.models),
            "alpha_t": list(self.alpha_t),
            "ghost_offset": list(self.ghost_offset),
            "ghost_weight": list(self.ghost_weight),
            "blur_sigma": list(self.blur_sigma),
            "gamma": self.gamma,
            "num_variants": self.num_variants,
            "seed": self.seed,
        }


def _range(key: str, value, low: float, high: float) -> tuple[float, float]:
    """A [min, max] pair within [low, high]."""
    try:
        pair = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        pair = ()
    if len(pair) != 2 or not low <= pair[0] <= pair[1] <= high:
        raise ConfigError(f"attack.{key}={value!r} is invalid; use [min, max] with {low:g} <= min <= max <= {high:g}")
    return pair
