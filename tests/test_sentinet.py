"""SentiNet (Chou, Tramèr, Pellegrino, S&P Workshops 2020) as BackdoorBench runs it: the Grad-CAM
region, the pasting onto held clean images and noise, Beatrix's decision boundary against hand
computations, and the defining property on a small patch-backdoored model: the region Grad-CAM
picks on a triggered input covers the patch, carries the target onto clean images, and scores
above the clean inputs' regions; on a whole-image trigger (Blended) there is no region to find."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from backdoorbench.attacks.badnets import BadNets
from backdoorbench.attacks.blended import Blended
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.runner import run_defense
from backdoorbench.defenses.sentinet import (SentiNet, boundary_points, last_conv, paste, saliency_masks,
                                             squared_distance_to_parabola)
from backdoorbench.errors import ConfigError
from backdoorbench.metrics.detection import auroc
from backdoorbench.models.base import ImageClassifier, Normalized
from tests.test_defenses_detect import context, tiny_trainer
from tests.tiny import ZOO, zoo_model

SHAPE = (1, 16, 16)
SPOTS = ((1, 1), (1, 9), (9, 1), (5, 5))  # the bright 6 x 6 square of each class; the patch goes bottom-right


def spot_data(n: int, seed: int, noise_share: float = 0.0) -> Split:
    """16 x 16 images whose class k is a bright square at SPOTS[k] on dark noise; the first
    `noise_share` are uniform noise with random labels, so the model is unsure on noise."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 4
    images = torch.rand(n, *SHAPE, generator=g) * 0.3
    for k, (r, c) in enumerate(SPOTS):
        sel = labels == k
        images[sel, :, r : r + 6, c : c + 6] = 0.7 + 0.3 * torch.rand(int(sel.sum()), 1, 6, 6, generator=g)
    m = int(noise_share * n)
    images[:m] = torch.rand(m, *SHAPE, generator=g)
    labels[:m] = torch.randint(4, (m,), generator=g)
    return Split((images * 255).round().to(torch.uint8), labels)


class SpotNet(ImageClassifier):
    name = "spot"

    def __init__(self, num_classes: int = 4, **_):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(16, num_classes)


def trained(attack):
    torch.manual_seed(0)
    poisoned = attack.poison_dataset(spot_data(800, 0, noise_share=0.15), torch.Generator().manual_seed(0))
    model = Normalized(SpotNet(4), (0.3,), (0.3,))
    tiny_trainer(10).fit(model, poisoned.split, generator=torch.Generator().manual_seed(0))
    return model.eval(), poisoned


@pytest.fixture(scope="module")
def patched():
    attack = BadNets(num_classes=4, image_shape=SHAPE, patch_size=4, poison_rate=0.1, target=0)
    return (*trained(attack), attack)


def test_paste_keeps_the_region_and_takes_the_background_elsewhere():
    x = torch.full((1, 1, 2, 2), 0.9)
    masks = torch.tensor([[[[1.0, 0.0], [0.0, 0.0]]]])
    backgrounds = torch.stack([torch.full((1, 2, 2), 0.2), torch.full((1, 2, 2), 0.4)]).unsqueeze(0)
    out = paste(x, masks, backgrounds)
    assert out.shape == (1, 2, 1, 2, 2)
    assert torch.allclose(out[0, 0, 0], torch.tensor([[0.9, 0.2], [0.2, 0.2]]))
    assert torch.allclose(out[0, 1, 0], torch.tensor([[0.9, 0.4], [0.4, 0.4]]))


def test_masks_are_the_min_max_scaled_cam_above_the_threshold():
    class Linear(nn.Module):  # logits = the sum of a 1-channel conv's output times fixed weights
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 1, 1, bias=False)
            nn.init.ones_(self.conv.weight)

        def forward(self, x):
            a = self.conv(x)
            return torch.stack([a.mean((1, 2, 3)), -a.mean((1, 2, 3))], 1)

    model = Linear()
    # class 0: weight = mean gradient 1/4 > 0, cam = relu(x) / ... ; values 0.1, 0.4, 0.7, 1.0
    x = torch.tensor([[[[0.1, 0.4], [0.7, 1.0]]]])
    # min-max scaled: 0, 1/3, 2/3, 1 -> >= 0.6: the two largest
    assert saliency_masks(model, x, 0.6, model.conv)[0, 0].tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert saliency_masks(model, x, 0.9, model.conv)[0, 0].tolist() == [[0.0, 0.0], [0.0, 1.0]]
    assert last_conv(model) is model.conv


