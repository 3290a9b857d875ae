"""LF: a smooth universal adversarial perturbation of a clean model, added to the poisoned images."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.attacks.base import Attack, SurrogateCrafted
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.errors import ConfigError, DataError
from backdoorbench.fileio import file_sha256
from backdoorbench.progress import track

log = logging.getLogger(__name__)

# BackdoorBench's universal_perturbation.py stops early when the last 5 passes' fooling rates span
# less than 0.01 (the official script runs until the fooling rate is reached).
PLATEAU_PASSES = 5
PLATEAU_SPAN = 0.01
# gauss_smooth's kernel: sig * size_denom taps, spaced so that the Gaussian's std is `sig` taps.
SIZE_DENOM = 5


def gaussian_taps(sigma: float) -> Tensor:
    """The official 1-D low-pass kernel (gauss_smooth.py): int(5 * sigma) taps, centred, a Gaussian of
    std `sigma` taps, summing to 1."""
    size = max(1, int(SIZE_DENOM * sigma))
    grid = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    kernel = torch.exp(-0.5 * (grid / sigma) ** 2)
    return kernel / kernel.sum()


def gauss_smooth(v: Tensor, sigma: float) -> Tensor:
    """The official low-pass filter on a perturbation (C, H, W): separable Gaussian blur, columns
    then rows, each channel alone, zero padding (size // 2 after, one less before when the size is
    even), output of the input's size."""
    kernel = gaussian_taps(sigma).to(v.device, v.dtype)
    size, channels = len(kernel), v.shape[0]
    after = size // 2
    before = after - (1 - size % 2)
    x = F.pad(v[None], (before, after, before, after))
    x = F.conv2d(x, kernel.view(1, 1, size, 1).expand(channels, 1, size, 1), groups=channels)
    x = F.conv2d(x, kernel.view(1, 1, 1, size).expand(channels, 1, 1, size), groups=channels)
    return x[0]


def rescale(v: Tensor, magnitude: float) -> Tensor | None:
    """The official `normalization`: min-max over every value to [0, magnitude]; None for a constant
    `v` (the official division by a zero range would make it NaN)."""
    low, high = v.min(), v.max()
    if not bool(high > low):
        return None
    return (v - low) / (high - low) * magnitude


def targeted_deepfool(model: nn.Module, image: Tensor, target: int, *, overshoot: float, steps: int) -> tuple[Tensor, int]:
    """The official `tar_deepfool` on one image (C, H, W): linear steps r = |f| / ||w||^2 w along the
    gradient w of f = logit[target] - logit[top], `top` the class predicted at the start, until the
    model predicts `target` or `steps` steps. Returns ((1 + overshoot) * the summed step, the steps
    taken). Like the official step it only closes the gap to the starting class: where a third class
    leads once that gap is closed, it stalls, and the caller drops the image."""
    x0 = image[None]
    current = x0.clone().requires_grad_(True)
    logits = model(current)[0]
    top = int(logits.argmax())
    total = torch.zeros_like(x0)
    taken = 0
    while int(logits.argmax()) != target and taken < steps:
        gap = logits[target] - logits[top]
        (w,) = torch.autograd.grad(gap, current)
        step = gap.detach().abs() / w.flatten().norm() ** 2 * w  # |f| / ||w|| along w / ||w||
        if not bool(torch.isfinite(step).all()):
            step = torch.zeros_like(step)
        total = total + step
        current = (x0 + (1 + overshoot) * total).requires_grad_(True)
        logits = model(current)[0]
        taken += 1
    return ((1 + overshoot) * total)[0].detach(), taken


