"""SAU (Wei, Zhang, Zha, Wu, NeurIPS 2023): the perturbations it crafts are shared adversarial examples
(both models moved into the same wrong class) far more often than ordinary adversarial examples are,
unlearning them takes the shared-adversarial rate and the backdoor down where clean fine-tuning does
not, and its two objectives are the official ones, computed by hand on a tiny batch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backdoorbench.datasets.base import Split
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.sau import SharedAdversarialUnlearning, project, shared_attack_objective, unlearning_loss
from backdoorbench.errors import ConfigError
from tests.tiny import ZOO, zoo_model

CLASSES, SIDE = 10, 8


def images(n: int, seed: int, poison: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy copies of one fixed prototype per class (uint8, 1 x 8 x 8); the first `poison` share carry a
    white 2x2 corner and the target label 0."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    prototypes = torch.rand(CLASSES, 1, SIDE, SIDE, generator=torch.Generator().manual_seed(99))
    x = (prototypes[labels] * 0.6 + 0.2 + 0.15 * torch.randn(n, 1, SIDE, SIDE, generator=g)).clamp(0, 1)
    k = int(n * poison)
    x[:k, :, -2:, -2:] = 1.0
    labels[:k] = 0
    return (x * 255).round().to(torch.uint8), labels


def small_cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(8 * 16, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def trained(seed: int, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    model, g = small_cnn(seed), torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), 1e-2)
    model.train()
    for _ in range(30):
        for idx in torch.randperm(len(y), generator=g).split(64):
            optimizer.zero_grad()
            F.cross_entropy(model(x[idx].float() / 255), y[idx]).backward()
            optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def models():
    """A backdoored CNN (10% poisoned, ASR ~99%) and a second CNN of another seed on the same data."""
    x, y = images(1000, 0, poison=0.1)
    return trained(1, x, y), trained(2, x, y)


@pytest.fixture(scope="module")
def test_set():
    x, y = images(400, 5)
    triggered = x.clone()
    triggered[:, :, -2:, -2:] = 255
    return x.float() / 255, y, triggered[y != 0].float() / 255


def rates(model: nn.Module, reference: nn.Module, x: torch.Tensor, pert: torch.Tensor) -> tuple[float, float]:
    """(share of x whose perturbed class moved off the model's clean class, share that are shared
    adversarial examples: both models moved, into the same class)."""
    with torch.no_grad():
        own, own_ref = model(x).argmax(1), reference(x).argmax(1)
        pred, pred_ref = model(x + pert).argmax(1), reference(x + pert).argmax(1)
    fooled = pred != own
    shared = fooled & (pred_ref != own_ref) & (pred == pred_ref)
    return float(fooled.float().mean()), float(shared.float().mean())


def ordinary_pgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, steps: int, step: float) -> torch.Tensor:
    """Plain L_inf PGD on one model's cross-entropy, from the same +eps start."""
    pert = torch.full_like(x, eps)
    for _ in range(steps):
        pert.requires_grad_(True)
        grad, = torch.autograd.grad(F.cross_entropy(model(x + pert), y), pert)
        pert = (pert.detach() + step * grad.sign()).clamp(-eps, eps)
    return pert


def test_the_crafted_examples_are_shared_far_more_often_than_ordinary_adversarial_examples(models, test_set):
    backdoored, other = models
    x, y, _ = test_set
    kwargs = dict(eps=0.1, pgd_steps=10, pgd_step_size=0.02)
    sau = SharedAdversarialUnlearning(**kwargs).shared_perturbation(other, backdoored, x, y, torch.Generator())
    fooled, shared = rates(other, backdoored, x, sau)
    assert shared * len(y) >= 20 and shared / fooled >= 0.95  # what fools the model fools h0 the same way
    fooled_o, shared_o = rates(other, backdoored, x, ordinary_pgd(other, x, y, 0.1, 10, 0.02))
    assert fooled_o > 0.8 and shared_o / fooled_o < 0.6  # ordinary ones mostly do not transfer into the same class
    # the JS term is what makes them shared: the same PGD without it (fool both, separately) shares less
    no_share = SharedAdversarialUnlearning(**kwargs, pgd_shared_weight=0.0).shared_perturbation(
        other, backdoored, x, y, torch.Generator())
    fooled_n, shared_n = rates(other, backdoored, x, no_share)
    assert shared_n / fooled_n < 0.8 < shared / fooled
    assert float(sau.abs().max()) <= 0.1 + 1e-6