def test_decision_boundary_by_hand():
    # bins of 0.04 on the confidence: (0.4, 0.44] holds three points, the two most fooled kept
    confidence = np.array([0.41, 0.42, 0.43, 0.81, 0.82, 0.97])
    fooled = np.array([0.1, 0.5, 0.3, 0.2, 0.6, 0.9])
    xs, ys, bins = boundary_points(confidence, fooled, 0.04)
    assert xs.tolist() == [0.43, 0.42, 0.81, 0.82, 0.97] and ys.tolist() == [0.3, 0.5, 0.2, 0.6, 0.9]
    assert bins.tolist() == [10, 10, 20, 20, 24]
    # the squared distance of a point to y = x^2: (0, 1) is 0.75 from (+-sqrt(1/2), 1/2)
    assert squared_distance_to_parabola(np.array([0.0]), np.array([1.0]), np.array([1.0, 0, 0]))[0] == \
        pytest.approx(0.75)
    # to a line y = 0 (a = 0): the vertical distance
    assert squared_distance_to_parabola(np.array([0.3]), np.array([0.4]), np.array([0, 0, 0.0]))[0] == \
        pytest.approx(0.16)


def test_triggered_regions_cover_the_patch_carry_the_target_and_score_above_clean_ones(patched):
    model, poisoned, attack = patched
    test = spot_data(120, seed=5)
    x = to_float(test.images)
    triggered = attack.apply_trigger(x[test.labels != 0])
    with torch.no_grad():
        assert (model(x).argmax(1) == test.labels).float().mean() > 0.95
        assert (model(triggered).argmax(1) == 0).float().mean() > 0.95
    detector = SentiNet(mask_threshold=0.5)
    masks = saliency_masks(model, triggered, 0.5, last_conv(model))
    assert masks[..., 12:, 12:].mean() > 0.6  # the region covers most of the 4 x 4 patch
    assert masks[..., :8, :8].mean() < 0.05  # and little of the rest
    ctx = context(model, poisoned, spot_data(200, seed=7), num_classes=4)
    outcome = run_defense(detector, ctx, attack, test)
    fooled, confidence = detector.measure(model, x)
    bad_fooled, bad_confidence = detector.measure(model, triggered)
    # pasted onto clean images the region takes them to the target; a clean input's region does not
    assert bad_fooled.mean() > 0.9 and fooled.mean() < 0.6
    assert bad_confidence.mean() > confidence.mean() + 0.2
    assert outcome.detection["auroc"] > 0.95 and outcome.detection["threshold"] == 0.9
    assert outcome.cost["per_input_forward_images"] == pytest.approx(2 + 2 * 100)  # predict, Grad-CAM, 2 x 100 pasted
    # BackdoorBench's mask_cond 0.85 keeps a few pixels of this toy's coarse map: less of the patch
    assert saliency_masks(model, triggered, 0.85, last_conv(model))[..., 12:, 12:].mean() < masks[..., 12:, 12:].mean()
    # the paper's boundary rule, fitted on the clean subset's points
    boundary = SentiNet(mask_threshold=0.5, rule="boundary", num_calibration=120)
    outcome = run_defense(boundary, ctx, attack, test)
    assert outcome.extras["n_boundary_points"] >= 3 and outcome.extras["calibration_fpr"] < 0.25
    assert outcome.detection["auroc"] > 0.9 and outcome.detection["tpr"] > 0.8, outcome.detection


def test_a_whole_image_trigger_gives_no_region_to_carry():
    attack = Blended(num_classes=4, image_shape=SHAPE, alpha=0.2, pattern="random", poison_rate=0.1, target=0)
    model, _ = trained(attack)
    test = spot_data(120, seed=5)
    x = to_float(test.images)
    triggered = attack.apply_trigger(x[test.labels != 0])
    with torch.no_grad():
        assert (model(triggered).argmax(1) == 0).float().mean() > 0.9
    detector = SentiNet(mask_threshold=0.5)
    detector.apply(context(model, _, spot_data(200, seed=7), num_classes=4))
    fooled, confidence = detector.measure(model, x)
    bad_fooled, bad_confidence = detector.measure(model, triggered)
    # the localisation assumption fails: a fifth of the blend in a small region fools few clean images
    assert bad_fooled.mean() < 0.5
    scores = torch.cat([confidence, bad_confidence])
    is_bad = torch.cat([torch.zeros(len(x)), torch.ones(len(triggered))]).bool()
    assert auroc(scores, is_bad) < 0.8


