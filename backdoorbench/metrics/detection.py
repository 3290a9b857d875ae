"""Detection metrics for defenses that flag training samples or test inputs."""

from __future__ import annotations

import torch
from torch import Tensor


def auroc(scores: Tensor, positive: Tensor) -> float | None:
    """Area under the ROC curve of `scores` (higher = more suspicious) for the bool `positive`.

    Computed as the Mann-Whitney U statistic with ties counted as one half; None when either
    class is empty (the AUROC is undefined then, and a record never holds a made-up number).
    """
    scores = scores.detach().double().flatten().cpu()
    positive = positive.bool().flatten().cpu()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    order = torch.argsort(scores)
    sorted_scores = scores[order]
    ranks = torch.empty_like(scores)
    # Average ranks over ties.
    unique, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    average = ends - (counts.double() - 1) / 2
    ranks[order] = average[inverse]
    u = float(ranks[positive].sum()) - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


def detection_rates(flagged: Tensor, positive: Tensor) -> dict[str, float | None]:
    """TPR (flagged among positives) and FPR (flagged among negatives) of a bool decision."""
    flagged, positive = flagged.bool().flatten().cpu(), positive.bool().flatten().cpu()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    return {
        "tpr": int((flagged & positive).sum()) / n_pos if n_pos else None,
        "fpr": int((flagged & ~positive).sum()) / n_neg if n_neg else None,
    }
