"""SCALE-UP (Guo et al., ICLR 2023): the scaled prediction consistency of an input, the input space
the pixels are amplified in, the data-limited standardisation, and the defining property on a
small backdoored model: triggered inputs keep their prediction under amplification, clean ones do not."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from backdoorbench.attacks.badnets import BadNets
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.runner import run_defense
from backdoorbench.defenses.scale_up import ScaleUp, amplified, scaled_predictions, spc
from backdoorbench.errors import ConfigError
from backdoorbench.metrics.detection import auroc
from backdoorbench.models.base import Normalized
from tests.test_defenses_detect import SHAPE, TinyNet, context, quadrant_data, tiny_trainer
from tests.tiny import ZOO, zoo_model

OFFICIAL_SCALES = [3.0, 5.0, 7.0, 9.0, 11.0]


class NearestBrightness(nn.Module):
    """Class = the centre nearest the image's mean pixel: 0.15 (class 0), 0.45 (1), 0.8 (2)."""
    centres = torch.tensor([0.15, 0.45, 0.8])

    def forward(self, x):
        return -(x.flatten(1).mean(1, keepdim=True) - self.centres) ** 2


def test_the_spc_of_hand_made_inputs_is_the_hand_computed_share():
    model = NearestBrightness()
    # a uniform image of 0.05: class 0; amplified 0.15 0.25 0.35 0.45 0.55 -> classes 0 0 1 1 1
    uniform = torch.full((1, 1, 1, 2), 0.05)
    # pixels 0.02 and 0.3 (mean 0.16, class 0); x3: 0.06 0.9 (mean 0.48), x5: 0.1 1 (the 1.5 clipped:
    # mean 0.55), x7: 0.14 1 (0.57), x9: 0.18 1 (0.59), x11: 0.22 1 (0.61) -> class 1 every time;
    # unclipped, x5..x11 would reach class 2
    split = torch.tensor([[[[0.02, 0.3]]]])
    original, scaled = scaled_predictions(model, torch.cat([uniform, split]), OFFICIAL_SCALES)
    assert original.tolist() == [0, 0]
    assert scaled.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert spc(scaled, original).tolist() == pytest.approx([2 / 5, 0.0])
    detector = ScaleUp()
    assert detector.scales == OFFICIAL_SCALES and detector.threshold == 0.5
    assert detector.score_inputs(model, torch.cat([uniform, split])).tolist() == pytest.approx([0.4, 0.0])
    # the authors' script's scales 1..11: the unscaled copy always agrees, the rest as by hand
    # x1..x11 of 0.04: 0.04..0.28 class 0 (seven), 0.32..0.44 class 1 (four)
    brighter = ScaleUp(scales=list(range(1, 12))).score_inputs(model, torch.full((1, 1, 1, 2), 0.04))
    assert brighter.tolist() == pytest.approx([7 / 11])


class Recorder(nn.Module):
    """Records what it is given; its logits are irrelevant here."""
    def __init__(self):
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        self.seen.append(x.clone())
        return x.flatten(1)[:, :3]


def test_pixels_are_amplified_in_the_unnormalised_input_space_as_the_official_code():
    mean, std = 0.5, 0.25
    inner = Recorder()
    model = Normalized(inner, (mean,), (std,))
    x = torch.rand(4, 1, 3, 3, generator=torch.Generator().manual_seed(0))
    ScaleUp().spc(model, x)
    assert len(inner.seen) == 1 + len(OFFICIAL_SCALES)  # the input, then one pass per scale
    normalised = (x - mean) / std
    for n, seen in zip(OFFICIAL_SCALES, inner.seen[1:]):
        # backdoor-toolbox: normalizer(clip(denormalizer(x) * n, 0, 1)); BackdoorBox: clip(x * n, 0, 1) on [0, 1] images
        toolbox = (torch.clip((normalised * std + mean) * n, 0, 1) - mean) / std
        assert torch.allclose(seen, toolbox, atol=1e-6)
        assert not torch.allclose(seen, torch.clip(normalised * n, 0, 1))  # scaling the normalised tensor is wrong
    assert torch.equal(amplified(torch.tensor([0.1, 0.5]), 3.0), torch.tensor([0.1 * 3.0, 1.0]))


def test_data_limited_mode_standardises_with_the_clean_subsets_spc_against_its_labels():
    model = NearestBrightness()
    # uniform images (uint8): class-0 images of 13/255 (SPC 2/5 against label 0, as above) and of
    # 26/255 = 0.102 (x3 0.31: class 1; SPC 0 against label 0), one with a wrong label 1 (x3..x11
    # of 0.051: 0 0 1 1 1 -> 3/5 against label 1: the official statistics compare with labels)
    images = torch.tensor([13, 13, 26, 13], dtype=torch.uint8).view(4, 1, 1, 1)
    labels = torch.tensor([0, 0, 0, 1])
    clean = Split(images, labels)
    values = torch.tensor([0.4, 0.4, 0.0, 0.6])
    ctx = DefenseContext(model=model, poisoned_train=clean, poisoned_indices=torch.arange(0), clean_subset=clean,
                         trainer=tiny_trainer(1), num_classes=3, generator=torch.Generator().manual_seed(0))
    detector = ScaleUp(standardize=True, clean_fraction=0.05)
    extras = detector.apply(ctx).extras
    assert extras["clean_spc_mean"] == pytest.approx(float(values.mean()))
    assert extras["clean_spc_std"] == pytest.approx(float(values.std()))  # unbiased, as torch.std
    x = torch.full((1, 1, 1, 1), 0.05)  # raw SPC 0.4
    expected = (0.4 - float(values.mean())) / float(values.std())
    assert detector.score_inputs(model, x).item() == pytest.approx(expected)
    assert detector.threshold == 0.5  # the official T applies to the z-score
    # the default mode reads no clean data and scores the raw SPC
    plain = ScaleUp()
    assert plain.apply(dataclasses.replace(ctx, clean_subset=clean.subset(torch.arange(0)))).extras == {
        "n_scales": 5, "standardize": False}
    assert plain.score_inputs(model, x).item() == pytest.approx(0.4)
    # every clean image with the same SPC: standardised by the mean alone, no division by zero
    same = ScaleUp(standardize=True, clean_fraction=0.05)
    same.apply(dataclasses.replace(ctx, clean_subset=clean.subset(torch.tensor([0, 1]))))
    assert same.score_inputs(model, x).item() == pytest.approx(0.0)


