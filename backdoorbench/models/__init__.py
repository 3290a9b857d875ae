"""Classifier architectures. Every model is an `ImageClassifier`: `features(x)` then `classifier`."""

from backdoorbench.models.base import ImageClassifier, Normalized

__all__ = ["ImageClassifier", "Normalized"]
