"""NAB (Liu, Sangiovanni-Vincentelli, Yue, ICCV 2023): the defensive stamp is the official 0 in the
normalised input and goes on every test input; the processed training set carries the stamp and the
pseudo-labels on exactly the flagged samples (after the augmentation); and on a small backdoored set
the defended model, stamped, sends triggered inputs to their pseudo-labels, not to the attack's target."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backdoorbench.datasets.base import Split
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.nab import (NonAdversarialBackdoor, Stamped, decode, defensive_step, encode, lga_schedule,
                                        relabel, stamp, stamp_value)
from backdoorbench.errors import ConfigError
from backdoorbench.models.base import Normalized
from backdoorbench.train import Trainer
from tests.tiny import ZOO, make_model, one_thread, zoo_model  # noqa: F401  (autouse fixture)


class Pixels(nn.Module):
    """A linear classifier on the flattened pixels: it reads the corner the stamp covers."""

    name = "pixels"

    def __init__(self, pixels: int, classes: int = 4):
        super().__init__()
        self.classifier = nn.Linear(pixels, classes)

    def features(self, x):
        return x.flatten(1)

    def forward(self, x):
        return self.classifier(self.features(x))


def test_the_stamp_is_the_official_zero_in_the_normalised_input():
    model = Normalized(Pixels(2 * 8 * 8), (0.4, 0.6), (0.2, 0.3))
    value = stamp_value(model, "mean")
    assert torch.allclose(value, torch.tensor([0.4, 0.6]))
    x = torch.rand(3, 2, 8, 8)
    out = stamp(x, value, 2)
    normalised = model.normalize(out)
    assert torch.allclose(normalised[:, :, :2, :2], torch.zeros(3, 2, 2, 2), atol=1e-6)  # the official image[:, :, :2, :2] = 0
    corner = torch.zeros(8, 8, dtype=torch.bool)
    corner[:2, :2] = True
    assert torch.equal(out[:, :, ~corner], x[:, :, ~corner])  # nothing else moves
    assert torch.equal(stamp(x, stamp_value(model, 0.25), 3)[:, :, :3, :3], torch.full((3, 2, 3, 3), 0.25))
    with pytest.raises(ConfigError, match=r"^defense.stamp_value=mean reads the model's normalisation; Linear has none"):
        stamp_value(nn.Linear(2, 2), "mean")


def test_every_input_is_stamped_at_test_time():
    torch.manual_seed(0)
    model = Normalized(Pixels(1 * 8 * 8), (0.5,), (0.25,)).eval()
    defended = Stamped(model, stamp_value(model, "mean"), 2).eval()
    x = torch.rand(16, 1, 8, 8)
    with torch.no_grad():
        assert torch.allclose(defended(x), model(stamp(x, 0.5, 2)))
        assert torch.allclose(defended.features(x), model.features(stamp(x, 0.5, 2)))
        assert not torch.allclose(defended(x), model(x))  # the classifier reads the corner: the stamp matters
    images = (x * 255).to(torch.uint8)
    predict = Trainer(progress=False).predict  # the way the pipeline measures CA and ASR
    assert torch.equal(predict(defended, images), predict(model, images, transform=lambda t: stamp(t, 0.5, 2)))
    assert defended.net is model.net  # the trained network itself, not a copy
    plain = Normalized(Pixels(64), (0.5,), (0.25,))
    plain.load_state_dict(defended.state_dict())  # a saved defended model loads into a plain one


def test_the_processed_set_stamps_and_relabels_exactly_the_flagged_samples():
    g = torch.Generator().manual_seed(0)
    n, classes = 24, 4
    images = torch.randint(0, 256, (n, 1, 8, 8), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, classes, (n,), generator=g)
    flagged = torch.zeros(n, dtype=torch.bool)
    flagged[[1, 4, 5, 9, 13, 20]] = True
    pseudo = (labels + 1) % classes
    pseudo[5] = labels[5]  # a flagged sample whose pseudo-label is its label: relabelled (no change), not stamped
    new, stamped = relabel(labels, flagged, pseudo)
    assert torch.equal(new, torch.where(flagged, pseudo, labels))
    assert torch.equal(stamped, flagged & (pseudo != labels)) and stamped.sum() == 5 and not stamped[5]
    encoded = encode(new, stamped, classes)
    assert all(torch.equal(a, b) for a, b in zip(decode(encoded, classes), (new, stamped)))

    # the real training path: the trainer's crop and flip, then the wrapped step sees the processed batch
    seen_x, seen_y = [], []

    def recording(model, x, y):
        seen_x.append(x.detach().clone())
        seen_y.append(y.clone())
        logits = model(x)
        return F.cross_entropy(logits, y), logits, y

    trainer = Trainer(epochs=1, batch_size=8, crop_padding=2, hflip=True, progress=False)
    trainer.shuffle = False  # the split's own order, to match rows back
    model = Normalized(Pixels(64), (0.5,), (0.25,))
    value = stamp_value(model, "mean")
    trainer.fit(model, Split(images, encoded), generator=torch.Generator().manual_seed(1),
                step=defensive_step(classes, value, 2)(recording))
    x, y = torch.cat(seen_x), torch.cat(seen_y)
    assert torch.equal(y, new)  # pseudo-labels on the flagged samples, the given labels elsewhere
    corners = x[:, 0, :2, :2].flatten(1)
    at_value = (corners == 0.5).all(1)  # 0.5 is no uint8 pixel /255 and no crop padding: only the stamp makes it
    assert torch.equal(at_value, stamped)  # the stamp after the augmentation, on exactly those samples

    # without augmentation every image reaches the step as it is stored, the stamp on exactly those samples
    seen_x.clear(), seen_y.clear()
    plain = Trainer(epochs=1, batch_size=8, augment=False, progress=False)
    plain.shuffle = False
    plain.fit(model, Split(images, encoded), generator=torch.Generator().manual_seed(1),
              step=defensive_step(classes, value, 2)(recording))
    stored = images.float() / 255
    assert torch.equal(torch.cat(seen_x), torch.where(stamped.view(-1, 1, 1, 1), stamp(stored, value, 2), stored))


def test_the_lga_schedule_is_the_official_formula():
    # backdoor_detection_lga.py sets lr = 0.5 (1 + cos(pi e / (epochs + 80))) lr0 after epoch e
    epochs, lr0 = 20, 0.1
    official = [lr0] + [0.5 * (1 + math.cos(math.pi * e / (epochs + 80))) * lr0 for e in range(epochs - 1)]
    factor = lga_schedule(epochs)
    assert [lr0 * factor(e / epochs) for e in range(epochs)] == pytest.approx(official, abs=1e-12)


# ------------------------------------------------------- a small backdoored set where it shows


def brightness_data(n: int, rate: float, seed: int):
    """16x16 one-channel images whose class (4) is their brightness and whose top-left 4x4 is black
    (as MNIST's border); `rate` of them (never class 0) carry a white 3x3 bottom-right corner and
    the label 0 (BadNets)."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randint(0, 4, (n,), generator=g)
    x = (torch.rand(n, 1, 16, 16, generator=g) * 50 + 45 * truth.view(-1, 1, 1, 1).float() + 10).to(torch.uint8)
    others = torch.nonzero(truth != 0).flatten()
    poisoned = others[torch.randperm(len(others), generator=g)[: int(rate * n)]].sort().values
    x[:, :, :4, :4] = 0
    x[poisoned, :, -3:, -3:] = 255
    labels = truth.clone()
    labels[poisoned] = 0
    return Split(x, labels), poisoned, truth


def train_victim(trainer):
    def run(net, wrap_step=None, train=None):
        step = wrap_step(lambda m, x, y: (F.cross_entropy(m(x), y), m(x), y)) if wrap_step else None
        trainer.fit(net, train, generator=torch.Generator().manual_seed(3), **({"step": step} if step else {}))

    return run


def test_the_defended_model_sends_stamped_triggered_inputs_to_their_pseudo_labels():
    train, poisoned, truth = brightness_data(400, 0.1, seed=0)
    test, _, _ = brightness_data(400, 0.0, seed=1)
    trainer = Trainer(epochs=10, batch_size=32, augment=False, progress=False, optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    clean = torch.tensor(sorted(set(range(400)) - set(poisoned.tolist()))[:40])
    ctx = DefenseContext(model=None, poisoned_train=train, poisoned_indices=poisoned, clean_subset=train.subset(clean),
                         trainer=trainer, num_classes=4, generator=torch.Generator().manual_seed(0),
                         build_model=lambda: make_model(0), train_victim=train_victim(trainer))
    # a 4x4 stamp: the toy model's valid 5x5 convs barely see a 2x2 corner of a 16 px image in 10 epochs
    defense = NonAdversarialBackdoor(vd_epochs=15, vd_lr=0.05, batch_size=32, cutout_length=0, stamp_size=4)
    # a detection given, as imperfect as LGA's: half the poison (20 of 40) and 20 clean samples flagged
    flagged = torch.zeros(400, dtype=torch.bool)
    flagged[poisoned[::2]] = True
    flagged[clean[:20]] = True
    defended, extras = defense.train_defended(ctx, flagged)
    # VD gives the flagged poison its class back, and those take the stamp; the flagged clean ones keep their label
    assert 18 <= extras["n_stamped"] <= 22

    predict = Trainer(progress=False).predict
    triggered = test.images.clone()
    triggered[:, :, -3:, -3:] = 255
    attackable = test.labels != 0
    assert isinstance(defended, Stamped)
    stamped_pred = predict(defended, triggered[attackable])
    asr = (stamped_pred == 0).float().mean().item()
    follows = (stamped_pred == test.labels[attackable]).float().mean().item()  # the pseudo-label VD gives: the class
    ca = (predict(defended, test.images) == test.labels).float().mean().item()
    # the same network without the defensive stamp: the attacker's backdoor is still there
    bare = Normalized(defended.net, (0.5,), (0.25,))
    asr_bare = (predict(bare, triggered[attackable]) == 0).float().mean().item()
    assert ca > 0.9 and asr < 0.2 and follows > 0.8 and asr_bare > 0.6, (ca, asr, follows, asr_bare)


# ------------------------------------------------------------------- the zoo, bad values, config


@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_the_zoo(name, shape, classes, kwargs):
    g = torch.Generator().manual_seed(0)
    data = Split(torch.randint(0, 256, (16, *shape), dtype=torch.uint8, generator=g),
                 torch.randint(0, classes, (16,), generator=g))
    trainer = Trainer(epochs=1, batch_size=8, crop_padding=2, progress=False)
    build = lambda: zoo_model(name, shape, classes, kwargs).train()  # noqa: E731
    ctx = DefenseContext(model=build().eval(), poisoned_train=data, poisoned_indices=torch.arange(0),
                         clean_subset=data.subset(torch.arange(4)), trainer=trainer, num_classes=classes, generator=g,
                         build_model=build, train_victim=train_victim(trainer))
    result = NonAdversarialBackdoor(lga_epochs=1, vd_epochs=1, batch_size=8, isolation_ratio=0.25).apply(ctx)
    with torch.no_grad():
        out = result.model.eval()(data.images[:2].float() / 255)
    assert out.shape == (2, classes) and torch.isfinite(out).all()
    assert int(result.flagged.sum()) == 4 and result.sample_scores.shape == (16,)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: NonAdversarialBackdoor(isolation_ratio=0), r"^defense.isolation_ratio=0 is out of range"),
    (lambda: NonAdversarialBackdoor(budget="gpu"), r"^defense.budget='gpu' is unknown for nab; choose one of: official, cpu"),
    (lambda: NonAdversarialBackdoor(stamp_value="zero"), r"^defense.stamp_value='zero' is invalid; use mean"),
    (lambda: NonAdversarialBackdoor(stamp_value=2), r"^defense.stamp_value=2 is out of range"),
    (lambda: NonAdversarialBackdoor(stamp_size=0), r"^defense.stamp_size=0 is invalid; use an integer >= 1"),
    (lambda: NonAdversarialBackdoor(clean_fraction=0), r"^defense.clean_fraction=0"),
])
def test_bad_values_are_one_config_error(make, message):
    with pytest.raises(ConfigError, match=message) as info:
        make()
    assert "\n" not in str(info.value)