@pytest.fixture(scope="module")
def backdoored():
    """A 4-class toy whose class is a bright quadrant, BadNets' 3x3 checkerboard planted (target 0)."""
    torch.manual_seed(0)
    attack = BadNets(num_classes=4, image_shape=SHAPE, patch_size=3, poison_rate=0.1, target=0)
    poisoned = attack.poison_dataset(quadrant_data(400, seed=0), torch.Generator().manual_seed(0))
    model = Normalized(TinyNet(4), (0.3,), (0.3,))
    tiny_trainer(6).fit(model, poisoned.split, generator=torch.Generator().manual_seed(0))
    return model.eval(), attack, poisoned


def test_triggered_inputs_keep_their_prediction_under_amplification_and_are_flagged(backdoored):
    model, attack, poisoned = backdoored
    test = quadrant_data(200, seed=5)
    x = to_float(test.images)
    attackable = test.labels != 0
    triggered = attack.apply_trigger(x[attackable])
    with torch.no_grad():
        assert (model(x).argmax(1) == test.labels).float().mean() > 0.95  # the clean task is learnt
        assert (model(triggered).argmax(1) == 0).float().mean() > 0.95  # and so is the backdoor
    detector = ScaleUp()
    clean_spc, bad_spc = detector.spc(model, x), detector.spc(model, triggered)
    # the defining property: amplified triggered images stay at the target, clean ones drift
    assert bad_spc.mean() > 0.95 and clean_spc.mean() < 0.5, (bad_spc.mean(), clean_spc.mean())
    assert (bad_spc == 1).float().mean() > 2 * (clean_spc == 1).float().mean()
    outcome = run_defense(detector, context(model, poisoned, poisoned.split.subset(torch.arange(0))), attack, test)
    assert outcome.detection["auroc"] > 0.8 and outcome.detection["threshold"] == 0.5
    assert outcome.detection["tpr"] > 0.9 and outcome.detection["fpr"] < 0.5, outcome.detection
    assert outcome.defended["asr"] < 0.1  # rejected triggered inputs no longer count as attacks
    assert outcome.cost["per_input_forward_images"] == 1 + len(OFFICIAL_SCALES)
    # the score the runner ranks is the SPC itself
    assert auroc(torch.cat([clean_spc, bad_spc]), torch.cat([torch.zeros(len(clean_spc)), torch.ones(len(bad_spc))]).bool()) \
        == pytest.approx(outcome.detection["auroc"])


def test_bad_values_are_refused_in_one_line():
    for kwargs, fragment in ((dict(scales=[]), "defense.scales=[] is invalid"),
                             (dict(scales=[3, -1]), "pixel multipliers > 0"),
                             (dict(scales="3,5"), "defense.scales='3,5' is invalid"),
                             (dict(threshold="high"), "defense.threshold='high' is invalid"),
                             (dict(standardize="yes"), "defense.standardize='yes' is invalid; use true or false"),
                             (dict(standardize=True), "defense.clean_fraction=0 holds none")):
        with pytest.raises(ConfigError) as info:
            ScaleUp(**kwargs)
        assert fragment in str(info.value) and "\n" not in str(info.value)
    model = NearestBrightness()
    one = Split(torch.zeros(1, 1, 1, 1, dtype=torch.uint8), torch.zeros(1, dtype=torch.long))
    ctx = DefenseContext(model=model, poisoned_train=one, poisoned_indices=torch.arange(0), clean_subset=one,
                         trainer=tiny_trainer(1), num_classes=3, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match="at least 2 clean images"):
        ScaleUp(standardize=True, clean_fraction=0.01).apply(ctx)


@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_scale_up_scores_inputs_of_every_model_of_the_zoo(name, shape, classes, kwargs):
    model = zoo_model(name, shape, classes, kwargs)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (6, *shape), dtype=torch.uint8, generator=g)
    ctx = DefenseContext(model=model, poisoned_train=Split(data, torch.zeros(6, dtype=torch.long)),
                         poisoned_indices=torch.arange(0), clean_subset=Split(data[:4], torch.arange(4) % classes),
                         trainer=SimpleNamespace(device=torch.device("cpu"), eval_batch_size=4,
                                                 prepare=lambda m: m), num_classes=classes, generator=g)
    detector = ScaleUp(standardize=True, clean_fraction=0.05)
    extras = detector.apply(ctx).extras
    assert extras["n_calibration"] == 4
    scores = detector.score_inputs(model, data[:2].float() / 255)
    assert scores.shape == (2,) and torch.isfinite(scores).all()
    raw = ScaleUp().spc(model, data[:2].float() / 255)
    assert ((raw * 5).round() == raw * 5).all() and (0 <= raw).all() and (raw <= 1).all()
    assert math.isfinite(detector.threshold)
