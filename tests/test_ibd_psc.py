"""IBD-PSC (Hou et al., ICML 2024): the official layer search and amplified copies, the PSC of a
hand-made model against a hand computation, the model left as it was, and the defining property on a
small backdoored model: amplified batch norms collapse clean predictions, triggered ones stay at the target."""

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
from backdoorbench.defenses.ibd_psc import IbdPsc, amplifiable_batch_norms, amplify_last
from backdoorbench.defenses.runner import run_defense
from backdoorbench.errors import ConfigError
from backdoorbench.metrics.detection import auroc
from backdoorbench.models.base import ImageClassifier, Normalized
from tests.test_defenses_detect import SHAPE, context, tiny_trainer
from tests.tiny import ZOO, zoo_model


class BatchNormChain(nn.Module):
    """The mean pixel x through four 1-channel batch norms (eval: w (y - mu) / sqrt(var) + b, with
    w = 1, mu = 0, var = 1, eps = 0; b = 0 but the last one's, -0.5), then logits (h, 0): class 0
    iff x > 0.5. With the last k amplified by s (weight and bias): h = s (s^(k-1) x - 0.5)."""

    def __init__(self):
        super().__init__()
        self.bns = nn.Sequential(*[nn.BatchNorm2d(1, eps=0.0) for _ in range(4)])
        with torch.no_grad():
            self.bns[3].bias.fill_(-0.5)
        self.eval()

    def forward(self, x):
        h = self.bns(x.mean((1, 2, 3)).view(-1, 1, 1, 1)).flatten(1)
        return torch.cat([h, torch.zeros_like(h)], 1)


def chain_context(model, values: list[int]) -> DefenseContext:
    """The clean subset: uniform 2x2 images of the given uint8 values, labelled as the model predicts."""
    images = torch.tensor(values, dtype=torch.uint8).view(-1, 1, 1, 1).expand(-1, 1, 2, 2).contiguous()
    labels = (torch.tensor(values) / 255 <= 0.5).long()  # class 0 iff x > 0.5
    clean = Split(images, labels)
    return DefenseContext(model=model, poisoned_train=clean, poisoned_indices=torch.arange(0), clean_subset=clean,
                          trainer=tiny_trainer(1), num_classes=2, generator=torch.Generator().manual_seed(0))


# 0.05 0.1 0.2 0.3 0.4 | 0.6 0.7 0.8 0.9 1.0. At s = 2 the last k amplified flip the class of
# x in (0.5 / 2^(k-1), 0.5): k = 1 none, k = 2 {0.3, 0.4}, k = 3 {0.2, 0.3, 0.4}, k = 4 also 0.1
VALUES = [13, 26, 51, 77, 102, 153, 179, 204, 230, 255]


def test_the_layer_search_takes_the_first_k_whose_clean_error_exceeds_xi_and_the_copies_start_one_deeper():
    model = BatchNormChain()
    ctx = chain_context(model, VALUES)
    detector = IbdPsc(scale=2.0, error_rate=0.15, num_models=2)
    extras = detector.apply(ctx).extras
    assert extras["clean_error_per_k"] == pytest.approx([0.0, 0.2])  # stops at k = 2, 0.2 > 0.15
    assert extras["start_layers"] == 2 and extras["error_rate_reached"] is True
    assert extras["amplified_layers"] == [3, 4]  # the official sorted_indices[:layer_index + 1]
    assert extras["n_batch_norms"] == 4
    # xi 0.25: k = 3 (0.3); the n copies amplify min(k + 1 + i, L) = all four
    deeper = IbdPsc(scale=2.0, error_rate=0.25)
    extras = deeper.apply(ctx).extras
    assert extras["clean_error_per_k"] == pytest.approx([0.0, 0.2, 0.3]) and extras["amplified_layers"] == [4] * 5
    # the official xi 0.6 is never exceeded for k < L = 4: every copy amplifies every batch norm
    official = IbdPsc(scale=2.0)
    extras = official.apply(ctx).extras
    assert extras["error_rate_reached"] is False and extras["start_layers"] == 4
    assert extras["clean_error_per_k"] == pytest.approx([0.0, 0.2, 0.3]) and extras["amplified_layers"] == [4] * 5


