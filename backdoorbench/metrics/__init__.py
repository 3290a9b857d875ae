"""Accuracy metrics (CA, ASR, RA, DER) and, later, stealthiness metrics."""

from backdoorbench.metrics.accuracy import (
    attack_success_rate,
    clean_accuracy,
    defense_effectiveness_rating,
    evaluate,
    robust_accuracy,
)

__all__ = ["clean_accuracy", "attack_success_rate", "robust_accuracy", "defense_effectiveness_rating", "evaluate"]
