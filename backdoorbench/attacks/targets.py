"""Target rules: which label a triggered input should be classified as."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from backdoorbench import checks
from backdoorbench.errors import ConfigError

TARGET_MODES = ("all2one", "all2all")


class TargetRule(Protocol):
    mode: str

    def __call__(self, y: Tensor) -> Tensor: ...


class All2One:
    """Every label goes to one target class t."""

    mode = "all2one"

    def __init__(self, target: int) -> None:
        self.target = target

    def __call__(self, y: Tensor) -> Tensor:
        return torch.full_like(y, self.target)

    def __repr__(self) -> str:
        return f"All2One(target={self.target})"


class All2All:
    """Every label y goes to (y + 1) mod C."""

    mode = "all2all"

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes

    def __call__(self, y: Tensor) -> Tensor:
        return (y + 1) % self.num_classes

    def __repr__(self) -> str:
        return f"All2All(num_classes={self.num_classes})"


def make_target_rule(mode: str, target: int, num_classes: int) -> TargetRule:
    """Build the rule for `attack.target_mode` / `attack.target`, checking both."""
    checks.integer("attack", "target", target, 0, num_classes - 1)
    if mode == "all2one":
        return All2One(target)
    if mode == "all2all":
        return All2All(num_classes)
    raise ConfigError(f"attack.target_mode={mode!r} is unknown; choose one of: {', '.join(TARGET_MODES)}")
