"""The input-aware attack's parts (attacks/input_aware.py): its generator networks, the trigger
blend, the two generator losses, the per-batch choice of attack and cross-trigger rows, and the
normalisation its diversity loss measures in.

Layouts and constants follow the official code (Nguyen & Tran, NeurIPS 2020,
github.com/VinAIResearch/input-aware-backdoor-attack-release); docs/fidelity.md#input-aware.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.errors import ConfigError
from backdoorbench.units import INPUT_AWARE_STD

log = logging.getLogger(__name__)

EPSILON = 1e-7  # the official code's, in the output squashing and the diversity ratio


def _conv_block(in_channels: int, out_channels: int, relu: bool = True) -> nn.Sequential:
    conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
    block = nn.Sequential(conv, nn.BatchNorm2d(out_channels, momentum=0.05))  # the official momentum
    if relu:
        block.append(nn.ReLU(inplace=True))
    return block


class TriggerGenerator(nn.Module):
    """The paper's small encoder-decoder: `depth` stages of two 3x3 conv-BN-ReLU blocks and a 2x2
    max-pool (widths channels, 2*channels, ...), a middle block, then the mirror image with
    bilinear upsampling; the output is squashed to (0, 1) by tanh / 2 + 1/2.

    The pattern generator has as many output channels as the image, the mask generator one.
    """

    def __init__(self, in_channels: int, out_channels: int, channels: int, depth: int) -> None:
        super().__init__()
        widths = [channels * 2**i for i in range(depth)]
        layers: list[nn.Module] = []
        previous = in_channels
        for width in widths:
            layers += [_conv_block(previous, width), _conv_block(width, width), nn.MaxPool2d(2)]
            previous = width
        layers.append(_conv_block(previous, previous))
        for i in reversed(range(depth)):
            last = i == 0
            layers += [
                nn.Upsample(scale_factor=2, mode="bilinear"),
                _conv_block(widths[i], widths[i]),
                _conv_block(widths[i], out_channels if last else widths[i - 1], relu=not last),
            ]
        self.body = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.body(x)) / (2 + EPSILON) + 0.5


def seeded(seed: int, build):
    """Build modules with a private seed, leaving the global random state untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def threshold_mask(raw: Tensor) -> Tensor:
    """The official code's soft threshold of the mask generator's output, near-binary around 0.5."""
    return torch.tanh(raw * 20 - 10) / (2 + EPSILON) + 0.5


def blend(x: Tensor, pattern: Tensor, mask: Tensor) -> Tensor:
    """x + m * (p - x): the mask chooses where the pattern replaces the image."""
    return x + mask * (pattern - x)


def diversity_loss(
    images_a: Tensor, images_b: Tensor, out_a: Tensor, out_b: Tensor,
    image_std: Tensor | None = None, output_std: Tensor | None = None,
) -> Tensor:
    """mean ||x - x'|| / ||g(x) - g(x')|| over pairs (RMS distances): small when distinct inputs
    get distinct triggers, so the generator cannot collapse to one fixed trigger.

    `image_std` / `output_std` (per channel, (C,) or (1, C, 1, 1)): measure that distance between
    images normalised by (x - mean) / std, as the official code does (the mean cancels); None:
    in [0, 1] pixels."""
    image_diff, output_diff = images_a - images_b, out_a - out_b
    if image_std is not None:
        image_diff = image_diff / image_std.to(image_diff).reshape(1, -1, 1, 1)
    if output_std is not None:
        output_diff = output_diff / output_std.to(output_diff).reshape(1, -1, 1, 1)
    image_distance = image_diff.pow(2).mean(dim=(1, 2, 3)).sqrt()
    # sqrt has an infinite slope at 0: two equal outputs would turn the whole gradient into NaN.
    output_distance = output_diff.pow(2).mean(dim=(1, 2, 3)).clamp_min(EPSILON**2).sqrt()
    return (image_distance / (output_distance + EPSILON)).mean()


def mask_norm_loss(mask: Tensor, density: float) -> Tensor:
    """mean(relu(m - density)): pushes the mask's coverage down to `density`."""
    return F.relu(mask - density).mean()


@dataclass
class CrossPlan:
    """Rows of one training batch: `attack` rows get their own trigger and the target label;
    `cross` rows get the trigger of the image at `sources` (another row) and keep their label."""

    attack: Tensor
    cross: Tensor
    sources: Tensor


def plan_cross_batch(batch_size: int, poison_rate: float, cross_rate: float, generator: torch.Generator) -> CrossPlan:
    """Draw disjoint attack and cross rows, and for each cross row another row as its source.

    The i-th source is also the partner of the i-th attack row in the diversity loss, so it
    is never that attack row either (a pair of equal images says nothing about diversity).
    """
    # floored, as the official train.py: num_bd = int(p_attack * bs), num_cross = int(p_cross * bs)
    n_attack = min(int(poison_rate * batch_size), batch_size)
    n_cross = min(int(cross_rate * batch_size), batch_size - n_attack)
    if batch_size < 3:
        n_cross = 0  # too few images to lend each cross row a trigger from a third one
    order = torch.randperm(batch_size, generator=generator)
    attack, cross = order[:n_attack], order[n_attack : n_attack + n_cross]
    pairs = min(n_attack, n_cross)
    partner = cross.clone()  # the row each source must also avoid (itself when unpaired)
    partner[:pairs] = attack[:pairs]
    low, high = torch.minimum(cross, partner), torch.maximum(cross, partner)
    two = (low != high).long()
    # Uniform over the other rows: draw among batch_size - 1 (or - 2) slots, then step over
    # the excluded rows in increasing order.
    sources = (torch.rand(n_cross, generator=generator) * (batch_size - 1 - two)).long()
    sources = sources + (sources >= low).long()
    sources = sources + (sources >= high).long() * two
    return CrossPlan(attack, cross, sources)


def resolve_diversity_std(value, dataset: str | None, channels: int) -> tuple[float, ...] | None:
    """The per-channel std of the images' normalisation in the diversity loss (None: pixels):
    `official` is the official code's normalisation of `dataset` (units.INPUT_AWARE_STD)."""
    if value == "official":
        if dataset not in INPUT_AWARE_STD:
            if dataset is not None:
                log.warning("input_aware: no official normalisation recorded for dataset %r; the diversity "
                            "loss measures [0, 1] pixels (set attack.diversity_std to choose)", dataset)
            return None
        value = INPUT_AWARE_STD[dataset]
    if value is None:
        return None
    values = [value] if checks.is_number(value) else value
    if (isinstance(values, str) or not isinstance(values, Sequence) or len(values) not in (1, channels)
            or any(not checks.is_number(v) or v <= 0 for v in values)):
        raise ConfigError(
            f"attack.diversity_std={value!r} is invalid; use official (the official code's normalisation of "
            f"the dataset), null ([0, 1] pixels), a number > 0 or a list of {channels} numbers > 0"
        )
    return tuple(float(v) for v in values) * (channels if len(values) == 1 else 1)