def test_psc_of_a_hand_made_model_is_the_hand_computed_mean_confidence():
    model = BatchNormChain()
    detector = IbdPsc(scale=2.0, error_rate=0.15, num_models=2)
    detector.apply(chain_context(model, VALUES))  # the copies amplify the last 3 and the last 4
    x = torch.tensor([0.2, 0.8]).view(2, 1, 1, 1).expand(2, 1, 2, 2)

    def sigmoid(v):
        return 1 / (1 + math.exp(-v))

    # x = 0.2 is predicted class 1 (0.2 < 0.5): h3 = 2 (4 * 0.2 - 0.5) = 0.6, h4 = 2 (8 * 0.2 - 0.5) = 2.2,
    # the confidence in class 1 is sigmoid(-h); x = 0.8 is class 0: h3 = 2 (3.2 - 0.5) = 5.4, h4 = 2 (6.4 - 0.5) = 11.8
    expected = [(sigmoid(-0.6) + sigmoid(-2.2)) / 2, (sigmoid(5.4) + sigmoid(11.8)) / 2]
    assert detector.score_inputs(model, x).tolist() == pytest.approx(expected, rel=1e-5)
    assert detector.threshold == 0.9


def test_the_model_given_to_the_detector_is_left_as_it_was():
    model = BatchNormChain()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    detector = IbdPsc(scale=2.0, error_rate=0.15)
    detector.apply(chain_context(model, VALUES))
    detector.score_inputs(model, torch.rand(3, 1, 2, 2))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    copy = amplify_last(model, 2, 3.0)
    assert [bn.weight.item() for bn in amplifiable_batch_norms(copy)] == [1.0, 1.0, 3.0, 3.0]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class DeepTiny(ImageClassifier):
    """Six conv / batch-norm / ReLU layers of 8 channels, pooled to 2x2, a hidden layer, a head."""
    name = "deep_tiny"

    def __init__(self, num_classes: int = 4, width: int = 8, depth: int = 6):
        super().__init__()
        layers, channels = [], 1
        for _ in range(depth):
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
            channels = width
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4 * width, 16), nn.ReLU())
        self.classifier = nn.Linear(16, num_classes)


