"""No attack: the clean baseline every attack row is compared against."""

from __future__ import annotations

import torch
from torch import Tensor

from backdoorbench.attacks.base import Attack
from backdoorbench.errors import ConfigError


class NoAttack(Attack):
    """The clean model: nothing is poisoned and the "trigger" is the identity.

    Not a paper's method but the control the attack papers report beside their CA ("clean
    model" / "benign" rows): trained with exactly the same dataset, model, trainer and seed as an
    attacked run, so "CA within 2 points of a clean model" is read off two records. Its ASR is the
    rate at which the untouched model already predicts the target (all2one: target t on
    non-target images; all2all: y+1), the floor any attack's ASR stands on. No stealth metrics:
    an identity trigger has infinite PSNR.
    """

    name = "none"
    family = "none"
    aliases = ("clean",)
    triggerless = True

    def __init__(self, *, poison_rate: float | None = None, **common) -> None:
        if poison_rate not in (None, 0, 0.0):
            raise ConfigError(f"attack.poison_rate={poison_rate!r} is invalid for attack=none; leave it null")
        super().__init__(poison_rate=1.0, **common)
        self.poison_rate = 0.0

    def apply_trigger(self, x: Tensor) -> Tensor:
        return x.clone()

    def poison_indices(self, y: Tensor, generator: torch.Generator) -> Tensor:
        return torch.empty(0, dtype=torch.int64)