def context(model: nn.Module, seed: int = 0) -> DefenseContext:
    x, y = images(200, 11)
    return DefenseContext(model=model, poisoned_train=Split(x, y), poisoned_indices=torch.arange(0),
                          clean_subset=Split(x, y), trainer=SimpleNamespace(device=torch.device("cpu")),
                          num_classes=CLASSES, generator=torch.Generator().manual_seed(seed))


def test_unlearning_the_shared_examples_lowers_the_shared_rate_and_the_backdoor(models, test_set):
    """From h = h0 (every adversarial example is shared) SAU at the official PGD and loss weights
    leaves few shared adversarial examples on held-out images and breaks the trigger; the same Adam
    steps on the clean loss alone (shared_weight 0) leave most of both. (lr 1e-3 for 16 steps, where
    the official 1e-4 takes ten times as many to show the same.)"""
    backdoored, _ = models
    x, y, triggered = test_set
    before = {k: v.clone() for k, v in backdoored.state_dict().items()}
    probe = SharedAdversarialUnlearning()  # the official PGD: L_inf 0.2, 5 steps of 0.2, from +eps

    def shared_rate(model):
        return rates(model, backdoored, x, probe.shared_perturbation(model, backdoored, x, y, torch.Generator()))[1]

    def asr(model):
        with torch.no_grad():
            return float((model(triggered).argmax(1) == 0).float().mean())

    assert shared_rate(backdoored) > 0.95 and asr(backdoored) > 0.95
    sau = SharedAdversarialUnlearning(epochs=8, batch_size=100, lr=1e-3).apply(context(backdoored))
    plain = SharedAdversarialUnlearning(epochs=8, batch_size=100, lr=1e-3, shared_weight=0.0).apply(context(backdoored))
    assert shared_rate(sau.model) < 0.2 < 0.4 < shared_rate(plain.model)
    assert asr(sau.model) < 0.3 < 0.8 < asr(plain.model)
    with torch.no_grad():
        assert float((sau.model(x).argmax(1) == y).float().mean()) > 0.8  # from 100%
    met = sau.extras["shared_rate_per_epoch"]  # the SAEs the unlearning met on the clean subset
    assert met[0] > 0.8 and met[-1] < 0.2 and len(met) == 8
    assert all(torch.equal(v, before[k]) for k, v in backdoored.state_dict().items())  # h0 is left as it was


def softmax(row: list[float]) -> list[float]:
    e = [math.exp(v) for v in row]
    return [v / sum(e) for v in e]


def js(a: list[float], b: list[float]) -> float:
    p, q = softmax(a), softmax(b)
    m = [(u + v) / 2 for u, v in zip(p, q)]
    return sum(u * math.log(u / w) + v * math.log(v / w) for u, v, w in zip(p, q, m)) / 2


def test_the_pgd_objective_is_the_official_one_by_hand():
    """0.01 L_adv + 1 L_share: CE to the true label of the samples not yet moved off each model's own
    clean class, averaged over the two models and the batch, negated; the JS of the two softmaxes of
    the samples not yet shared, over the batch."""
    logits = [[2.0, 1.0, 0.0], [0.0, 0.0, 3.0], [0.0, 2.0, 1.0]]
    logits_ref = [[0.0, 3.0, 0.0], [1.0, 0.0, 2.0], [0.0, 0.0, 1.0]]
    labels, own, own_ref = [0, 1, 2], [0, 1, 2], [0, 1, 0]
    # sample 0: fools h0 only; sample 1: both, into class 2 (shared); sample 2: both, into 1 and 2 (not shared)
    objective, shared = shared_attack_objective(torch.tensor(logits), torch.tensor(logits_ref), torch.tensor(labels),
                                                torch.tensor(own), torch.tensor(own_ref), 0.01, 1.0)
    assert shared.tolist() == [False, True, False]
    ce_0 = -math.log(softmax(logits[0])[0])  # only sample 0 has not fooled h; every sample fools h0
    loss_adv = -ce_0 / (2 * 3)
    loss_share = (js(logits[0], logits_ref[0]) + js(logits[2], logits_ref[2])) / 3
    assert float(objective) == pytest.approx(0.01 * loss_adv + loss_share, rel=1e-5)


