"""FT-SAM (Zhu, Wei, Shen, Fan, Wu, ICCV 2023): each fine-tuning step moves the weights by ASAM's
e_w = rho T_w^2 g / ||T_w g|| (T_w = |w| + eta; BackdoorBench's eta is 0), takes the gradient there,
and updates the restored weights with it; the second pass leaves batch-norm statistics alone."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backdoorbench.datasets.base import Split
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.ft_sam import FTSAM, SharpnessAwareStep, sharpness_perturbation, smoothed_cross_entropy
from backdoorbench.errors import ConfigError
from backdoorbench.train import Trainer
from tests.tiny import one_thread  # noqa: F401  (autouse fixture)
from tests.tiny import ZOO, zoo_model

K = 3  # classes


def linear_model() -> nn.Linear:
    torch.manual_seed(0)
    model = nn.Linear(4, K)
    with torch.no_grad():  # weights of very different sizes: ASAM's T_w = |w| + eta tells them apart
        model.weight.mul_(torch.tensor([0.1, 1.0, 3.0, 0.5]))
    return model.double()


def data(n: int = 8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, K, (n,), generator=g)


def soft_targets(y: torch.Tensor, smoothing: float) -> torch.Tensor:
    q = torch.full((len(y), K), smoothing / (K - 1), dtype=torch.float64)
    q[torch.arange(len(y)), y] = 1 - smoothing
    return q


def linear_grads(weight, bias, x, y, smoothing):
    """By hand: logits = x W^T + b, loss = mean KL(q || softmax) -> dL/dz = (softmax - q) / N."""
    dz = (torch.softmax(x @ weight.T + bias, dim=1) - soft_targets(y, smoothing)) / len(x)
    return dz.T @ x, dz.sum(0)


def asam_by_hand(weight, bias, gw, gb, rho, eta, adaptive=True):
    tw, tb = (weight.abs() + eta, bias.abs() + eta) if adaptive else (torch.ones_like(weight), torch.ones_like(bias))
    norm = torch.sqrt(((tw * gw) ** 2).sum() + ((tb * gb) ** 2).sum())
    return rho * tw ** 2 * gw / norm, rho * tb ** 2 * gb / norm


def backdoorbench_perturbation(params, rho):
    """A transcription of BackdoorBench's `SAM.perturb_weights` with `adaptive=True`
    (SCLBD/BackdoorBench, utils/defense_utils/sam/sam.py:41-53, `_grad_norm` :102-111), on `.grad`."""
    norm = torch.norm(torch.stack([(torch.abs(p.data) * p.grad).norm(p=2) for p in params if p.grad is not None]), p=2)
    scale = rho / (norm + 1e-12)
    return [p.grad * scale * torch.pow(p, 2) for p in params]


@pytest.mark.parametrize(("rho", "eta", "adaptive", "smoothing"),
                         [(2.0, 0.0, True, 0.1), (0.5, 0.01, True, 0.0), (0.05, 0.0, False, 0.1)])
def test_the_weights_of_the_second_pass_are_w_plus_the_asam_step_by_hand(rho, eta, adaptive, smoothing):
    model = linear_model()
    w, b = model.weight.detach().clone(), model.bias.detach().clone()
    x, y = data()
    step = SharpnessAwareStep(rho=rho, adaptive=adaptive, eta=eta, label_smoothing=smoothing)
    seen = []  # the weights each forward pass runs with
    model.register_forward_pre_hook(lambda m, args: seen.append((m.weight.detach().clone(), m.bias.detach().clone())))
    loss, logits, _ = step(model, x, y)
    gw, gb = linear_grads(w, b, x, y, smoothing)
    ew, eb = asam_by_hand(w, b, gw, gb, rho, eta, adaptive)
    assert len(seen) == 2 and torch.equal(seen[0][0], w)  # the first pass at w, the second at w + e_w
    assert torch.allclose(seen[1][0], w + ew, atol=1e-12) and torch.allclose(seen[1][1], b + eb, atol=1e-12)
    assert torch.allclose(step.last_perturbation[0], ew) and torch.allclose(step.last_perturbation[1], eb)
    # a parameter without a gradient is neither perturbed nor counted in the norm
    spare = torch.ones(2, dtype=torch.float64)
    e = sharpness_perturbation([w, spare, b], [gw, None, gb], rho, adaptive=adaptive, eta=eta)
    assert e[1] is None and torch.allclose(e[0], ew) and torch.allclose(e[2], eb)
    # the loss returned is the one at w + e_w; the accuracy is read from the pass at w
    q = soft_targets(y, smoothing)
    at = x @ (w + ew).T + (b + eb)
    assert loss.item() == pytest.approx((q * (q.clamp_min(1e-300).log() - torch.log_softmax(at, 1))).sum(1).mean().item())
    assert torch.allclose(logits, x @ w.T + b)
    if adaptive and eta == 0:  # BackdoorBench's own loop, on the same gradients, agrees
        model.weight.data, model.bias.data = w.clone(), b.clone()
        model.weight.grad, model.bias.grad = gw, gb
        official = backdoorbench_perturbation([model.weight, model.bias], rho)
        assert torch.allclose(official[0], ew) and torch.allclose(official[1], eb)
    # ASAM's step is not SAM's: large weights move more than their gradient's share
    plain, _ = asam_by_hand(w, b, gw, gb, rho, eta, adaptive=False)
    assert adaptive is False or not torch.allclose(ew, plain)


def test_the_optimizer_updates_the_restored_weights_with_the_gradient_at_the_perturbed_point():
    model = linear_model()
    w, b = model.weight.detach().clone(), model.bias.detach().clone()
    x, y = data()
    step = SharpnessAwareStep(rho=2.0, label_smoothing=0.1)
    optimizer = step.attach(partial(torch.optim.SGD, lr=0.5))(list(model.parameters()))
    loss, _, _ = step(model, x, y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    gw, gb = linear_grads(w, b, x, y, 0.1)
    ew, eb = asam_by_hand(w, b, gw, gb, 2.0, 0.0)
    sharp_w, sharp_b = linear_grads(w + ew, b + eb, x, y, 0.1)  # the gradient at w + e_w ...
    assert torch.allclose(model.weight, w - 0.5 * sharp_w, atol=1e-12)  # ... applied at w, not at w + e_w
    assert torch.allclose(model.bias, b - 0.5 * sharp_b, atol=1e-12)
    assert not torch.allclose(model.weight, w - 0.5 * gw)  # not plain SGD
    assert step.saved == []
    with pytest.raises(RuntimeError, match="still perturbed"):  # a step without the optimizer's restore
        step(model, x, y), step(model, x, y)


def test_the_second_pass_normalises_with_its_batch_but_leaves_the_running_statistics():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, K)).double().train()
    x, y = data(16)
    first = copy.deepcopy(model)
    with torch.no_grad():
        first(x)  # the running statistics one pass at w leaves
    step = SharpnessAwareStep(rho=2.0)
    step(model, x, y)
    bn = model[1]
    assert torch.allclose(bn.running_mean, first[1].running_mean) and torch.allclose(bn.running_var, first[1].running_var)
    assert bn.num_batches_tracked.item() == 1 and bn.track_running_stats


def test_smoothed_cross_entropy_is_backdoorbenchs():
    logits, y = torch.randn(6, 5, generator=torch.Generator().manual_seed(2)), torch.tensor([0, 1, 2, 3, 4, 0])
    q = torch.full((6, 5), 0.1 / 4)
    q[torch.arange(6), y] = 0.9
    official = F.kl_div(F.log_softmax(logits, dim=1), q, reduction="none").sum(-1).mean()  # util.py:22-29, .mean()
    assert smoothed_cross_entropy(logits, y, 0.1).item() == pytest.approx(official.item())
    assert smoothed_cross_entropy(logits, y, 0.0).item() == pytest.approx(F.cross_entropy(logits, y).item())


def split(n: int, shape=(1, 8, 8), classes: int = K, seed: int = 0) -> Split:
    g = torch.Generator().manual_seed(seed)
    return Split(torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8), torch.randint(0, classes, (n,), generator=g))


def context(model, clean: Split, trainer, classes: int = K) -> DefenseContext:
    return DefenseContext(model=model, poisoned_train=clean, poisoned_indices=torch.zeros(0, dtype=torch.long),
                          clean_subset=clean, trainer=trainer, num_classes=classes, generator=torch.Generator().manual_seed(3))


def test_the_defense_runs_the_sam_step_through_the_runs_trainer_and_leaves_the_victim():
    """One epoch of one batch through Trainer.fit equals one hand-made ASAM step from the victim."""
    torch.manual_seed(0)
    victim = nn.Sequential(nn.Flatten(), nn.Linear(64, K))
    clean = split(8)
    run_trainer = Trainer(epochs=5, batch_size=8, augment=False, progress=False,
                          optimizer=partial(torch.optim.SGD, lr=0.01, momentum=0.0, weight_decay=0.0))
    result = FTSAM(epochs=1, lr=0.1, rho=2.0, label_smoothing=0.1).apply(context(victim, clean, run_trainer))
    x, y = clean.images.float() / 255, clean.labels
    w, b = victim[1].weight.detach().double(), victim[1].bias.detach().double()
    xs = x.flatten(1).double()
    gw, gb = linear_grads(w, b, xs, y, 0.1)
    ew, eb = asam_by_hand(w, b, gw, gb, 2.0, 0.0)
    sharp_w, sharp_b = linear_grads(w + ew, b + eb, xs, y, 0.1)
    assert torch.allclose(result.model[1].weight.double(), w - 0.1 * sharp_w, atol=1e-5)
    assert torch.allclose(result.model[1].bias.double(), b - 0.1 * sharp_b, atol=1e-5)
    assert torch.equal(victim[1].weight, w.float())  # the attacked model is left as it was
    assert run_trainer.optimizer.func is torch.optim.SGD and run_trainer.epochs == 5  # the run's trainer untouched
    assert result.extras["final_lr"] == pytest.approx(0.1)


def test_the_schedule_is_fine_tunings_cosine_over_100_epochs():
    lrs = []
    trainer = Trainer(epochs=7, batch_size=8, progress=False)
    trainer.on_epoch = lambda row: lrs.append(row["lr"])
    FTSAM(epochs=3).apply(context(nn.Sequential(nn.Flatten(), nn.Linear(64, K)), split(16), trainer))
    assert lrs == pytest.approx([0.01 * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * e / 100)).item()) for e in range(3)])


def test_the_config_is_backdoorbenchs(compose_cfg):
    cfg = compose_cfg("defense=ft_sam")
    assert (cfg.defense.rho, cfg.defense.adaptive, cfg.defense.eta, cfg.defense.label_smoothing) == (2.0, True, 0.0, 0.1)
    assert (cfg.defense.lr, cfg.defense.cosine_period, cfg.defense.clean_fraction) == (0.01, 100, 0.05)
    defense = FTSAM(budget="cpu")
    assert defense.epochs == 10 and FTSAM().epochs == 100
    assert defense.describe()["rho"] == 2.0 and FTSAM.sensitivity == ("rho",)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: FTSAM(rho=0), r"^defense.rho=0 is invalid; use a number > 0"),
    (lambda: FTSAM(eta=-0.1), r"^defense.eta=-0.1 is invalid; use a number >= 0"),
    (lambda: FTSAM(label_smoothing=1.0), r"^defense.label_smoothing=1.0 is out of range; use a number in \[0, 1\)"),
    (lambda: FTSAM(adaptive="yes"), r"^defense.adaptive='yes' is invalid; use true"),
    (lambda: FTSAM(budget="gpu"), r"^defense.budget='gpu' is unknown for ft_sam; choose one of: official, cpu"),
    (lambda: FTSAM(clean_fraction=0), r"^defense.clean_fraction=0 is out of range"),
])
def test_bad_values_are_one_config_error(make, message):
    with pytest.raises(ConfigError, match=message) as info:
        make()
    assert "\n" not in str(info.value)


def test_an_empty_clean_subset_is_one_line():
    with pytest.raises(ConfigError, match="defense ft_sam needs clean data"):
        FTSAM().apply(context(nn.Linear(2, 2), split(0), Trainer(progress=False)))


# The scale rehearsal: every model of the zoo at 10, 43 and 200 classes and 28, 32 and 64 px, small
# widths: one FT-SAM epoch through the trainer moves the weights and leaves a model that classifies.


@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_the_zoo(name, shape, classes, kwargs):
    model = zoo_model(name, shape, classes, kwargs)
    clean = split(8, shape, classes)
    trainer = Trainer(epochs=1, batch_size=4, crop_padding=2, progress=False)
    result = FTSAM(epochs=1).apply(context(model, clean, trainer, classes))
    before = dict(model.named_parameters())
    moved = [n for n, p in result.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) > len(before) // 2
    with torch.no_grad():
        out = result.model.eval()(clean.images[:2].float() / 255)
    assert out.shape == (2, classes) and torch.isfinite(out).all()
