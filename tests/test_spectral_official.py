"""Spectral Signatures against the official code: the percentile removal (the authors' and
BackdoorBench's `percentile 85`), the official score and layer options, and the toolkit's old
oracle rule kept as `removal=oracle`."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backdoorbench.datasets.base import Split
from backdoorbench.defenses import spectral
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.spectral import SpectralSignatures
from backdoorbench.errors import ConfigError
from backdoorbench.metrics.detection import auroc
from backdoorbench.models.base import ImageClassifier, Normalized
from backdoorbench.train import Trainer

SIZES = [20] + [60] * 9  # ten classes, the target (0) rare: 20 of 560


class ColourNet(ImageClassifier):
    """3-channel conv net: a 6x6 map of 8 channels, average-pooled to a 16-d penultimate vector."""

    name = "colour"

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                      nn.Flatten(), nn.Linear(8, 16), nn.ReLU())
        self.classifier = nn.Linear(16, num_classes)


def colour_context() -> DefenseContext:
    g = torch.Generator().manual_seed(0)
    labels = torch.cat([torch.full((n,), c, dtype=torch.long) for c, n in enumerate(SIZES)])
    images = torch.randint(0, 256, (len(labels), 3, 8, 8), generator=g, dtype=torch.uint8)
    torch.manual_seed(0)
    model = Normalized(ColourNet(), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)).eval()
    trainer = Trainer(epochs=1, batch_size=32, optimizer=partial(torch.optim.SGD, lr=0.01), augment=False,
                      progress=False, device="cpu")
    split = Split(images, labels)
    return DefenseContext(model=model, poisoned_train=split, poisoned_indices=torch.arange(5),
                          clean_subset=split.subset(torch.arange(0)), trainer=trainer, num_classes=10,
                          generator=torch.Generator().manual_seed(1))


def test_default_removes_at_most_15_percent_of_each_class_of_3_channel_10_class_data():
    ctx = colour_context()
    result = SpectralSignatures().apply(ctx)
    labels = ctx.poisoned_train.labels
    removed = torch.bincount(labels[result.flagged], minlength=10).tolist()
    # the toolkit's old rule removed min(half, 1.5 * 0.1 * 560 = 84) of each: 10 of the rare 20, 30 of 60
    assert removed == [3] + [9] * 9
    assert all(r <= 0.15 * n for r, n in zip(removed, SIZES))
    assert result.extras["feature_dim"] == 16


def test_the_percentile_rule_is_numpys_strictly_above_the_85th_percentile():
    g = torch.Generator().manual_seed(3)
    for n in (7, 20, 100, 765):
        scores = torch.rand(n, generator=g)
        ours = spectral.percentile_flags(scores, 85.0).numpy()
        official = scores.double().numpy() > np.percentile(scores.double().numpy(), 85)
        assert (ours == official).all()
        assert ours.sum() <= math.ceil(0.15 * n)  # 15% of the class, rounded up


def test_oracle_removal_keeps_the_old_rule():
    ctx = colour_context()
    result = SpectralSignatures(removal="oracle").apply(ctx)
    removed = torch.bincount(ctx.poisoned_train.labels[result.flagged], minlength=10).tolist()
    assert removed == [10] + [30] * 9  # min(n // 2, round(1.5 * 0.1 * 560))


def test_last_stage_reads_the_unpooled_map_and_official_score_is_the_uncentered_projection():
    ctx = colour_context()
    result = SpectralSignatures(layer="last_stage", score="official").apply(ctx)
    assert result.extras["feature_dim"] == 8 * 6 * 6  # the ReLU'd map before the global pooling
    features = torch.randn(50, 6, generator=torch.Generator().manual_seed(2)) + 3.0
    _, _, vh = torch.linalg.svd(features.double() - features.double().mean(0), full_matrices=False)
    raw = (features.double() @ vh[0]).abs()
    assert torch.allclose(spectral.spectral_scores(features, "official").double(), raw / raw.mean(), atol=1e-5)


def test_a_half_poisoned_class_is_split_by_the_top_direction_but_not_ranked_by_the_squared_score():
    # The mnist5k all2one case: 52% of the target class poisoned. The top singular direction is the
    # clean/poison axis (the signed projection separates them), but squaring folds the two halves
    # onto each other, so the paper's score ranks the poison barely above chance.
    g = torch.Generator().manual_seed(0)
    direction = F.normalize(torch.randn(32, generator=g), dim=0)
    clean, poison = torch.randn(365, 32, generator=g), torch.randn(400, 32, generator=g) + 6.0 * direction
    features = torch.cat([clean, poison])
    is_poison = torch.cat([torch.zeros(365, dtype=torch.bool), torch.ones(400, dtype=torch.bool)])
    centered = features.double() - features.double().mean(0)
    signed = (centered @ torch.linalg.svd(centered, full_matrices=False)[2][0]).float()
    assert max(auroc(signed, is_poison), auroc(-signed, is_poison)) > 0.99
    assert abs(auroc(spectral.spectral_scores(features), is_poison) - 0.5) < 0.15


@pytest.mark.parametrize("key, value, message", [
    ("removal", "top", "defense.removal='top' is unknown; choose one of: official, oracle"),
    ("score", "abs", "defense.score='abs' is unknown; choose one of: squared, official"),
    ("layer", "layer4", "defense.layer='layer4' is unknown; choose one of: penultimate, last_stage"),
    ("percentile", 100, "defense.percentile=100 is out of range"),
])
def test_bad_values_are_one_line_naming_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        SpectralSignatures(**{key: value})
