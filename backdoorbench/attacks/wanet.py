"""WaNet: a fixed, smooth, nearly invisible image warp is the trigger."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.attacks.base import StepWrapper, TrainingAttack
from backdoorbench.attacks.victim_augment import check_augment, victim_trainer
from backdoorbench.datasets.base import Split
from backdoorbench.errors import ConfigError, DataError
from backdoorbench.train import cross_entropy_step

# WaNet's training augmentation, its PostTensorTransform (docs/fidelity.md#wanet): crop after 5 px of
# padding, rotation within +-10 degrees on a quarter of the images (a coin per batch at 0.5 around
# kornia's RandomRotation, whose own coin per image is 0.5); `attack.augment` sets it for the victim.
OFFICIAL_AUGMENT = MappingProxyType({"crop_padding": 5, "rotation": 10.0, "rotation_p": 0.25})


def random_flow(k: int, height: int, width: int, generator: torch.Generator) -> Tensor:
    """A smooth random displacement field (1, H, W, 2), in units of the mean control magnitude.

    k x k control vectors are drawn uniformly in [-1, 1]^2, divided by their mean absolute value
    (so `s` alone sets the strength, whatever k is) and upsampled bicubically to the image size.
    """
    control = torch.rand(1, 2, k, k, generator=generator) * 2 - 1
    control = control / control.abs().mean()
    flow = F.interpolate(control, size=(height, width), mode="bicubic", align_corners=True)
    return flow.permute(0, 2, 3, 1).contiguous()


def identity_grid(height: int, width: int) -> Tensor:
    """The grid (1, H, W, 2) that makes `F.grid_sample(align_corners=True)` return its input."""
    rows, cols = torch.meshgrid(torch.linspace(-1, 1, height), torch.linspace(-1, 1, width), indexing="ij")
    return torch.stack((cols, rows), dim=-1)[None]  # grid_sample reads (x = column, y = row)


def warp(x: Tensor, grid: Tensor) -> Tensor:
    """Resample images (B, C, H, W) at `grid` (1 or B, H, W, 2), bilinearly, in float32.

    Autocast is off so the warp is the same in a bf16 training step as at test time.
    """
    grid = grid.to(x.device, torch.float32).expand(x.shape[0], -1, -1, -1)
    with torch.autocast(x.device.type, enabled=False):
        return F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="zeros", align_corners=True)


@dataclass
class WarpPlan:
    """Which rows of one training batch are warped, and the noise of the noise-mode rows."""

    poisoned: Tensor  # rows warped with the trigger grid; labels go to the target
    noisy: Tensor  # rows warped with the grid plus random noise; labels kept
    noise: Tensor  # (len(noisy), H, W, 2) uniform in [-1, 1], in pixel units before scaling


class WaNet(TrainingAttack):
    """WaNet (Nguyen & Tran, "WaNet - Imperceptible Warping-based Backdoor Attack", ICLR 2021).

    The trigger is one fixed warping field: k x k random control vectors, normalized, upsampled
    bicubically, scaled by s / image size and added to the identity sampling grid (clamped to
    [-1, 1]). In each batch a `poison_rate` fraction is warped and relabelled to the target, and
    a `cross_ratio * poison_rate` fraction ("noise mode") is warped with the grid plus per-pixel
    noise in [-1, 1] / image size and KEEPS its label, so the network learns the exact field
    rather than "any warp". Defaults are the paper's (k=4, s=0.5, grid_rescale=1, cross_ratio=2).

    Training follows the official order: the batch is warped first and then augmented (the
    trainer's crop and flip, and its rotation when `trainer.rotation` > 0), so the network learns
    the warp under the same shifts as clean images. `augment` (crop_padding, rotation,
    rotation_p; unset or null = the trainer's) replaces the trainer's crop and rotation
    for the victim only, as BPP's does: the backdoorbench protocol sets the official crop 5 and
    rotation 10 (BackdoorBench's attack/wanet.py trains so), the paper presets set the trainer's
    (docs/fidelity.md#wanet). All-to-all uses the shared rule y -> (y + 1) mod C, as
    the official code has since 2022 (before, `remainder(y, C)` left labels unchanged).

    Each batch of B images has int(B * poison_rate) warped rows and int(that * cross_ratio)
    noise-mode rows, floored as in the official train.py.

    Exported set (`export_poisoned_set`, read by ABL, AC and spectral): as BackdoorBench's
    attack/wanet.py saves after training, one pass over the training split in training-size
    batches without augmentation, each batch with its floored warped rows relabelled and its
    noise-mode rows warped with fresh noise, labels kept; the batches are a seeded shuffle and the
    rows a seeded draw (BackdoorBench: the first rows of each batch in stored order).

    Departures from the official code: rows to poison are drawn at random from each batch
    (the official code takes the first rows of a shuffled batch, the same in distribution); the
    augmentation draws its crop for each image (official: a coin with p = 0.8 for the whole
    batch), pads and rotates with black pixels (official: zeros of the normalised image, the mean
    colour on CIFAR-10); for non-square images the x and y
    displacements are scaled by the width and the height (the official code uses the height for
    both).
    """

    name = "wanet"
    family = "warping"
    exports_poisoned_set = True

    def __init__(
        self,
        *,
        k: int = 4,
        s: float = 0.5,
        grid_rescale: float = 1.0,
        cross_ratio: float = 2.0,
        seed: int = 0,
        augment: Mapping[str, Any] | None = None,
        **common,
    ) -> None:
        super().__init__(**common)
        _, height, width = self.image_shape
        checks.integer("attack", "k", k, 2, min(height, width))
        checks.number("attack", "s", s, 0, hint="the paper uses 0.5")
        checks.number("attack", "grid_rescale", grid_rescale, 0, 1, low_open=True)
        if not checks.is_number(cross_ratio) or cross_ratio < 0 or self.poison_rate * (1 + cross_ratio) > 1:
            raise ConfigError(
                f"attack.cross_ratio={cross_ratio!r} is out of range; use a number >= 0 with "
                f"poison_rate * (1 + cross_ratio) <= 1, i.e. <= {1 / self.poison_rate - 1:.4g}"
            )
        self.k = k
        self.s = float(s)
        self.grid_rescale = float(grid_rescale)
        self.cross_ratio = float(cross_ratio)
        self.seed = seed
        self.augment = check_augment(augment, OFFICIAL_AUGMENT)
        self.flow = random_flow(k, height, width, torch.Generator().manual_seed(seed))
        self.grid = self._trigger_grid(self.flow)
        # Per-batch choices (rows, noise); reseeded from the training generator in train_victim.
        self.batch_generator = torch.Generator().manual_seed(seed + 1)

    def _pixel_scale(self) -> Tensor:
        _, height, width = self.image_shape
        return torch.tensor([width, height], dtype=torch.float32)  # (x, y) order, as in the grid

    def _trigger_grid(self, flow: Tensor) -> Tensor:
        _, height, width = self.image_shape
        grid = (identity_grid(height, width) + self.s * flow / self._pixel_scale()) * self.grid_rescale
        return grid.clamp(-1, 1)

    def displacement(self) -> Tensor:
        """The trigger's displacement field (1, H, W, 2) in grid units ([-1, 1] spans the image)."""
        _, height, width = self.image_shape
        return self.grid - identity_grid(height, width)

    def apply_trigger(self, x: Tensor) -> Tensor:
        return warp(x, self.grid).to(x.dtype)

    def apply_noise_mode(self, x: Tensor, noise: Tensor) -> Tensor:
        """Warp with the trigger grid perturbed by `noise` (B, H, W, 2) in [-1, 1] pixel units."""
        device = x.device
        noisy_grid = (self.grid.to(device) + noise.to(device) / self._pixel_scale().to(device)).clamp(-1, 1)
        return warp(x, noisy_grid).to(x.dtype)

    def plan_batch(self, batch_size: int, generator: torch.Generator | None = None) -> WarpPlan:
        """Draw the warped and noise-mode rows of one batch from `generator` (default `batch_generator`)."""
        generator = self.batch_generator if generator is None else generator
        _, height, width = self.image_shape
        # floored, as the official train.py: num_bd = int(bs * pc), num_cross = int(num_bd * cross_ratio)
        n_poisoned = min(int(batch_size * self.poison_rate), batch_size)
        n_noisy = min(int(n_poisoned * self.cross_ratio), batch_size - n_poisoned)
        order = torch.randperm(batch_size, generator=generator)
        noise = torch.rand(n_noisy, height, width, 2, generator=generator) * 2 - 1
        return WarpPlan(order[:n_poisoned], order[n_poisoned : n_poisoned + n_noisy], noise)

    def poison_batch(self, x: Tensor, y: Tensor, plan: WarpPlan) -> tuple[Tensor, Tensor]:
        """The batch with `plan` applied: warped rows relabelled, noise-mode rows keep labels."""
        poisoned, noisy = plan.poisoned.to(x.device), plan.noisy.to(x.device)
        images, labels = x.clone(), y.clone()
        images[poisoned] = self.apply_trigger(x[poisoned])
        images[noisy] = self.apply_noise_mode(x[noisy], plan.noise)
        labels[poisoned] = self.target_rule(y[poisoned])
        return images, labels

    def poison_step(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """One un-augmented training batch, poisoned by a fresh plan (the trainer augments it next)."""
        return self.poison_batch(x, y, self.plan_batch(len(y)))

    def export_batch(self, x: Tensor, y: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """As BackdoorBench's export after training (attack/wanet.py): the batch's warped rows
        relabelled, its noise-mode rows warped with fresh noise and labels kept (the cover)."""
        plan = self.plan_batch(len(y), generator)
        images, labels = self.poison_batch(x, y, plan)
        return images, labels, plan.poisoned, plan.noisy

    def training_step(self, model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Poison and score one batch as it is (no augmentation); `train_victim` instead lets the
        trainer augment between `poison_step` and the loss, as the official code does."""
        images, labels = self.poison_step(x, y)
        logits = model(images)
        return F.cross_entropy(logits, labels), logits, labels

    def train_victim(
        self, trainer, model: nn.Module, train: Split, generator: torch.Generator, wrap_step: StepWrapper | None = None,
        checkpoint: str | Path | None = None,
    ) -> None:
        # Each (re)training draws its batch choices from the run's training stream, so a run is
        # reproducible and a defense's retraining gets its own, equally seeded, choices.
        self.batch_generator = torch.Generator().manual_seed(int(torch.randint(2**62, (), generator=generator)))
        # Warp, then augment (the official order): the trainer calls poison_step on the
        # un-augmented batch, augments the result and scores it with plain cross-entropy.
        step = wrap_step(cross_entropy_step) if wrap_step is not None else cross_entropy_step
        trainer = victim_trainer(trainer, self.augment)  # `attack.augment`'s crop and rotation, the victim's only
        trainer.fit(model, train, generator=generator, step=step, poison=self.poison_step, desc="victim",
                    checkpoint=checkpoint, companion=self)

    def training_state(self) -> dict[str, Any]:
        # The warp is fixed; only the stream of per-batch choices moves during training.
        return {"batch_generator": self.batch_generator.get_state()}

    def load_training_state(self, state: dict[str, Any]) -> None:
        self.batch_generator.set_state(state["batch_generator"])

    def state_dict(self) -> dict[str, Any]:
        return {"flow": self.flow.clone(), "grid": self.grid.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _, height, width = self.image_shape
        for key in ("flow", "grid"):
            value = state.get(key)
            if not isinstance(value, Tensor) or tuple(value.shape) != (1, height, width, 2):
                got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise DataError(f"WaNet state {key!r} is {got}; expected a tensor of shape (1, {height}, {width}, 2)")
        self.flow = state["flow"].detach().float().cpu().clone()
        self.grid = state["grid"].detach().float().cpu().clone()