def test_the_unlearning_loss_is_the_official_composition_by_hand():
    """lmd_1 CE(clean) + lmd_2 CE(perturbed) + lmd_3 L_sar, L_sar over the samples whose perturbed class
    under h0 is neither the label nor h0's clean class, with the official clamps."""
    logits = torch.tensor([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    adv = [[1.0, 2.0, 0.0], [0.0, 1.0, 3.0], [2.0, 0.0, 1.0], [-6.0, 6.0, 0.0]]
    adv_ref = torch.tensor([[5.0, 0.0, 0.0], [0.0, 0.0, 4.0], [3.0, 0.0, 0.0], [5.0, 0.0, 0.0]])
    ref_clean = torch.tensor([0, 2, 2, 1])
    labels = torch.tensor([0, 1, 2, 2])
    # sample 0: h0 keeps the label; 1: h0's class 2 is its clean class; 2 and 3: h0 fooled into class 0
    loss, parts = unlearning_loss(logits, torch.tensor(adv), adv_ref, ref_clean, labels, 1.0, 0.5, 2.0)
    assert parts["fools_reference"].tolist() == [False, False, True, True]

    def sar(p):  # the official per-sample term, from p = the model's probability of h0's class
        return -(math.log(1e-6 + min(1 - p, 0.999)) + math.log(1 + 1e-6 - max(p, 0.001))) / 2

    p2, p3 = softmax(adv[2])[0], softmax(adv[3])[0]
    assert p3 < 0.001  # the clamps bite: this sample adds -log(0.999 + 1e-6) / 2 - log(0.999 + 1e-6) / 2
    clean = sum(-math.log(softmax(row)[k]) for row, k in zip(logits.tolist(), labels.tolist())) / 4
    perturbed = sum(-math.log(softmax(row)[k]) for row, k in zip(adv, labels.tolist())) / 4
    shared = (sar(p2) + sar(p3)) / 4
    assert float(parts["shared"]) == pytest.approx(shared, rel=1e-5)
    assert float(loss) == pytest.approx(1.0 * clean + 0.5 * perturbed + 2.0 * shared, rel=1e-5)
    none, _ = unlearning_loss(logits, torch.tensor(adv), adv_ref, ref_clean, torch.tensor([0, 1, 0, 0]), 1.0, 0.0, 1.0)
    assert float(none) == pytest.approx(float(F.cross_entropy(logits, torch.tensor([0, 1, 0, 0]))))  # none fools h0


def test_the_official_eps_is_in_pixel_units():
    """BackdoorBench adds the perturbation to the unnormalised image and normalises again
    (`get_perturbed_image`): with CIFAR-10's mean and std that is our model on x + pert, [0, 1] pixels,
    the same logits and the same gradient for the signed step."""
    from backdoorbench.models.base import Normalized

    mean, std = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1), torch.tensor([0.247, 0.243, 0.261]).view(1, 3, 1, 1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(5))
    ours = Normalized(net, tuple(mean.flatten().tolist()), tuple(std.flatten().tolist()))
    x = torch.rand(2, 3, 8, 8)
    pert = project(0.3 * torch.randn(2, 3, 8, 8), 0.2, "linf").requires_grad_(True)
    official = net(((x - mean) / std * std + mean + pert - mean) / std)  # normalised input -> denorm + pert -> norm
    g_official, = torch.autograd.grad(official.sum(), pert)
    mine = ours(x + pert)
    g_mine, = torch.autograd.grad(mine.sum(), pert)
    assert torch.allclose(official, mine, atol=1e-5) and torch.equal(g_official.sign(), g_mine.sign())
    assert float(((x + pert.detach()) - x).abs().max()) <= 0.2 + 1e-6


def test_projection_and_start():
    g = torch.Generator().manual_seed(0)
    pert = torch.randn(3, 2, 4, 4, generator=g)
    assert float(project(pert, 0.2, "linf").abs().max()) == pytest.approx(0.2)
    assert torch.allclose(project(pert, 0.5, "l2").flatten(1).norm(dim=1), torch.full((3,), 0.5))
    assert torch.allclose(project(pert, 2.0, "l1").flatten(1).norm(p=1, dim=1), torch.full((3,), 2.0))
    small = 1e-3 * pert
    assert torch.equal(project(small, 0.5, "l2"), small)  # inside the ball: untouched
    x = torch.zeros(2, 1, 3, 3)
    assert torch.equal(SharedAdversarialUnlearning().initial_perturbation(x, g), torch.full_like(x, 0.2))
    assert torch.equal(SharedAdversarialUnlearning(pgd_init="min").initial_perturbation(x, g), torch.full_like(x, -0.2))


def test_identical_models_make_the_pgd_a_plain_signed_ascent_on_their_loss(models, test_set):
    """While h = h0 (the first step of SAU) every example that fools one fools the other the same way,
    the JS term is zero, and the perturbation is the signed PGD on the cross-entropy: the official step
    equal to eps leaves each pixel at -eps, 0 or +eps."""
    model = models[0]
    x, y, _ = test_set
    pert = SharedAdversarialUnlearning(pgd_steps=1).shared_perturbation(model, model, x, y, torch.Generator())
    start = torch.full_like(x, 0.2).requires_grad_(True)
    with torch.no_grad():
        unmoved = model(x + start).argmax(1) == model(x).argmax(1)  # L_adv's samples: not yet adversarial
    assert 0 < int(unmoved.sum()) < len(y)
    grad, = torch.autograd.grad(F.cross_entropy(model(x + start), y, reduction="sum"), start)
    assert torch.equal(pert[unmoved], (0.2 + 0.2 * grad.sign()).clamp(-0.2, 0.2)[unmoved])
    assert torch.equal(pert[~unmoved], start.detach()[~unmoved])  # already shared: no gradient moves them
    assert all(math.isclose(v, 0.0) or math.isclose(v, 0.2, rel_tol=1e-6) for v in torch.unique(pert).tolist())


@pytest.mark.parametrize("train_mode", [False, True])
def test_batch_norm_statistics_move_only_in_train_mode(models, train_mode):
    backdoored, _ = models
    result = SharedAdversarialUnlearning(epochs=1, batch_size=100, train_mode=train_mode).apply(context(backdoored))
    moved = not torch.equal(result.model[1].running_mean, backdoored[1].running_mean)
    assert moved == train_mode and not result.model.training


def test_defaults_are_the_official_config(compose_cfg):
    cfg = compose_cfg("defense=sau")
    d = cfg.defense
    assert (d.clean_fraction, d.batch_size, d.lr, d.eps, d.pgd_steps, d.pgd_step_size, d.pgd_init, d.norm) == \
        (0.05, 256, 1e-4, 0.2, 5, 0.2, "max", "linf")
    assert (d.clean_weight, d.adversarial_weight, d.shared_weight, d.pgd_adv_weight, d.pgd_shared_weight) == \
        (1.0, 0.0, 1.0, 0.01, 1.0)
    assert (d.outer_steps, d.train_mode, d.epochs) == (1, False, None)
    from hydra.utils import instantiate

    assert instantiate(cfg.defense).epochs == 100
    assert compose_cfg("defense=sau", "dataset=tiny_imagenet").defense.epochs == 20  # tiny.yaml's n_rounds
    assert compose_cfg("defense=sau", "dataset=cifar10").defense.epochs is None


@pytest.mark.parametrize(("make", "message"), [
    (lambda: SharedAdversarialUnlearning(eps=0), r"defense.eps=0 is invalid; use a number > 0"),
    (lambda: SharedAdversarialUnlearning(shared_weight=-1), r"defense.shared_weight=-1 is invalid; use a number >= 0"),
    (lambda: SharedAdversarialUnlearning(pgd_steps=0), r"defense.pgd_steps=0 is invalid; use an integer >= 1"),
    (lambda: SharedAdversarialUnlearning(norm="L_inf"), r"defense.norm='L_inf' is unknown; choose one of: linf, l2, l1"),
    (lambda: SharedAdversarialUnlearning(pgd_init="rand"), r"defense.pgd_init='rand' is unknown"),
    (lambda: SharedAdversarialUnlearning(budget="gpu"), r"defense.budget='gpu' is unknown for sau"),
    (lambda: SharedAdversarialUnlearning(train_mode="yes"), r"defense.train_mode='yes' is invalid"),
    (lambda: SharedAdversarialUnlearning(clean_fraction=0), r"defense.clean_fraction=0 is out of range"),
])
def test_bad_values_are_one_config_error(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


# The scale rehearsal: every model of the zoo, at 10, 43 and 200 classes and 28, 32 and 64 px: one epoch
# of SAU runs and leaves a model that still classifies, the victim untouched.


@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_one_epoch_runs_on_every_model_of_the_zoo(name, shape, classes, kwargs):
    model = zoo_model(name, shape, classes, kwargs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (8, *shape), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, classes, (8,), generator=g)
    ctx = DefenseContext(model=model, poisoned_train=Split(data, labels), poisoned_indices=torch.arange(0),
                         clean_subset=Split(data, labels), trainer=SimpleNamespace(device=torch.device("cpu")),
                         num_classes=classes, generator=g)
    result = SharedAdversarialUnlearning(epochs=1, batch_size=8, pgd_steps=2).apply(ctx)
    assert len(result.extras["shared_rate_per_epoch"]) == 1
    with torch.no_grad():
        assert result.model(data[:2].float() / 255).shape == (2, classes)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
