"""NPD (Zhu, Wei, Zha, Wu, NeurIPS 2023): the polarizer sits where BackdoorBench's code puts it and starts
as the identity; only its own parameters learn while every original weight and statistic stays
bit-identical; its inner attack and its loss are the official code's (transcribed below from
SCLBD/BackdoorBench defense/npd.py), in [0, 1] pixels; and it removes a planted backdoor that training
the same layer on clean data alone leaves whole."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.npd import (NeuralPolarizerDefense, Polarized, insert_polarizer, insertion_point,
                                        own_and_target)
from backdoorbench.errors import ConfigError
from backdoorbench.models.base import Normalized
from backdoorbench.models.mnist_cnn import MnistCNN
from backdoorbench.train.trainer import Trainer
from tests.tiny import one_thread  # noqa: F401  (autouse)
from tests.tiny import ZOO, zoo_model


def build(name: str, shape: tuple[int, int, int], classes: int, **kwargs) -> Normalized:
    return zoo_model(name, shape, classes, kwargs)


def test_the_polarizer_goes_before_the_official_layer_and_starts_as_the_identity():
    model = build("preact_resnet18", (3, 32, 32), 10, width=8)
    # BackdoorBench's `target_layer_name: layer4.1.conv1` of PreAct-ResNet-18: our features.4 is its layer4
    name, conv = insertion_point(model)
    assert name == "net.features.4.1.conv1" and conv is model.net.features[4][1].conv1
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 3, 32, 32, generator=g)
    with torch.no_grad():
        before = model(x)
    _, polarizer = insert_polarizer(model)
    wrapped = model.net.features[4][1].conv1
    assert isinstance(wrapped, Polarized) and wrapped.layer is conv and wrapped.polarizer is polarizer
    assert polarizer.conv.kernel_size == (1, 1) and polarizer.conv.bias is None and polarizer.conv.in_channels == 64
    assert torch.equal(polarizer.conv.weight.flatten(1), torch.eye(64))
    features = torch.randn(2, 64, 4, 4, generator=g)
    with torch.no_grad():
        assert torch.allclose(polarizer.eval()(features), features, rtol=1e-5, atol=1e-6)  # 1 / sqrt(1 + 1e-5)
        assert torch.allclose(model(x), before, rtol=1e-4, atol=1e-5)  # the model's outputs are unchanged


@pytest.mark.parametrize(("name", "shape", "expected"), [
    ("mnist_cnn", (1, 28, 28), "net.features.4"),  # two convs: the second, the only one after the stem
    ("resnet18", (3, 64, 64), "net.features.6.1.conv1"),  # layer4.1.conv1 again
    ("vgg16_bn", (3, 32, 32), "net.features.37"),  # the 12th of 13 convolutions
])
def test_the_insertion_point_across_the_zoo(name, shape, expected):
    model = build(name, shape, 10, **({"width": 8} if "resnet" in name else {}))
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert insertion_point(model)[0] == expected
    if name == "vgg16_bn":
        assert convs.index(expected) == 11 and len(convs) == 13


def test_a_model_without_a_convolution_after_its_stem_is_refused_in_one_line(compose_cfg, monkeypatch):
    from backdoorbench import validation

    with pytest.raises(ConfigError, match=r"defense npd .* has no nn.Conv2d after its stem; choose a convolutional one"):
        NeuralPolarizerDefense().check_model(nn.Sequential(nn.Conv2d(3, 8, 4, 4), nn.Flatten(), nn.LazyLinear(2)))

    def no_data(*args, **kwargs):
        raise AssertionError("the data was loaded")

    monkeypatch.setattr("backdoorbench.datasets.mnist5k.load_mnist5k", no_data)
    validation.validate_config(compose_cfg("defense=npd"))  # mnist_cnn: the polarizer goes before its second conv
    with pytest.raises(ConfigError, match=r"model 'timm_vit_tiny_patch16_224' has no nn.Conv2d after its stem"):
        validation.validate_config(compose_cfg("defense=npd", "model=timm", "model.name=vit_tiny_patch16_224"))
    from backdoorbench.models.timm_model import TimmClassifier  # timm's ResNet-18: layer4.1.conv1 as ours

    assert insertion_point(TimmClassifier(name="resnet18", num_classes=10, image_size=32))[0] == "features.body.layer4.1.conv1"


def official_perturbation(net, images, target, mean, std, eps, steps, adv_lr):
    """A transcription of the official inner attack (defense/npd.py:376-414, L2, not `tiny`): `images`
    are normalised; the perturbation is added to the denormalised image, clipped to [0, 1], normalised."""
    def denormalize(z):
        return z * std + mean

    def normalize(z):
        return (z - mean) / std

    def perturbed(pert):
        return normalize((denormalize(images) + pert).clamp(0, 1))

    batch_pert = torch.zeros_like(images, requires_grad=True)
    for _ in range(steps):
        loss = F.cross_entropy(net(perturbed(batch_pert)), target, reduction="none")
        loss_regu = torch.mean(loss.clamp_(-80, 80))
        loss_regu.backward()
        batch_pert.data = batch_pert.data - adv_lr * torch.sign(batch_pert.grad.data)
        batch_pert.grad = None
        norm = torch.sum(batch_pert ** 2, dim=(1, 2, 3), keepdim=True) ** 0.5
        for i in range(batch_pert.shape[0]):
            if norm[i] > eps:
                batch_pert.data[i] = batch_pert.data[i] * eps / norm[i].item()
        with torch.no_grad():
            acc = (net(perturbed(batch_pert)).argmax(dim=1) == target).sum().item() / len(target)
        if acc > 0.6:
            break
    return perturbed(batch_pert.detach())


@pytest.mark.parametrize(("eps", "steps", "step_size", "stops_early"),
                         [(3.0, 2, 0.1, True), (0.2, 6, 0.02, False), (0.1, 5, 0.01, False)])
def test_the_inner_attack_is_the_official_one_in_pixel_units(eps, steps, step_size, stops_early):
    """The official eps and step act on the denormalised image: in our [0, 1] input space the same
    numbers, no conversion; the perturbation per image stays within eps there."""
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 6 * 6, 5))
    mean, std = torch.tensor([0.4, 0.5, 0.6]).view(1, 3, 1, 1), torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1)
    x = torch.rand(16, 3, 8, 8, generator=g)
    target = torch.randint(0, 5, (16,), generator=g)
    defense = NeuralPolarizerDefense(eps=eps, pgd_steps=steps, pgd_step_size=step_size)
    ours, reached = defense.targeted_perturbation(Normalized(net, (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)), x, target)

    def official(steps):
        return official_perturbation(net, (x - mean) / std, target, mean, std, eps, steps, step_size) * std + mean

    assert torch.allclose(ours, official(steps), atol=1e-5)
    assert ((ours - x).flatten(1).norm(dim=1) <= eps + 1e-4).all() and ours.min() >= 0 and ours.max() <= 1
    # the official early stop: more than 60% of the batch at its target after the first step ends the attack
    assert (reached > 0.6) == stops_early and torch.allclose(ours, official(1), atol=1e-5) == stops_early


def official_loss(logits_1, logits_adv, labels, ori_lab, target_lab, lmd1, lmd2, lmd3, lmd4):
    """A transcription of the official loss (defense/npd.py:422-442)."""
    loss_1 = F.cross_entropy(logits_1, labels)
    loss_2 = F.cross_entropy(logits_adv, ori_lab)
    adv_probs = F.softmax(logits_adv, dim=1)
    tmp2 = torch.argsort(adv_probs, dim=1)[:, -2:]
    new_y = torch.where(tmp2[:, -1] == labels, tmp2[:, -2], tmp2[:, -1])
    loss_3 = torch.mean(F.nll_loss(torch.log(1.0001 - adv_probs + 1e-12), new_y, reduction="none"))
    loss_4 = torch.mean(F.nll_loss(torch.log(1.0001 - adv_probs + 1e-12), target_lab, reduction="none"))
    return lmd1 * loss_1 + lmd2 * loss_2 + lmd3 * loss_3 + lmd4 * loss_4


def test_the_target_and_the_loss_are_the_official_ones():
    g = torch.Generator().manual_seed(2)
    logits, adv_logits = 3 * torch.randn(32, 7, generator=g), 3 * torch.randn(32, 7, generator=g)
    y = torch.randint(0, 7, (32,), generator=g)
    own, target = own_and_target(logits, y)
    masked = logits.clone()
    masked[torch.arange(32), y] = -10  # the official `logits_original[..., batch_true_y] = -10`
    assert torch.equal(own, logits.argmax(1)) and torch.equal(target, masked.argmax(1)) and (target != y).all()
    for weights in ((1.0, 0.4, 0.4, 0.4), (1.0, 0.5, 0.5, 0.5), (1.0, 1.0, 0.1, 0.1), (0.0, 0.0, 1.0, 0.0)):
        defense = NeuralPolarizerDefense(clean_weight=weights[0], adversarial_weight=weights[1],
                                         top_class_weight=weights[2], target_weight=weights[3])
        assert torch.allclose(defense.polarizer_loss(logits, adv_logits, y, own, target),
                              official_loss(logits, adv_logits, y, own, target, *weights), atol=1e-6)


# A planted backdoor on 16x16, 4-class data: class c is a bright square in quadrant c; 10% of the
# training images carry a white 3x3 corner and the label 0.
def images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.rand(n, 1, 16, 16, generator=g) * 80
    for i, c in enumerate(y.tolist()):
        row, col = divmod(c, 2)
        x[i, 0, 2 + 6 * row : 6 + 6 * row, 2 + 6 * col : 6 + 6 * col] += 150
    return x.clamp(0, 255).to(torch.uint8), y


def trigger(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[..., -3:, -3:] = 255
    return x


@pytest.fixture(scope="module")
def backdoored():
    x, y = images(800, 0)
    x[:80], y[:80] = trigger(x[:80]), 0
    torch.manual_seed(0)
    model = Normalized(MnistCNN(in_channels=1, num_classes=4, image_size=16, hidden=16), (0.5,), (0.25,))
    trainer = Trainer(epochs=4, batch_size=64, device="cpu", progress=False, augment=False, channels_last=False)
    trainer.fit(model, Split(x, y), generator=torch.Generator().manual_seed(0))
    clean_x, clean_y = images(200, 2)
    ctx = DefenseContext(model=model.eval(), poisoned_train=Split(x, y), poisoned_indices=torch.arange(80),
                         clean_subset=Split(clean_x, clean_y), num_classes=4, generator=torch.Generator().manual_seed(0),
                         trainer=Trainer(epochs=1, device="cpu", progress=False, channels_last=False))
    return ctx, images(400, 1)


@torch.no_grad()
def ca_asr(model: nn.Module, test: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    x, y = test
    model.eval()
    ca = float((model(to_float(x)).argmax(1) == y).float().mean())
    asr = float((model(to_float(trigger(x[y != 0]))).argmax(1) == 0).float().mean())
    return ca, asr


def test_npd_trains_only_the_polarizer_and_removes_the_planted_backdoor(backdoored):
    ctx, test = backdoored
    assert ca_asr(ctx.model, test) == (1.0, 1.0)
    victim = {k: v.clone() for k, v in ctx.model.state_dict().items()}
    result = NeuralPolarizerDefense(epochs=6, batch_size=64).apply(ctx)
    model = result.model
    assert result.extras["insertion_layer"] == "net.features.4" and result.extras["polarizer_channels"] == 32
    ca, asr = ca_asr(model, test)
    assert ca >= 0.95 and asr <= 0.1, (ca, asr)
    # every original weight and batch-norm statistic is bit-identical; only the polarizer's moved
    after = model.state_dict()
    polarizer = {k for k in after if ".polarizer." in k}
    kept = {k.replace("net.features.4.layer.", "net.features.4."): v for k, v in after.items() if k not in polarizer}
    assert kept.keys() == victim.keys() and all(torch.equal(kept[k], victim[k]) for k in victim)
    assert all(torch.equal(v, victim[k]) for k, v in ctx.model.state_dict().items())  # the victim is untouched
    assert not torch.equal(model.net.features[4].polarizer.conv.weight.flatten(1), torch.eye(32))
    assert not torch.equal(after["net.features.4.polarizer.norm.running_var"], torch.ones(32))  # the warm-up's
    assert all(p.requires_grad for p in model.parameters()) and not model.training
    # the same layer trained on the clean images alone (no adversarial term) keeps the backdoor
    control = NeuralPolarizerDefense(epochs=6, batch_size=64, adversarial_weight=0.0, top_class_weight=0.0,
                                     target_weight=0.0).apply(ctx).model
    assert ca_asr(control, test)[1] >= 0.9


@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_npd_runs_on_the_zoo(name, shape, classes, kwargs):
    model = build(name, shape, classes, **kwargs)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (8, *shape), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, classes, (8,), generator=g)
    ctx = DefenseContext(model=model, poisoned_train=Split(data, labels), poisoned_indices=torch.arange(0),
                         clean_subset=Split(data, labels), num_classes=classes, generator=g,
                         trainer=Trainer(epochs=1, device="cpu", progress=False, channels_last=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = NeuralPolarizerDefense(epochs=1, warmup_epochs=1, batch_size=4).apply(ctx)
    with torch.no_grad():
        assert result.model(data[:2].float() / 255).shape == (2, classes)
    assert len(result.extras["loss_per_epoch"]) == 1 and result.extras["warmup_final_loss"] is not None
    assert sum(isinstance(m, Polarized) for m in result.model.modules()) == 1
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_config_is_the_official_cifar10_one(compose_cfg):
    cfg = compose_cfg("defense=npd").defense
    assert (cfg.epochs, cfg.warmup_epochs, cfg.lr, cfg.batch_size, cfg.clean_fraction) == (50, 5, 0.01, 128, 0.05)
    assert (cfg.eps, cfg.pgd_steps, cfg.pgd_step_size) == (3.0, 2, 0.1)
    assert (cfg.clean_weight, cfg.adversarial_weight, cfg.top_class_weight, cfg.target_weight) == (1.0, 0.4, 0.4, 0.4)
    assert NeuralPolarizerDefense.sensitivity == ("eps",) and NeuralPolarizerDefense.stage == "post_train"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"eps": 0}, r"defense.eps=0 is invalid; use a number > 0 \(an L2 radius in \[0, 1\] pixel units\)"),
    ({"batch_size": 1}, r"defense.batch_size=1 is invalid; use an integer >= 2"),
    ({"pgd_steps": 0}, r"defense.pgd_steps=0 is invalid; use an integer >= 1"),
    ({"target_weight": -0.1}, r"defense.target_weight=-0.1 is invalid; use a number >= 0"),
    ({"warmup_epochs": -1}, r"defense.warmup_epochs=-1 is invalid; use an integer >= 0"),
    ({"clean_fraction": 0}, r"defense.clean_fraction=0 is out of range"),
])
def test_bad_values_are_one_config_error(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        NeuralPolarizerDefense(**kwargs)


def test_an_empty_clean_subset_is_one_line(backdoored):
    ctx, _ = backdoored
    empty = SimpleNamespace(**{**vars(ctx), "clean_subset": ctx.clean_subset.subset(torch.arange(0))})
    with pytest.raises(ConfigError, match="defense npd needs clean data but the clean subset is empty"):
        NeuralPolarizerDefense().apply(empty)