def faint_quadrants(n: int, seed: int, num_classes: int = 4, contrast: float = 0.15) -> Split:
    """8x8 noise (0.3 +- 0.2) whose class k has quadrant k brighter by `contrast`: a task the toy
    learns to about 93%, with small margins, as a real classifier's."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % num_classes
    images = 0.3 + 0.2 * torch.randn(n, *SHAPE, generator=g)
    for k in range(num_classes):
        r, c = divmod(k, 2)
        images[labels == k, :, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4] += contrast
    return Split((images.clamp(0, 1) * 255).round().to(torch.uint8), labels)


@pytest.fixture(scope="module")
def backdoored():
    torch.manual_seed(0)
    attack = BadNets(num_classes=4, image_shape=SHAPE, patch_size=3, poison_rate=0.1, target=0)
    poisoned = attack.poison_dataset(faint_quadrants(800, seed=0), torch.Generator().manual_seed(0))
    model = Normalized(DeepTiny(), (0.3,), (0.3,))
    tiny_trainer(10).fit(model, poisoned.split, generator=torch.Generator().manual_seed(0))
    return model.eval(), attack, poisoned


def test_amplified_batch_norms_collapse_clean_predictions_and_leave_triggered_ones_at_the_target(backdoored):
    model, attack, poisoned = backdoored
    test = faint_quadrants(200, seed=5)
    attackable = test.labels != 0
    x = to_float(test.images[attackable])
    triggered = attack.apply_trigger(x)
    labels = test.labels[attackable]
    with torch.no_grad():
        assert (model(x).argmax(1) == labels).float().mean() > 0.85  # the clean task is learnt
        assert (model(triggered).argmax(1) == 0).float().mean() == 1.0  # and so is the backdoor
        amplified = amplify_last(model, 6, 2.0)  # all six batch norms, weight and bias x 2
        assert (amplified(x).argmax(1) == labels).float().mean() < 0.4  # clean predictions collapse ...
        assert (amplified(triggered).argmax(1) == 0).float().mean() == 1.0  # ... triggered ones stay at the target
    # the detector at scale 2, its layers chosen on 80 clean images (xi 0.3: the toy's k = 5 errs on 0.32)
    detector = IbdPsc(scale=2.0, error_rate=0.3)
    ctx = context(model, poisoned, faint_quadrants(80, seed=7))
    outcome = run_defense(detector, ctx, attack, test)
    assert outcome.extras["error_rate_reached"] and outcome.extras["start_layers"] == 5
    clean_psc, bad_psc = detector.score_inputs(model, x), detector.score_inputs(model, triggered)
    assert bad_psc.min() > 0.9 and clean_psc.mean() < 0.3, (bad_psc.min(), clean_psc.mean())
    is_bad = torch.cat([torch.zeros(len(clean_psc)), torch.ones(len(bad_psc))]).bool()
    assert auroc(torch.cat([clean_psc, bad_psc]), is_bad) > 0.9  # against the clean inputs of other classes
    # the runner's clean set holds the target class too, whose clean images the collapse sends nowhere else
    assert outcome.detection["auroc"] > 0.8 and outcome.detection["tpr"] == 1.0, outcome.detection
    assert outcome.defended["asr"] == 0.0
    assert outcome.cost["per_input_forward_images"] == 1 + 5  # the prediction, then the n copies


def test_bad_values_and_a_model_without_batch_norm_are_refused_in_one_line():
    for kwargs, fragment in ((dict(scale=1), "defense.scale=1 is invalid; use a number > 1"),
                             (dict(num_models=0), "defense.num_models=0 is invalid; use an integer >= 1"),
                             (dict(error_rate=1), "defense.error_rate=1 is out of range; use a number in [0, 1)"),
                             (dict(threshold=None), "defense.threshold=None is out of range; use a number in [0, 1]"),
                             (dict(clean_fraction=0), "defense.clean_fraction=0 is out of range")):
        with pytest.raises(ConfigError) as info:
            IbdPsc(**kwargs)
        assert fragment in str(info.value) and "\n" not in str(info.value)
    plain = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten())
    with pytest.raises(ConfigError, match="amplifies the weight and bias of BatchNorm2d layers; model 'Sequential' has none"):
        IbdPsc().check_model(plain)
    with pytest.raises(ConfigError, match="clean subset has none"):
        IbdPsc().apply(dataclasses.replace(chain_context(BatchNormChain(), VALUES), clean_subset=Split(
            torch.zeros(0, 1, 2, 2, dtype=torch.uint8), torch.zeros(0, dtype=torch.long))))


def test_a_model_without_batch_norm_is_refused_by_the_preflight_before_data_loads(compose_cfg, monkeypatch):
    from backdoorbench import validation
    from backdoorbench.models.mnist_cnn import MnistCNN

    def no_data(*args, **kwargs):
        raise AssertionError("the data was loaded")

    monkeypatch.setattr("backdoorbench.datasets.mnist5k.load_mnist5k", no_data)
    validation.validate_config(compose_cfg("defense=ibd_psc"))  # mnist_cnn has two BatchNorm2d
    plain = MnistCNN.__init__
    monkeypatch.setattr(MnistCNN, "__init__", lambda self, **kw: plain(self, **kw, norm_layer=lambda c: nn.Identity()))
    with pytest.raises(ConfigError, match=r"BatchNorm2d layers; model 'mnist_cnn' has none; choose one with batch norm"):
        validation.validate_config(compose_cfg("defense=ibd_psc"))


@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_ibd_psc_amplifies_the_batch_norms_of_every_model_of_the_zoo(name, shape, classes, kwargs):
    model = zoo_model(name, shape, classes, kwargs)
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (6, *shape), dtype=torch.uint8, generator=g)
    ctx = DefenseContext(model=model, poisoned_train=Split(data, torch.zeros(6, dtype=torch.long)),
                         poisoned_indices=torch.arange(0), clean_subset=Split(data[:4], torch.arange(4) % classes),
                         trainer=SimpleNamespace(device=torch.device("cpu"), eval_batch_size=4, prepare=lambda m: m),
                         num_classes=classes, generator=g)
    detector = IbdPsc()
    extras = detector.apply(ctx).extras
    assert extras["n_batch_norms"] == n_bn > 0 and 1 <= extras["start_layers"] <= n_bn
    scores = detector.score_inputs(model, data[:2].float() / 255)
    assert scores.shape == (2,) and ((0 <= scores) & (scores <= 1)).all()
