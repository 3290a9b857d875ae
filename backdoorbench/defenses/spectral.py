"""Spectral Signatures: remove the training samples that project most on each class's top
singular direction of penultimate features (pre-training detection)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.errors import ConfigError


@torch.no_grad()
def penultimate_features(model: nn.Module, images: Tensor, device: torch.device, batch_size: int = 1024) -> Tensor:
    """`model.features` of uint8 images (N, C, H, W) in eval mode, as float32 (N, d) on the CPU."""
    if not callable(getattr(model, "features", None)):
        raise ConfigError(f"this defense reads penultimate features, but {type(model).__name__} has no .features(x)")
    model = model.to(device).eval()
    out = [model.features(to_float(images[s : s + batch_size].to(device))).float().flatten(1).cpu()
           for s in range(0, len(images), batch_size)]
    return torch.cat(out)


def spectral_scores(features: Tensor) -> Tensor:
    """Outlier score of each row of one class's (n, d) features: its squared projection on the top
    right singular vector of the centered features, divided by the mean of those (so scores of
    different classes are comparable: 1 is the class average)."""
    centered = features.double() - features.double().mean(0, keepdim=True)
    _, _, vh = torch.linalg.svd(centered, full_matrices=False)
    squared = (centered @ vh[0]) ** 2
    mean = squared.mean()
    return (squared / mean if mean > 0 else squared).float()


def class_removals(labels: Tensor, removal_ratio: float, expected_poison_fraction: float) -> dict[int, int]:
    """How many samples to remove from each non-empty class: round(ratio * eps * n_class)."""
    counts = torch.bincount(labels)
    removals = {}
    for cls, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        if n < 2:
            raise ConfigError(
                f"spectral: class {cls} has {n} training sample; a spectral signature needs at least 2 per class"
            )
        removals[cls] = min(n, round(removal_ratio * expected_poison_fraction * n))
    return removals


def detect(features: Tensor, labels: Tensor, removal_ratio: float, expected_poison_fraction: float) -> tuple[Tensor, Tensor]:
    """Scores and flags for (N, d) features with their (training) labels, class by class."""
    scores = torch.zeros(len(labels))
    flagged = torch.zeros(len(labels), dtype=torch.bool)
    for cls, k in class_removals(labels, removal_ratio, expected_poison_fraction).items():
        members = torch.nonzero(labels == cls).flatten()
        class_scores = spectral_scores(features[members])
        scores[members] = class_scores
        if k > 0:
            flagged[members[torch.topk(class_scores, k).indices]] = True
    return scores, flagged


class SpectralSignatures(Defense):
    """Spectral Signatures (Tran, Li, Madry, "Spectral Signatures in Backdoor Attacks", NeurIPS 2018).

    Poisoned samples leave a strong trace in the covariance of the learned features of their
    (target) class: per class, samples are scored by their squared projection on the top singular
    vector of the centered penultimate features of the model trained on the poisoned data, and
    the removal_ratio * eps highest are removed before retraining (the paper: 1.5 eps).
    Departures: the paper's eps is an upper bound on the count of poisoned samples in the class
    (their classes are balanced, poison lives in one class); we take it as a share of each class
    (`expected_poison_fraction`), so it carries over to unbalanced classes. Sample scores are
    normalized by their class mean so one AUROC over all classes is meaningful (the ranking within
    a class, hence what is removed, is unchanged). The paper reads an intermediate ResNet block;
    we read `model.features` (the penultimate vector), the choice most re-implementations make.
    """

    name = "spectral"
    stage = "pre_train"
    needs_clean_data = False
    meets_training_controlled_attacks = False

    def __init__(self, *, expected_poison_fraction: float = 0.1, removal_ratio: float = 1.5, clean_fraction: float = 0.0) -> None:
        super().__init__(clean_fraction=clean_fraction)
        checks.number("defense", "expected_poison_fraction", expected_poison_fraction, 0, 1, low_open=True, high_open=True)
        checks.number("defense", "removal_ratio", removal_ratio, 0, low_open=True, hint="the paper: 1.5")
        if removal_ratio * expected_poison_fraction >= 1:
            raise ConfigError(
                f"defense.removal_ratio * defense.expected_poison_fraction = {removal_ratio * expected_poison_fraction:g} "
                "would remove whole classes; keep the product below 1"
            )
        self.expected_poison_fraction = float(expected_poison_fraction)
        self.removal_ratio = float(removal_ratio)

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        train: Split = ctx.poisoned_train
        features = penultimate_features(ctx.model, train.images, ctx.trainer.device, ctx.trainer.eval_batch_size)
        scores, flagged = detect(features, train.labels, self.removal_ratio, self.expected_poison_fraction)
        return DefenseResult(sample_scores=scores, flagged=flagged, extras={"feature_dim": int(features.shape[1])})

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "expected_poison_fraction": self.expected_poison_fraction,
                "removal_ratio": self.removal_ratio}