def load_resource(path: str, image_shape: tuple[int, int, int]) -> Tensor:
    """A BackdoorBench pre-made LF perturbation (resource/lowFrequency/<dataset>_<model>_0_255.npy)
    as BackdoorBench reads it (bd_attack_generate.py): a 4-D array gives its first element, a 2-D
    one is repeated over the channels, the (H, W, C) result is added to the 0-255 image. Returned
    in our units, (C, H, W) / 255. Read without unpickling; every refusal is one line."""
    channels, height, width = image_shape
    where = f"attack.resource={path!r}"
    file = Path(path).expanduser()
    if file.suffix != ".npy":
        raise ConfigError(f"{where} is not a .npy file; give BackdoorBench's resource/lowFrequency/<dataset>_<model>_0_255.npy")
    if not file.is_file():
        raise ConfigError(f"{where} does not exist; give the path of a BackdoorBench LF perturbation (.npy)")
    try:
        array = np.load(file, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise DataError(f"{where} cannot be read as a plain numpy array ({reason})") from exc
    if array.dtype.kind not in "uif":
        raise DataError(f"{where} holds {array.dtype} values; expected numbers (uint8 levels or floats)")
    if array.ndim == 4:  # BackdoorBench takes the first of a batch
        array = array[0]
    if array.ndim == 2:  # and repeats a single channel
        array = np.stack((array,) * channels, axis=-1)
    if array.ndim != 3 or tuple(array.shape) != (height, width, channels):
        raise DataError(f"{where} has shape {tuple(np.shape(array))}; expected ({height}, {width}, {channels}) "
                        f"(H, W, C: the dataset's images), (1, {height}, {width}, {channels}) or ({height}, {width})")
    values = torch.from_numpy(array.astype(np.float64)).permute(2, 0, 1)
    if not bool(torch.isfinite(values).all()):
        raise DataError(f"{where} holds values that are not finite")
    if float(values.abs().max()) < 1:
        raise DataError(f"{where} spans [{float(values.min()):.3g}, {float(values.max()):.3g}]: added to 0-255 images as "
                        "BackdoorBench adds it, it changes no pixel (its float files hold [0, 1] units: multiply by 255)")
    return (values / 255).float()


class LowFrequency(SurrogateCrafted, Attack):
    """LF (Zeng, Park, Mao, Jia, "Rethinking the Backdoor Attacks' Triggers: A Frequency
    Perspective", ICCV 2021; official code YiZeng623/frequency-backdoor, Sec5_Smooth_Trigger).

    The trigger is a universal adversarial perturbation of a clean model, kept smooth: over a few
    passes on `craft_images` clean training images, each image the model still labels as without
    the perturbation v gets a targeted DeepFool step towards `target` (`overshoot`, at most
    `deepfool_steps` linear steps), which is low-pass filtered (a Gaussian blur of std `sigma`
    px, 5 * sigma taps, zero padding) and added to v; v is blurred again and rescaled min-max to
    [0, `magnitude`]. Passes stop once v changes the model's label on `fooling_rate` of the
    crafting images, after `max_passes`, or when the last 5 passes' rates span less than 0.01; the
    best v so far is kept. The trigger is v at 8 bits (as BackdoorBench's files hold it) added to
    the image and clipped: the same for every image, at most 51 levels brighter. Dirty-label:
    `poison_rate` of the training set, drawn from every class, relabelled by the target rule.

    The clean model: with `surrogate_epochs` null, the run's clean control (the `attack=none`
    victim of the same dataset, model, trainer and seed, from the victim cache, or trained once and
    cached there), BackdoorBench's clean model; the record says which (`surrogate`,
    `surrogate_cache`, `surrogate_key`). An integer trains a fresh surrogate for that many epochs
    (not cached apart from the victim). `resource` takes a BackdoorBench pre-made perturbation
    file instead (resource/lowFrequency/*.npy, read as BackdoorBench reads it, 0-255 units).

    Departures (docs/fidelity.md#lf): the target stays the configured one (the official script
    moves it to the label the perturbation fools most into, BackdoorBench keeps it); DeepFool
    reads logits (the official TensorFlow graph hands it softmax outputs), with one gradient of
    the logit gap per step (BackdoorBench differentiates every logit); the crafting images are a
    seeded draw from the training split (official: the first 100), and the fooling rate is measured
    on them (BackdoorBench: on 10 test images per class); an update whose sum is constant is
    skipped (the official rescaling would divide by zero), and a crafting where DeepFool reached the
    target on no image is refused in one line (the official code would hand over an empty trigger).
    """

    name = "lf"
    family = "frequency"
    aliases = ("low_frequency", "lowfrequency")
    learned_trigger = True
    # `prepare` takes the run's clean control (`clean_model=`) when the pipeline offers it.
    uses_clean_control = True

    def __init__(
        self,
        *,
        resource: str | None = None,
        surrogate_epochs: int | None = None,
        craft_images: int = 100,
        fooling_rate: float = 0.2,
        max_passes: int = 50,
        overshoot: float = 0.02,
        deepfool_steps: int = 200,
        sigma: float = 6.0,
        magnitude: float = 0.2,
        **common,
    ) -> None:
        craft_target = common.get("target", 0)
        super().__init__(**common)
        # all2all crafts towards `target` as well (BackdoorBench's generate_pattern.py reads attack_target)
        self.craft_target = craft_target if checks.is_integer(craft_target) else 0
        self.surrogate_epochs = checks.integer("attack", "surrogate_epochs", surrogate_epochs, 1, allow_none=True,
                                               hint="null = the run's clean control, the attack=none victim")
        self.craft_images = checks.integer("attack", "craft_images", craft_images, 1)
        self.fooling_rate = checks.number("attack", "fooling_rate", fooling_rate, 0, 1, low_open=True,
                                          hint="the official 1 - delta = 0.2")
        self.max_passes = checks.integer("attack", "max_passes", max_passes, 1)
        self.overshoot = checks.number("attack", "overshoot", overshoot, 0)
        self.deepfool_steps = checks.integer("attack", "deepfool_steps", deepfool_steps, 2)
        self.sigma = checks.number("attack", "sigma", sigma, 0, low_open=True, hint="std of the Gaussian low-pass, px")
        self.magnitude = checks.number("attack", "magnitude", magnitude, 0, 1, low_open=True,
                                       hint="the perturbation's range in [0, 1] pixels")
        if resource is not None and not isinstance(resource, str):
            raise ConfigError(f"attack.resource={resource!r} is invalid; use the path of a .npy file or null")
        self.resource = resource
        self.pattern: Tensor | None = None  # (C, H, W) in [0, 1] pixel units, 8-bit levels
        self.stats: dict[str, Any] = {}
        if resource is not None:  # read now: a wrong file is refused before any data loads
            self.pattern = load_resource(resource, self.image_shape)
            self.stats = {"surrogate": "resource", "resource_sha256": file_sha256(resource)}
        self._surrogate_history: list[dict[str, Any]] = []

    # --- trigger -------------------------------------------------------------------------
    def apply_trigger(self, x: Tensor) -> Tensor:
        if self.pattern is None:
            raise RuntimeError("lf: the perturbation is not crafted yet; call prepare() or load_state_dict() first")
        return (x + self.pattern.to(x.device, x.dtype)).clamp(0.0, 1.0)

    # --- the clean model and the universal perturbation ------------------------------------
    def prepare(self, *, trainer, train: Split, generator: torch.Generator, build_model: Callable[..., nn.Module],
                clean_model: Callable[[], tuple[nn.Module, dict[str, Any]]] | None = None) -> None:
        """The clean model (the run's clean control, or a surrogate trained here), then the
        universal perturbation crafted on it. Nothing to do with a `resource` file."""
        self.poison_count(train.labels)  # a rate that can't be met fails now, not after the crafting
        if self.resource is not None:
            return
        if self.surrogate_epochs is None and clean_model is not None:
            model, victim = clean_model()
            self.stats = {"surrogate": "clean_control", "surrogate_cache": victim.get("cache"),
                          "surrogate_key": victim.get("key")}
        else:
            model = build_model()
            history = trainer.fit(model, train, generator=generator, epochs=self.surrogate_epochs, desc="surrogate")
            self._surrogate_history = list(history or [])
            self.stats = {"surrogate": "trained", "surrogate_epochs": len(self._surrogate_history)}  # the epochs it ran
        model = model.to(trainer.device)
        pick = torch.randperm(len(train), generator=generator)[: self.craft_images]
        images = to_float(train.images[pick]).to(trainer.device)
        self.pattern = self.craft(model, images, generator)

    def craft(self, model: nn.Module, images: Tensor, generator: torch.Generator) -> Tensor:
        """The official universal_perturbation on `images` (N, C, H, W) in [0, 1], the model in eval
        mode (in fp32: `prepare` runs outside the trainer's autocast); returns v at 8 bits on the CPU
        and fills `stats`."""
        was_training = model.training
        model.eval()
        images = images.float()
        v = torch.zeros(images.shape[1:], device=images.device)
        best, best_rate, rates, target = v, -1.0, [], self.craft_target
        skipped, dominant, accepted = 0, None, 0
        try:
            with torch.no_grad():
                clean_labels = model(images).argmax(1)
            for _ in track(range(self.max_passes), "lf: universal perturbation", unit="passes"):
                for k in torch.randperm(len(images), generator=generator).tolist():
                    x = images[k]
                    with torch.no_grad():
                        if int(model((x + v)[None]).argmax()) != int(clean_labels[k]):
                            continue  # already fooled by v
                    dr, taken = targeted_deepfool(model, x + v, target, overshoot=self.overshoot, steps=self.deepfool_steps)
                    if taken >= self.deepfool_steps - 1:  # not converged: the official code drops it
                        continue
                    updated = rescale(gauss_smooth(v + gauss_smooth(dr, self.sigma), self.sigma), self.magnitude)
                    if updated is None:
                        skipped += 1
                        continue
                    v, accepted = updated, accepted + 1
                with torch.no_grad():
                    labels = model(images + v).argmax(1)  # unclipped, as the official fooling rate
                fooled = labels != clean_labels
                rate = float(fooled.float().mean())
                rates.append(rate)
                if rate >= best_rate:  # the official script keeps the best pass
                    best, best_rate = v.clone(), rate
                    dominant = int(torch.bincount(labels[fooled]).argmax()) if bool(fooled.any()) else None
                if rate >= self.fooling_rate:
                    break
                recent = rates[-PLATEAU_PASSES:]
                if len(recent) == PLATEAU_PASSES and max(recent) - min(recent) < PLATEAU_SPAN:
                    break
        finally:
            model.train(was_training)
        if not accepted:  # the official code would hand over an empty trigger (or NaN)
            raise ConfigError(
                f"lf: DeepFool reached target {target} within attack.deepfool_steps={self.deepfool_steps} on none of the "
                f"{len(images)} crafting images in {len(rates)} passes, so there is no perturbation; the clean model may be "
                "barely trained (attack.surrogate_epochs), or give more attack.craft_images or attack.max_passes")
        self.stats.update({"fooling_rate_reached": round(best_rate, 4), "passes": len(rates),
                           "craft_target": target, "dominant_label": dominant, "updates_skipped": skipped})
        log.info("lf: fooling rate %.3f after %d passes (target %d, the label most fooled into: %s)",
                 best_rate, len(rates), target, dominant)
        return torch.floor(best.cpu() * 255 + 1e-4) / 255  # 8 bits, as BackdoorBench's files hold it

    # --- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"pattern": self.pattern}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pattern = state.get("pattern")
        if not isinstance(pattern, Tensor) or tuple(pattern.shape) != self.image_shape:
            got = tuple(pattern.shape) if isinstance(pattern, Tensor) else type(pattern).__name__
            raise DataError(f"lf state has a perturbation of shape {got}; expected {self.image_shape}")
        self.pattern = pattern.detach().float().cpu().clone()

    def describe(self) -> dict:
        return {
            **super().describe(),
            "resource": self.resource,
            "surrogate_epochs": self.surrogate_epochs,
            "craft_images": self.craft_images,
            "fooling_rate": self.fooling_rate,
            "max_passes": self.max_passes,
            "overshoot": self.overshoot,
            "deepfool_steps": self.deepfool_steps,
            "sigma": self.sigma,
            "magnitude": self.magnitude,
            **self.stats,
        }
