"""An attack's own victim augmentation (`attack.augment`): the crop and rotation its official code
trains the victim with, in place of the trainer's, for the victim's training only."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from backdoorbench import checks
from backdoorbench.errors import ConfigError

KEYS = ("crop_padding", "rotation", "rotation_p")
UNSET = {key: None for key in KEYS}  # every value the trainer's


def check_augment(augment: Mapping[str, Any] | None, official: Mapping[str, Any]) -> dict[str, Any]:
    """`attack.augment` checked: crop_padding (px), rotation (degrees), rotation_p; null = the trainer's.

    `official` is the attack's official augmentation, named in the messages.
    """
    if augment is None:
        return dict(UNSET)
    if not isinstance(augment, Mapping):
        raise ConfigError(f"attack.augment={augment!r} is invalid; use a mapping with crop_padding, rotation and "
                          f"rotation_p (the official {dict(official)}), or null for the trainer's")
    unknown = sorted(set(augment) - set(KEYS))
    if unknown:
        raise ConfigError(f"attack.augment has unknown key(s) {unknown}; use {', '.join(KEYS)}")
    out = {key: augment.get(key) for key in KEYS}
    out["crop_padding"] = checks.integer("attack", "augment.crop_padding", out["crop_padding"], 0, allow_none=True,
                                         hint=f"px; the official {official['crop_padding']}")
    out["rotation"] = checks.number("attack", "augment.rotation", out["rotation"], 0, 180, allow_none=True,
                                    hint=f"degrees; the official {official['rotation']:g}, 0 = off")
    out["rotation_p"] = checks.number("attack", "augment.rotation_p", out["rotation_p"], 0, 1, allow_none=True,
                                      hint=f"the share of images rotated; the official {official['rotation_p']:g}")
    return out


def victim_trainer(trainer, augment: Mapping[str, Any]):
    """`trainer`, or a shallow copy whose crop padding and rotation are `augment`'s non-null values."""
    changed = {key: value for key, value in augment.items() if value is not None}
    if not changed:
        return trainer
    victim = copy.copy(trainer)
    for key, value in changed.items():
        setattr(victim, key, value)
    return victim
