"""Activation Clustering: split each class's penultimate activations in two and flag a small
cluster (pre-training detection)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor

from backdoorbench import checks
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.defenses.spectral import penultimate_features
from backdoorbench.errors import ConfigError

REDUCTIONS = ("ica", "pca")


def reduce_dims(features: np.ndarray, n_components: int, method: str, seed: int) -> np.ndarray:
    """(n, d) activations -> (n, n_components) by FastICA (the paper) or PCA."""
    from sklearn.decomposition import PCA, FastICA
    from sklearn.exceptions import ConvergenceWarning

    # Dead ReLU units are constant columns; ICA's whitening divides by their zero variance.
    spread = features.std(0)
    features = features[:, spread > 1e-6 * max(float(spread.max()), 1e-12)]
    n_components = max(1, min(n_components, features.shape[1], np.linalg.matrix_rank(features - features.mean(0))))
    if method == "pca":
        return PCA(n_components=n_components, random_state=seed).fit_transform(features)
    with warnings.catch_warnings():
        # A slowly converging ICA still gives a usable projection for 2-means; don't spam the log.
        warnings.simplefilter("ignore", ConvergenceWarning)
        return FastICA(n_components=n_components, whiten="unit-variance", max_iter=1000,
                       random_state=seed).fit_transform(features)


def cluster_class(features: Tensor, n_components: int, method: str, seed: int) -> tuple[Tensor, float, float]:
    """2-means of one class in the reduced space: (bool mask of the smaller cluster, its share of
    the class, the silhouette score of the split)."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import silhouette_score

    reduced = reduce_dims(features.double().numpy(), n_components, method, seed)
    assignment = KMeans(n_clusters=2, n_init=10, random_state=seed).fit_predict(reduced)
    sizes = np.bincount(assignment, minlength=2)
    smaller = int(np.argmin(sizes))
    share = float(sizes[smaller] / len(assignment))
    silhouette = float(silhouette_score(reduced, assignment)) if sizes.min() > 0 else 0.0
    return torch.from_numpy(assignment == smaller), share, silhouette


def detect(
    features: Tensor, labels: Tensor, *, n_components: int, method: str, size_threshold: float, seed: int
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """Scores, flags and per-class statistics for (N, d) activations with their training labels.

    A sample's score is 1 - (share of its class held by its cluster): the smaller a cluster, the
    more suspicious its members; a class's smaller cluster is flagged when its share is below
    `size_threshold`.
    """
    counts = torch.bincount(labels)
    needed = min(n_components, features.shape[1]) + 1
    for cls, n in enumerate(counts.tolist()):
        if 0 < n < needed:
            raise ConfigError(
                f"activation_clustering: class {cls} has {n} training samples; clustering in "
                f"{needed - 1} dimensions needs at least {needed}; lower defense.n_components"
            )
    scores = torch.zeros(len(labels))
    flagged = torch.zeros(len(labels), dtype=torch.bool)
    shares, silhouettes, poisoned_classes = {}, {}, []
    for cls, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        members = torch.nonzero(labels == cls).flatten()
        in_smaller, share, silhouette = cluster_class(features[members], n_components, method, seed + cls)
        scores[members] = torch.where(in_smaller, 1.0 - share, share)
        if share < size_threshold:
            flagged[members[in_smaller]] = True
            poisoned_classes.append(cls)
        shares[str(cls)], silhouettes[str(cls)] = share, silhouette
    stats = {"smaller_cluster_share": shares, "silhouette": silhouettes, "poisoned_classes": poisoned_classes}
    return scores, flagged, stats


class ActivationClustering(Defense):
    """Activation Clustering (Chen, Carvalho, Baracaldo, Ludwig, Edwards, Lee, Molloy, Srivastava,
    "Detecting Backdoor Attacks on Deep Neural Networks by Activation Clustering", AAAI SafeAI
    workshop 2019).

    Poisoned samples of a class are classified there for a different reason (the trigger) than
    its clean samples, so their last-hidden-layer activations form a cluster of their own: per
    class, the activations are reduced to 10 dimensions by ICA and split by 2-means, and the
    smaller cluster is declared poisoned when it holds less than `size_threshold` (0.35) of the
    class; its samples are removed before retraining.
    Departures: of the paper's cluster analyses we decide by relative size (the silhouette score
    of each split is kept in the record); exclusionary reclassification is not done. The sample
    score (for AUROC) is 1 - the share of its cluster in its class, our choice: the paper only
    gives the binary verdict. `reduction=pca` gives IBM ART's default instead of ICA.
    """

    name = "activation_clustering"
    stage = "pre_train"
    needs_clean_data = False
    meets_training_controlled_attacks = False

    def __init__(
        self, *, n_components: int = 10, reduction: str = "ica", size_threshold: float = 0.35, clean_fraction: float = 0.0
    ) -> None:
        super().__init__(clean_fraction=clean_fraction)
        checks.integer("defense", "n_components", n_components, 1, hint="the paper: 10")
        if reduction not in REDUCTIONS:
            raise ConfigError(f"defense.reduction={reduction!r} is unknown; choose one of: {', '.join(REDUCTIONS)}")
        checks.number("defense", "size_threshold", size_threshold, 0, 0.5, low_open=True, hint="a share of the class")
        self.n_components = n_components
        self.reduction = reduction
        self.size_threshold = float(size_threshold)

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        train = ctx.poisoned_train
        features = penultimate_features(ctx.model, train.images, ctx.trainer.device, ctx.trainer.eval_batch_size)
        seed = int(torch.randint(2**31 - 1, (1,), generator=ctx.generator))
        scores, flagged, stats = detect(features, train.labels, n_components=self.n_components, method=self.reduction,
                                        size_threshold=self.size_threshold, seed=seed)
        return DefenseResult(sample_scores=scores, flagged=flagged, extras=stats)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "n_components": self.n_components, "reduction": self.reduction,
                "size_threshold": self.size_threshold}