def test_a_stamp_larger_than_the_images_is_one_line():
    data = Split(torch.zeros(4, 1, 4, 4, dtype=torch.uint8), torch.zeros(4, dtype=torch.long))
    ctx = DefenseContext(model=None, poisoned_train=data, poisoned_indices=torch.arange(0), clean_subset=data,
                         trainer=Trainer(progress=False), num_classes=2, generator=torch.Generator(),
                         build_model=lambda: None, train_victim=lambda *a, **k: None)
    with pytest.raises(ConfigError, match=r"^defense.stamp_size=5 is larger than the 4x4 images; use at most 4$"):
        NonAdversarialBackdoor(stamp_size=5).apply(ctx)


def test_the_config_is_the_official_values(compose_cfg):
    cfg = compose_cfg("defense=nab").defense
    assert (cfg.budget, cfg.isolation_ratio, cfg.gamma, cfg.lga_lr, cfg.vd_lr, cfg.batch_size, cfg.weight_decay) == (
        "official", 0.05, 0.5, 0.1, 0.01, 64, 1e-4)
    assert (cfg.stamp_size, cfg.stamp_value, cfg.clean_fraction, cfg.cutout_length) == (2, "mean", 0.05, 3)
    defense = NonAdversarialBackdoor()
    assert (defense.lga_epochs, defense.vd_epochs) == (20, 100)
    assert NonAdversarialBackdoor.stage == "in_train" and NonAdversarialBackdoor.is_detector()
    assert not NonAdversarialBackdoor.meets_training_controlled_attacks
