"""MCR (Zhao, Chen, Das, Ramamurthy, Lin, ICLR 2020): a Bezier curve from the attacked model (t = 0) to
a second end point (t = 1), its middle control point the only thing trained, on clean data; the model at
t is returned with its batch-norm statistics recomputed (the official `update_bn`)."""

from __future__ import annotations

import copy
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backdoorbench.datasets.base import Split
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.mcr import (CurveStep, ModeConnectivityRepair, ModeCurve, bezier_coefficients, lr_factor,
                                        polychain_coefficients, recompute_batch_norm)
from backdoorbench.errors import ConfigError
from backdoorbench.train import Trainer
from tests.tiny import one_thread  # noqa: F401  (autouse fixture)
from tests.tiny import ZOO, zoo_model

K = 4  # classes
SIDE = 8


class TinyNet(nn.Module):
    """conv - batch norm - relu - pool - linear, on 1 x 8 x 8 images."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(8 * (SIDE // 2) ** 2, K)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def tiny(seed: int) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy class prototypes (a quarter signal, three quarters uniform noise): clean accuracy ~0.9."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, K, (n,), generator=g)
    prototypes = torch.rand(K, 1, SIDE, SIDE, generator=torch.Generator().manual_seed(99))
    x = prototypes[y] * 0.25 + torch.rand(n, 1, SIDE, SIDE, generator=g) * 0.75
    return (x * 255).to(torch.uint8), y


def trigger(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[..., -2:, -2:] = 255
    return x


def trainer(**kw) -> Trainer:
    kw = {"epochs": 1, "batch_size": 32, "augment": False, "progress": False,
          "optimizer": partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=5e-4), **kw}
    return Trainer(**kw)


def context(model, clean: Split, run_trainer, classes: int = K, seed: int = 3) -> DefenseContext:
    return DefenseContext(model=model, poisoned_train=clean, poisoned_indices=torch.zeros(0, dtype=torch.long),
                          clean_subset=clean, trainer=run_trainer, num_classes=classes,
                          generator=torch.Generator().manual_seed(seed))


def test_the_coefficients_are_the_official_bezier_and_polychain():
    for t in (0.0, 0.1, 0.4, 1.0):
        tt = torch.tensor(t)
        assert torch.allclose(bezier_coefficients(tt, 3), torch.tensor([(1 - t) ** 2, 2 * t * (1 - t), t ** 2]))
        four = [math.comb(3, k) * t ** k * (1 - t) ** (3 - k) for k in range(4)]
        assert torch.allclose(bezier_coefficients(tt, 4), torch.tensor(four, dtype=torch.float32))
        assert bezier_coefficients(tt, 3).sum().item() == pytest.approx(1.0)
    assert torch.equal(polychain_coefficients(torch.tensor(0.25), 3), torch.tensor([0.5, 0.5, 0.0]))
    assert torch.equal(polychain_coefficients(torch.tensor(1.0), 3), torch.tensor([0.0, 0.0, 1.0]))
    # train.py's learning_rate_schedule at epoch / epochs
    assert [lr_factor(p) for p in (0.01, 0.5, 0.7, 0.9, 0.95, 1.0)] == pytest.approx([1, 1, 0.505, 0.01, 0.01, 0.01])


def test_the_ends_of_the_curve_are_the_given_models_exactly():
    """As the official test_curve.py: at t = 0 and t = 1 the curve's weights are the end points' and,
    with their buffers, so are its outputs; the middle point starts half-way (init_linear)."""
    start, end = tiny(0).eval(), tiny(1).eval()
    with torch.no_grad():
        end.features[1].running_mean.fill_(0.3)
    curve = ModeCurve(start, end)
    with torch.no_grad():  # move the middle point off the segment, as training does
        for p in curve.interior:
            p.add_(torch.randn_like(p))
    x = torch.rand(6, 1, SIDE, SIDE)
    for t, model in ((0.0, start), (1.0, end)):
        weights = curve.weights(t)
        for name, param in model.named_parameters():
            assert torch.equal(weights[name], param), name
        at = curve.model_at(t)
        at.load_state_dict({**at.state_dict(), **{n: b for n, b in model.named_buffers()}})
        assert torch.equal(at.eval()(x), model(x))
    fresh = ModeCurve(start, end)
    for i, name in enumerate(fresh.names):
        mid = 0.5 * (dict(start.named_parameters())[name] + dict(end.named_parameters())[name])
        assert torch.allclose(fresh.interior[i], mid)
    # the middle of a fresh curve is theta_0/4 + theta_mid/2 + theta_1/4 = the segment's midpoint
    assert all(torch.allclose(w, fresh.interior[i]) for i, w in enumerate(fresh.weights(0.5).values()))
    with pytest.raises(ValueError, match="same architecture"):
        ModeCurve(start, nn.Linear(2, 2))


def test_only_the_middle_point_is_trained_with_the_curve_gradient():
    """The optimizer holds the middle point alone; one plain SGD step at a drawn t moves it by
    lr * 2t(1-t) * dL/dtheta(t), the ends and the net's own weights untouched."""
    start, end = tiny(0), tiny(1)
    curve = ModeCurve(start, end)
    trained = [p for p in curve.parameters() if p.requires_grad]
    assert len(trained) == len(curve.interior) == len(list(start.parameters()))
    x, y = images(16, 5)
    xf = x.float() / 255
    step = CurveStep(torch.Generator().manual_seed(0), weight_decay=1e-2)
    loss, _, _ = step(curve.train(), xf, y)
    t = step.ts[0]
    loss.backward()
    # by hand: the loss at theta(t) as plain tensors
    theta = {n: w.detach().clone().requires_grad_(True) for n, w in curve.weights(t).items()}
    by_hand = F.cross_entropy(torch.func.functional_call(copy.deepcopy(curve.net), theta, (xf,)), y)
    by_hand = by_hand + 0.5e-2 * sum(w.pow(2).sum() for w in theta.values())
    grads = torch.autograd.grad(by_hand, list(theta.values()))
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-5)
    for p, g in zip(curve.interior, grads):
        assert torch.allclose(p.grad, 2 * t * (1 - t) * g, atol=1e-6)
    before = {n: b.clone() for n, b in curve.named_buffers() if n.startswith(("start_", "end_"))}
    net_before = [p.clone() for p in curve.net.parameters()]
    ModeConnectivityRepair(epochs=2, ft_epochs=1, batch_size=8).train_curve(curve, Split(x, y), context(start, Split(x, y), trainer()))
    assert all(torch.equal(b, dict(curve.named_buffers())[n]) for n, b in before.items())
    assert all(torch.equal(a, b) for a, b in zip(net_before, curve.net.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(curve.interior, ModeCurve(start, end).interior))


def test_batch_norm_is_recomputed_as_the_size_weighted_mean_of_the_clean_data():
    model = tiny(0)
    x, _ = images(40, 6)  # batches of 16, 16, 8: the official momentum b / (n + b) weights them by size
    assert recompute_batch_norm(model, x, batch_size=16, device=torch.device("cpu")) == 1
    h = model.features[0](x.float() / 255)
    bn = model.features[1]
    assert torch.allclose(bn.running_mean, h.mean((0, 2, 3)), atol=1e-5)
    per_batch = [h[i:i + 16].var((0, 2, 3), unbiased=True) * (min(16, 40 - i)) for i in (0, 16, 32)]
    assert torch.allclose(bn.running_var, sum(per_batch) / 40, atol=1e-5)
    assert bn.momentum == 0.1 and model.training  # momentum and mode put back
    assert recompute_batch_norm(nn.Linear(2, 2), x, batch_size=16, device=torch.device("cpu")) == 0


@pytest.fixture(scope="module")
def backdoored():
    """A tiny victim of a corner-patch backdoor to class 0 (10% poisoned), and its test data."""
    x, y = images(480, 1)
    x[:48], y[:48] = trigger(x[:48]), 0
    victim = tiny(0)
    trainer(epochs=12).fit(victim, Split(x, y), generator=torch.Generator().manual_seed(0))
    test_x, test_y = images(300, 2)
    return victim.eval(), test_x, test_y


def ca_asr(model, test_x, test_y):
    model.eval()
    with torch.no_grad():
        clean = model(test_x.float() / 255).argmax(1)
        keep = test_y != 0
        triggered = model(trigger(test_x[keep]).float() / 255).argmax(1)
    return (clean == test_y).float().mean().item(), (triggered == 0).float().mean().item()


def test_the_interior_of_the_trained_curve_loses_the_backdoor_and_keeps_clean_accuracy(backdoored):
    """The paper's claim on a tiny victim: in the interior of the trained path the ASR falls below
    both end points' (the attacked model and its fine-tuned copy) while clean accuracy stays; the
    untrained segment between the same ends (what MCR would be without its trained middle point)
    keeps much more of the backdoor at the same t."""
    victim, test_x, test_y = backdoored
    clean = Split(*images(100, 3))
    defense = ModeConnectivityRepair(t=0.7, epochs=40, ft_epochs=40, lr=0.1, batch_size=32)
    ctx = context(victim, clean, trainer())
    end = defense.fine_tuned_end(ctx)
    curve = ModeCurve(copy.deepcopy(victim), end)
    segment = copy.deepcopy(curve)
    defense.train_curve(curve, clean, ctx)

    def at(c, t):
        model = c.model_at(t)
        recompute_batch_norm(model, clean.images, batch_size=32, device=torch.device("cpu"))
        return ca_asr(model, test_x, test_y)

    ca0, asr0 = at(curve, 0.0)
    ca1, asr1 = at(curve, 1.0)
    ca_mid, asr_mid = at(curve, 0.7)
    _, asr_segment = at(segment, 0.7)
    assert asr0 > 0.9 and ca0 > 0.8  # the attacked end
    # measured: ASR 0.90 -> 0.49 (t = 0.7) <- 0.58; the segment at 0.7: 0.72
    assert asr_mid < min(asr0 - 0.3, asr1 - 0.05), (asr0, asr_mid, asr1)
    assert asr_mid < asr_segment - 0.15, (asr_mid, asr_segment)
    assert ca_mid > min(ca0, ca1) - 0.05, (ca0, ca_mid, ca1)


def test_the_defense_returns_the_point_at_t_and_leaves_the_victim(backdoored):
    victim, test_x, test_y = backdoored
    before = copy.deepcopy(victim.state_dict())
    clean = Split(*images(64, 3))
    result = ModeConnectivityRepair(t=0.0, epochs=1, ft_epochs=1, batch_size=32).apply(context(victim, clean, trainer()))
    # t = 0 is the attacked model's weights, its batch-norm statistics recomputed on the clean data
    for name, param in victim.named_parameters():
        assert torch.equal(dict(result.model.named_parameters())[name], param)
    assert all(torch.equal(v, victim.state_dict()[k]) for k, v in before.items())
    h = victim.features[0](clean.images.float() / 255)
    assert torch.allclose(result.model.features[1].running_mean, h.mean((0, 2, 3)), atol=1e-5)
    assert result.extras["t"] == 0.0 and not result.model.training


def test_the_config_is_the_official_and_backdoorbenchs(compose_cfg):
    cfg = compose_cfg("defense=mcr")
    d = cfg.defense
    assert (d.t, d.curve, d.bends, d.lr, d.momentum, d.weight_decay, d.batch_size) == (0.1, "bezier", 3, 0.01, 0.9, 1e-4, 128)
    assert (d.ft_lr, d.ft_cosine_period, d.clean_fraction, d.budget) == (0.01, 100, 0.05, "official")
    assert ModeConnectivityRepair().epochs == 100 and ModeConnectivityRepair().ft_epochs == 100
    cpu = ModeConnectivityRepair(budget="cpu")
    assert (cpu.epochs, cpu.ft_epochs) == (20, 20) and ModeConnectivityRepair.sensitivity == ("t",)
    assert cpu.describe()["t"] == 0.1


@pytest.mark.parametrize(("make", "message"), [
    (lambda: ModeConnectivityRepair(t=1.5), r"^defense.t=1.5 is out of range"),
    (lambda: ModeConnectivityRepair(curve="spline"), r"^defense.curve='spline' is unknown; choose one of: bezier, polychain$"),
    (lambda: ModeConnectivityRepair(bends=2), r"^defense.bends=2 is invalid; use an integer >= 3"),
    (lambda: ModeConnectivityRepair(lr=0), r"^defense.lr=0 is invalid; use a number > 0"),
    (lambda: ModeConnectivityRepair(budget="gpu"), r"^defense.budget='gpu' is unknown for mcr; choose one of: official, cpu"),
])
def test_bad_values_are_one_config_error(make, message):
    with pytest.raises(ConfigError, match=message) as info:
        make()
    assert "\n" not in str(info.value)


def test_an_empty_clean_subset_is_one_line():
    empty = Split(torch.zeros(0, 1, SIDE, SIDE, dtype=torch.uint8), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ConfigError, match="needs clean data"):
        ModeConnectivityRepair(epochs=1, ft_epochs=1).apply(context(tiny(0), empty, trainer()))


# The scale rehearsal: on every model of the zoo at 10, 43 and 200 classes and 28, 32 and 64 px with small
# widths, one fine-tuning and one curve epoch run and the model at t classifies.
@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_the_zoo(name, shape, classes, kwargs):
    model = zoo_model(name, shape, classes, kwargs)
    g = torch.Generator().manual_seed(0)
    clean = Split(torch.randint(0, 256, (8, *shape), generator=g, dtype=torch.uint8), torch.randint(0, classes, (8,), generator=g))
    result = ModeConnectivityRepair(epochs=1, ft_epochs=1, batch_size=8).apply(
        context(model, clean, trainer(batch_size=8, crop_padding=2), classes))
    with torch.no_grad():
        out = result.model(clean.images[:2].float() / 255)
    assert out.shape == (2, classes) and torch.isfinite(out).all()
    moved = [not torch.equal(a, b) for a, b in zip(result.model.parameters(), model.parameters())]
    assert any(moved)
