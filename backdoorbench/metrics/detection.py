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
    """TPR (flagged among positives), FPR (flagged among negatives) and F1 of a bool decision.

    F1 = 2 TP / (2 TP + FP + FN), the harmonic mean of precision and recall at the detector's own
    flags; None when there is nothing to find and nothing was flagged (0 / 0), 0 when only clean
    samples were flagged. Each rate is None where its denominator is empty."""
    flagged, positive = flagged.bool().flatten().cpu(), positive.bool().flatten().cpu()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    hits, false_alarms = int((flagged & positive).sum()), int((flagged & ~positive).sum())
    f1_denominator = hits + false_alarms + n_pos  # 2 TP + FP + FN, as TP + FN = n_pos
    return {
        "tpr": hits / n_pos if n_pos else None,
        "fpr": false_alarms / n_neg if n_neg else None,
        "f1": 2 * hits / f1_denominator if f1_denominator else None,
    }
