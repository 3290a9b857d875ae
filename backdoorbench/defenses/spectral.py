"""Spectral Signatures: remove the training samples that project most on each class's top
singular direction of learned features (pre-training detection)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from backdoorbench import checks
from backdoorbench.datasets.base import Split
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.errors import ConfigError
from backdoorbench.models.taps import last_stage_map_features, penultimate_features

REMOVALS = ("official", "oracle")
SCORES = ("squared", "official")
LAYERS = ("penultimate", "last_stage")


def spectral_scores(features: Tensor, score: str = "squared") -> Tensor:
    """Outlier score of each row of one class's (n, d) features, divided by the mean of those (so
    scores of different classes are comparable: 1 is the class average).

    `squared` (the paper): the squared projection of the centered features on the top right singular
    vector of the centered features. `official` (the authors' code, BackdoorBench): the absolute
    projection of the uncentered features on that vector."""
    features = features.double()
    centered = features - features.mean(0, keepdim=True)
    _, _, vh = torch.linalg.svd(centered, full_matrices=False)
    raw = (centered @ vh[0]) ** 2 if score == "squared" else (features @ vh[0]).abs()
    mean = raw.mean()
    return (raw / mean if mean > 0 else raw).float()


def percentile_flags(scores: Tensor, percentile: float) -> Tensor:
    """The official rule: flag the scores strictly above the class's `percentile`-th percentile
    (numpy's linear interpolation), i.e. (100 - percentile)% of the class, rounded up, fewer on ties."""
    threshold = torch.quantile(scores.double(), percentile / 100.0)
    return scores.double() > threshold


def class_removals(labels: Tensor, removal_ratio: float, expected_poison_rate: float) -> dict[int, int]:
    """The oracle rule's count per non-empty class: removal_ratio times the expected number of
    poisoned samples (expected_poison_rate * N, N the whole training set: one class may hold them
    all), at most half of the class (at least half of a class is assumed clean)."""
    expected = removal_ratio * expected_poison_rate * len(labels)
    return {cls: min(n // 2, round(expected)) for cls, n in class_sizes(labels).items()}


def class_sizes(labels: Tensor) -> dict[int, int]:
    """Size of each non-empty class; a spectral signature needs at least 2 samples per class."""
    sizes = {cls: n for cls, n in enumerate(torch.bincount(labels).tolist()) if n > 0}
    for cls, n in sizes.items():
        if n < 2:
            raise ConfigError(
                f"spectral: class {cls} has {n} training sample; a spectral signature needs at least 2 per class"
            )
    return sizes


def detect(features: Tensor, labels: Tensor, *, removal: str = "official", percentile: float = 85.0,
           removal_ratio: float = 1.5, expected_poison_rate: float = 0.1, score: str = "squared") -> tuple[Tensor, Tensor]:
    """Scores and flags for (N, d) features with their (training) labels, class by class: `official`
    flags the scores above each class's `percentile`; `oracle` the top `class_removals` of each."""
    scores = torch.zeros(len(labels))
    flagged = torch.zeros(len(labels), dtype=torch.bool)
    counts = class_removals(labels, removal_ratio, expected_poison_rate) if removal == "oracle" else None
    for cls in class_sizes(labels):
        members = torch.nonzero(labels == cls).flatten()
        class_scores = spectral_scores(features[members], score)
        scores[members] = class_scores
        if counts is None:
            flagged[members[percentile_flags(class_scores, percentile)]] = True
        elif counts[cls] > 0:
            flagged[members[torch.topk(class_scores, counts[cls]).indices]] = True
    return scores, flagged


def _choice(key: str, value: Any, options: tuple[str, ...]) -> str:
    if value not in options:
        raise ConfigError(f"defense.{key}={value!r} is unknown; choose one of: {', '.join(options)}")
    return value


class SpectralSignatures(Defense):
    """Spectral Signatures (Tran, Li, Madry, "Spectral Signatures in Backdoor Attacks", NeurIPS 2018).

    Poisoned samples leave a strong trace in the covariance of the learned features of their
    (target) class: per class, samples are scored by their squared projection on the top singular
    vector of the centered features of the model trained on the poisoned data; the highest are
    removed and the model is retrained on the rest. Ledger: docs/fidelity.md#spectral.

    What is removed (`removal`): `official` (the default), the scores above the 85th percentile of
    every class (`percentile`), as the authors' code (`percentile 85`, about 1.5 eps for their 500
    poisons in a class of 5,500) and BackdoorBench do; `oracle`, backdoor-toolbox's rule, 1.5 eps of
    every class, eps = `expected_poison_rate` times the whole training set, at most half a class (on
    CIFAR-10 at 0.1 that removes half the data; on a clean set it still removes that much).
    Limit (of the method, measured): dirty-label all2one at a 10% rate on a 10-class set puts about
    half of the target class poisoned (mnist5k: 400 of 765). The official rule then catches at most
    15 / 52 of the poison, and the two halves sit almost symmetrically about the class mean along the
    top direction, so the squared projection barely ranks the poison above the clean half (AUROC
    within the target class about 0.5) although that direction separates them.
    Departures: the score is the paper's (`score=squared`); the authors' code and BackdoorBench take
    the absolute projection of the uncentered features (`score=official`), which ranks first the
    cluster lying farther from the origin along the direction, poison or not. The features are
    `model.features` (`layer=penultimate`, the pooled vector); both official codes read an unpooled
    map of the last stage (`layer=last_stage`). Scores are divided by their class mean so one AUROC
    over all classes is meaningful (the ranking within a class, hence what is removed, is unchanged).
    """

    name = "spectral"
    family = "latent_separation"
    sensitivity = ("percentile",)  # swept by conf/experiment/sensitivity_spectral.yaml
    aliases = ("ss", "spectral_signatures", "spectral_signature")
    stage = "pre_train"
    needs_clean_data = False
    meets_training_controlled_attacks = False

    def __init__(self, *, removal: str = "official", percentile: float = 85.0, expected_poison_rate: float = 0.1,
                 removal_ratio: float = 1.5, score: str = "squared", layer: str = "penultimate",
                 clean_fraction: float = 0.0) -> None:
        super().__init__(clean_fraction=clean_fraction)
        self.removal = _choice("removal", removal, REMOVALS)
        self.score = _choice("score", score, SCORES)
        self.layer = _choice("layer", layer, LAYERS)
        checks.number("defense", "percentile", percentile, 0, 100, high_open=True,
                      hint="the official code: 85 (removes the top 15% of each class)")
        checks.number("defense", "expected_poison_rate", expected_poison_rate, 0, 1, low_open=True, high_open=True,
                      hint="the share of the training set the defender expects poisoned")
        checks.number("defense", "removal_ratio", removal_ratio, 0, low_open=True, hint="the paper: 1.5")
        self.percentile = float(percentile)
        self.expected_poison_rate = float(expected_poison_rate)
        self.removal_ratio = float(removal_ratio)

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        train: Split = ctx.poisoned_train
        tap = penultimate_features if self.layer == "penultimate" else last_stage_map_features
        features = tap(ctx.model, train.images, ctx.trainer.device, ctx.trainer.eval_batch_size)
        scores, flagged = detect(features, train.labels, removal=self.removal, percentile=self.percentile,
                                 removal_ratio=self.removal_ratio, expected_poison_rate=self.expected_poison_rate,
                                 score=self.score)
        return DefenseResult(sample_scores=scores, flagged=flagged, extras={"feature_dim": int(features.shape[1])})

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "removal": self.removal, "percentile": self.percentile,
                "expected_poison_rate": self.expected_poison_rate, "removal_ratio": self.removal_ratio,
                "score": self.score, "layer": self.layer}