def test_bad_values_are_refused_in_one_line():
    for kwargs, fragment in ((dict(mask_threshold=0), "defense.mask_threshold=0"),
                             (dict(rule="curve"), "defense.rule='curve' is invalid; use one of: confidence, boundary"),
                             (dict(threshold=2), "defense.threshold=2"),
                             (dict(num_clean=0), "defense.num_clean=0"),
                             (dict(num_calibration=2), "defense.num_calibration=2")):
        with pytest.raises(ConfigError) as info:
            SentiNet(**kwargs)
        assert fragment in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="has no nn.Conv2d"):
        SentiNet().check_model(nn.Sequential(nn.Flatten(), nn.Linear(4, 2)))


@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_sentinet_scores_inputs_of_every_model_of_the_zoo(name, shape, classes, kwargs):
    model = zoo_model(name, shape, classes, kwargs)
    SentiNet().check_model(model)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (4, *shape), dtype=torch.uint8, generator=g)
    ctx = DefenseContext(model=model, poisoned_train=Split(data, torch.zeros(4, dtype=torch.long)),
                         poisoned_indices=torch.arange(0), clean_subset=Split(data, torch.arange(4) % classes),
                         trainer=SimpleNamespace(device=torch.device("cpu"), eval_batch_size=4, prepare=lambda m: m),
                         num_classes=classes, generator=g)
    detector = SentiNet(num_clean=4)
    assert detector.apply(ctx).extras["n_held"] == 4  # one per class present (at least 1 per class)
    scores = detector.score_inputs(model, data[:2].float() / 255)
    assert scores.shape == (2,) and torch.isfinite(scores).all() and math.isfinite(detector.threshold)


@pytest.mark.parametrize(("confidences", "degree"), [((0.99999,), 0), ((0.5, 0.99999), 1)])
def test_clean_points_in_fewer_than_three_bins_give_a_level_or_a_line(confidences, degree):
    """A victim that gives noise one class at ~1.0 (LIRA's and WB's on mnist5k) puts every clean
    input's avg. confidence in the last bin: the boundary is the level of the highest-fooled clean
    points there (two bins: the line through theirs), and an input fooled beyond them is flagged."""
    data = spot_data(64, seed=3)
    detector = SentiNet(rule="boundary", num_calibration=40)
    fooled_of = {}

    def measure(model, x):  # the clean inputs' points: fooled 0.1..0.3, confidence from `confidences`
        fooled = torch.linspace(0.1, 0.3, len(x), dtype=torch.float64)
        confidence = torch.tensor([confidences[i % len(confidences)] for i in range(len(x))], dtype=torch.float64)
        fooled_of.update(fooled=fooled, confidence=confidence)
        return fooled, confidence

    detector.measure = measure
    ctx = context(nn.Sequential(nn.Conv2d(1, 1, 3), nn.Flatten()), SimpleNamespace(split=data, indices=torch.arange(0)),
                  data, num_classes=4)
    extras = detector.apply(ctx).extras
    assert extras["boundary_degree"] == degree and extras["n_boundary_points"] == 2 * len(confidences)
    assert detector.coef[: 2 - degree].tolist() == [0.0] * (2 - degree)
    xs, ys, _ = boundary_points(fooled_of["confidence"].numpy(), fooled_of["fooled"].numpy(), 0.04)
    for x in np.unique(xs):  # at the mean of each bin's points: a level through one bin, a line through two
        assert np.polyval(detector.coef, x) == pytest.approx(ys[xs == x].mean())
    top = torch.tensor([0.99999], dtype=torch.float64)
    assert detector.boundary_scores(torch.tensor([0.9], dtype=torch.float64), top).item() > detector.threshold
    assert detector.boundary_scores(torch.tensor([0.1], dtype=torch.float64), top).item() < detector.threshold
