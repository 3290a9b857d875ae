"""Backdoor attacks, one per file; `conf/attack/<name>.yaml` selects one as `attack=<name>`."""

from backdoorbench.attacks.base import Attack, PoisonedData
from backdoorbench.attacks.targets import All2All, All2One, TargetRule, make_target_rule

__all__ = ["Attack", "PoisonedData", "TargetRule", "All2One", "All2All", "make_target_rule"]
