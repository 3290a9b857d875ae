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
from backdoorbench.errors import ConfigError
from backdoorbench.models.taps import penultimate_features

REDUCTIONS = ("ica", "pca")
# Which cluster of a class is poisoned (IBM ART's ClusteringAnalyzer, the authors' code):
# smaller: the smaller cluster of every class (ART's and BackdoorBench's default);
# relative_size: the smaller cluster when it holds less than size_threshold of its class (the paper);
# silhouette: as relative_size, and only when the split is cohesive (silhouette > silhouette_threshold).
ANALYSES = ("smaller", "relative_size", "silhouette")


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
    features: Tensor, labels: Tensor, *, n_components: int, method: str, size_threshold: float, seed: int,
    analysis: str = "smaller", silhouette_threshold: float = 0.1,
) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """Scores, flags and per-class statistics for (N, d) activations with their training labels.

    A sample's score is 1 - (share of its class held by its cluster): the smaller a cluster, the
    more suspicious its members; which smaller clusters are flagged is the `analysis` rule.
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
        small = share < size_threshold
        poisoned = {"smaller": True, "relative_size": small,
                    "silhouette": small and silhouette > silhouette_threshold}[analysis]
        if poisoned:
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
    class, the activations are reduced to 10 dimensions by ICA and split by 2-means, and a
    cluster analysis names the poisoned cluster, whose samples are removed before retraining.
    Ledger: docs/fidelity.md#activation-clustering. `analysis` is one of ART's (the authors'
    code): `smaller` (default, as ART and BackdoorBench: the smaller cluster of every class),
    `relative_size` (the paper's: smaller than `size_threshold` = 0.35 of the class) or
    `silhouette` (relative size and a cohesive split). The paper's rules assume the poison is a
    minority of its class; dirty-label all2one at a 10% rate makes it about half of the target
    class, which relative size can never flag, so the default is `smaller`, at the cost of
    removing the smaller half of every clean class too. Departures: exclusionary
    reclassification is not done (it needs a model retrained per suspicious cluster, and with the
    poison half a class, excluding either half leaves the retrained model without the class's
    clean evidence). The sample score (for AUROC) is 1 - the share of its cluster in its class,
    our choice: the paper only gives the binary verdict. `reduction=pca` gives ART's default
    instead of the paper's ICA.
    """

    name = "activation_clustering"
    family = "latent_separation"
    sensitivity = ("analysis",)  # swept by conf/experiment/sensitivity_activation_clustering.yaml
    aliases = ("ac",)
    stage = "pre_train"
    needs_clean_data = False
    meets_training_controlled_attacks = False

    def __init__(
        self, *, n_components: int = 10, reduction: str = "ica", analysis: str = "smaller",
        size_threshold: float = 0.35, silhouette_threshold: float = 0.1, clean_fraction: float = 0.0
    ) -> None:
        super().__init__(clean_fraction=clean_fraction)
        if analysis not in ANALYSES:
            raise ConfigError(f"defense.analysis={analysis!r} is unknown; choose one of: {', '.join(ANALYSES)}")
        checks.number("defense", "silhouette_threshold", silhouette_threshold, -1, 1, hint="ART's default: 0.1")
        checks.integer("defense", "n_components", n_components, 1, hint="the paper: 10")
        if reduction not in REDUCTIONS:
            raise ConfigError(f"defense.reduction={reduction!r} is unknown; choose one of: {', '.join(REDUCTIONS)}")
        checks.number("defense", "size_threshold", size_threshold, 0, 0.5, low_open=True, hint="a share of the class")
        self.n_components = n_components
        self.reduction = reduction
        self.size_threshold = float(size_threshold)
        self.analysis = analysis
        self.silhouette_threshold = float(silhouette_threshold)

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        train = ctx.poisoned_train
        features = penultimate_features(ctx.model, train.images, ctx.trainer.device, ctx.trainer.eval_batch_size)
        seed = int(torch.randint(2**31 - 1, (1,), generator=ctx.generator))
        scores, flagged, stats = detect(features, train.labels, n_components=self.n_components, method=self.reduction,
                                        size_threshold=self.size_threshold, seed=seed, analysis=self.analysis,
                                        silhouette_threshold=self.silhouette_threshold)
        return DefenseResult(sample_scores=scores, flagged=flagged, extras=stats)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "n_components": self.n_components, "reduction": self.reduction,
                "analysis": self.analysis, "size_threshold": self.size_threshold,
                "silhouette_threshold": self.silhouette_threshold}
