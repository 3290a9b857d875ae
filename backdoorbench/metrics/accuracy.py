"""CA, ASR, RA and DER, defined once for every attack and defense (see docs/architecture.md)."""

from __future__ import annotations

from torch import Tensor, nn

from backdoorbench.attacks.base import Attack
from backdoorbench.attacks.targets import TargetRule
from backdoorbench.datasets.base import Split


def clean_accuracy(predictions: Tensor, labels: Tensor) -> float:
    """Fraction of clean test images classified as their label."""
    if len(labels) == 0:
        raise ValueError("clean accuracy of an empty test set is undefined")
    return int((predictions == labels).sum()) / len(labels)


def _attackable(labels: Tensor, target_rule: TargetRule) -> Tensor:
    return target_rule(labels) != labels


def attack_success_rate(triggered_predictions: Tensor, labels: Tensor, target_rule: TargetRule) -> float:
    """On test images whose target differs from their label, the fraction classified as the
    target after the trigger. `triggered_predictions` are aligned with `labels`."""
    mask = _attackable(labels, target_rule)
    if not mask.any():
        raise ValueError("no test image has a target different from its label")
    return int((triggered_predictions[mask] == target_rule(labels)[mask]).sum()) / int(mask.sum())


def robust_accuracy(triggered_predictions: Tensor, labels: Tensor, target_rule: TargetRule) -> float:
    """On the same images as ASR, the fraction still classified as their true label."""
    mask = _attackable(labels, target_rule)
    if not mask.any():
        raise ValueError("no test image has a target different from its label")
    return int((triggered_predictions[mask] == labels[mask]).sum()) / int(mask.sum())


def defense_effectiveness_rating(before: dict[str, float], after: dict[str, float]) -> float:
    """DER = [max(0, dASR) - max(0, dCA) + 1] / 2 with d = before - after; in [0, 1]."""
    delta_asr = before["asr"] - after["asr"]
    delta_ca = before["clean_acc"] - after["clean_acc"]
    return (max(0.0, delta_asr) - max(0.0, delta_ca) + 1.0) / 2.0


def evaluate(model: nn.Module, trainer, attack: Attack, test: Split) -> dict[str, float]:
    """CA on the clean test split; ASR and RA on its attackable images after `apply_trigger`."""
    clean = trainer.predict(model, test.images)
    attackable = _attackable(test.labels, attack.target_rule)
    triggered = trainer.predict(model, test.images[attackable], transform=attack.apply_trigger)
    labels = test.labels[attackable]
    return {
        "clean_acc": clean_accuracy(clean, test.labels),
        "asr": attack_success_rate(triggered, labels, attack.target_rule),
        "ra": robust_accuracy(triggered, labels, attack.target_rule),
    }
