"""The angular-margin penalty (Xu, Li, Yang 2020) and L_inf PGD robust accuracy."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from backdoorbench.attacks.badnets import BadNets
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses.angular_margin import AngularMargin, SimplexHead, head_weight, simplex_gram, simplex_penalty
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.errors import ConfigError
from backdoorbench.metrics.robustness import pgd_accuracy, pgd_attack
from backdoorbench.models.base import ImageClassifier, Normalized
from backdoorbench.models.mnist_cnn import MnistCNN
from backdoorbench.train import Trainer

NUM_CLASSES = 4


class TinyNet(ImageClassifier):
    """A small classifier taking the zoo's constructor arguments (head, feature_act, norm_layer)."""

    name = "tiny"

    def __init__(self, in_channels=1, num_classes=NUM_CLASSES, image_size=8, norm_layer=nn.BatchNorm2d,
                 head=nn.Linear, feature_act=nn.ReLU):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 8, 3, padding=1), norm_layer(8), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
            nn.Flatten(), nn.Linear(32, 16), feature_act(),
        )
        self.classifier = head(16, num_classes)


def quadrant_data(n: int, seed: int) -> Split:
    """8x8 images whose class k has a bright quadrant k on dark noise: learnable in a few epochs."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % NUM_CLASSES
    images = torch.rand(n, 1, 8, 8, generator=g) * 0.3
    for k in range(NUM_CLASSES):
        r, c = divmod(k, 2)
        sel = labels == k
        images[sel, :, 4 * r : 4 * r + 4, 4 * c : 4 * c + 4] = 0.6 + 0.4 * torch.rand(int(sel.sum()), 1, 4, 4, generator=g)
    return Split((images * 255).round().to(torch.uint8), labels)


def tiny_trainer(epochs: int = 4, lr: float = 0.05) -> Trainer:
    return Trainer(epochs=epochs, batch_size=32, optimizer=partial(torch.optim.SGD, lr=lr, momentum=0.9),
                   augment=False, progress=False, device="cpu")


def regular_simplex(num_classes: int, dim: int, scale: float, seed: int = 0) -> torch.Tensor:
    """C rows of norm `scale`, pairwise cosine -1/(C-1), embedded in `dim` dims by a random rotation."""
    centered = torch.eye(num_classes) - torch.full((num_classes, num_classes), 1 / num_classes)
    rows = centered / centered.norm(dim=1, keepdim=True) * scale
    q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(seed)))
    return rows @ torch.cat([torch.eye(num_classes), torch.zeros(num_classes, dim - num_classes)], 1) @ q.T


# ---- the penalty ------------------------------------------------------------------------------

def test_gram_target_is_a_regular_simplex():
    g = simplex_gram(10, 1.0)
    assert torch.allclose(g.diagonal(), torch.ones(10))
    off = g[~torch.eye(10, dtype=torch.bool)]
    assert torch.allclose(off, torch.full_like(off, -1 / 9))
    assert torch.allclose(g.sum(1), torch.zeros(10), atol=1e-6)  # the vertices sum to zero


def test_penalty_is_zero_on_a_scaled_simplex_and_positive_elsewhere():
    w = regular_simplex(10, 32, scale=0.1)
    assert float(simplex_penalty(w, 0.1)) < 1e-6
    assert float(simplex_penalty(w * 2, 0.1)) > 1e-3  # right angles, wrong norm
    assert float(simplex_penalty(w, 0.2)) > 1e-3
    rotated_rows = w.clone()
    rotated_rows[0] = rotated_rows[1]  # two classes sharing a direction: no margin between them
    assert float(simplex_penalty(rotated_rows, 0.1)) > 1e-3
    assert float(simplex_penalty(torch.randn(10, 32) * 0.05, 0.1)) > 1e-3


def test_a_gradient_step_moves_w_toward_the_simplex():
    w = (torch.randn(10, 64, generator=torch.Generator().manual_seed(1)) * 0.05).requires_grad_(True)
    before = simplex_penalty(w, 0.1)
    before.backward()
    with torch.no_grad():
        stepped = w - 0.01 * w.grad
    assert float(simplex_penalty(stepped, 0.1)) < float(before.detach())
    # and many steps reach it: the cosines become -1/(C-1)
    w = w.detach().clone().requires_grad_(True)
    opt = torch.optim.Adam([w], lr=1e-3)
    for _ in range(200):
        opt.zero_grad()
        simplex_penalty(w, 0.1).backward()
        opt.step()
    unit = nn.functional.normalize(w.detach(), dim=1)
    off = (unit @ unit.T)[~torch.eye(10, dtype=torch.bool)]
    assert float(simplex_penalty(w.detach(), 0.1)) < 5e-4
    assert torch.allclose(off, torch.full_like(off, -1 / 9), atol=0.02)
    assert torch.allclose(w.detach().norm(dim=1), torch.full((10,), 0.1), atol=2e-3)


def test_penalty_gradient_is_finite_at_its_minimum():
    w = regular_simplex(5, 8, scale=0.1).requires_grad_(True)
    simplex_penalty(w, 0.1).backward()
    assert torch.isfinite(w.grad).all()


def test_head_needs_enough_feature_dims():
    with pytest.raises(ConfigError, match="num_classes - 1"):
        SimplexHead(3, 10)


@pytest.mark.parametrize("bad", [{"penalty_weight": 0}, {"scale": -0.1}, {"scale": float("nan")}, {"penalty_weight": True}])
def test_bad_parameters_are_config_errors(bad):
    with pytest.raises(ConfigError):
        AngularMargin(**bad)


def test_mnist_cnn_takes_the_head_and_the_penalty_reaches_its_weight():
    net = Normalized(MnistCNN(in_channels=1, num_classes=10, image_size=16, head=SimplexHead, feature_act=nn.Identity),
                     (0.13,), (0.31,))
    assert isinstance(net.classifier, SimplexHead) and net.classifier.linear.bias is None
    assert not any(isinstance(m, nn.ReLU) for m in net.net.features[-3:])  # no ReLU on the features
    step = AngularMargin().wrap_step(lambda model, x, y: (nn.functional.cross_entropy(model(x), y), model(x), y))
    x, y = torch.rand(8, 1, 16, 16), torch.arange(8) % 10
    loss, _, _ = step(net.train(), x, y)
    loss.backward()
    assert head_weight(net).grad is not None and head_weight(net).grad.abs().sum() > 0


# ---- the defense, trained end to end -----------------------------------------------------------

def make_context(default_train: Split, trainer: Trainer, model: nn.Module | None = None) -> DefenseContext:
    attack = BadNets(num_classes=NUM_CLASSES, image_shape=(1, 8, 8), patch_size=2)

    def build_model(**kwargs):
        return Normalized(TinyNet(**kwargs), (0.3,), (0.3,))

    def train_victim(net, wrap_step=None, train=None):
        attack.train_victim(trainer, net, default_train if train is None else train,
                            torch.Generator().manual_seed(5), wrap_step=wrap_step)

    return DefenseContext(
        model=model or build_model(), poisoned_train=default_train, poisoned_indices=torch.empty(0, dtype=torch.long),
        clean_subset=default_train.subset(torch.arange(8)), trainer=trainer, num_classes=NUM_CLASSES,
        generator=torch.Generator().manual_seed(3), build_model=build_model, train_victim=train_victim,
    )


def test_trained_model_has_bias_free_head_on_tanh_features_near_the_simplex():
    torch.manual_seed(0)
    train = quadrant_data(256, seed=0)
    defense = AngularMargin()
    # lr 0.01: with SGD + momentum the unsquared penalty at lambda = 100 diverges from lr ~0.05
    result = defense.apply(make_context(train, tiny_trainer(epochs=6, lr=0.01)))
    model = result.model.eval()
    head = model.classifier
    assert isinstance(head, SimplexHead) and head.linear.bias is None
    seen = {}
    head.linear.register_forward_hook(lambda mod, inp, out: seen.update(x=inp[0]))
    x = to_float(train.images[:64])
    with torch.no_grad():
        logits = model(x)
        expected = torch.tanh(head.norm(model.features(x)))
    assert torch.allclose(seen["x"], expected, atol=1e-6)  # the layer is fed tanh(BN(features))
    assert seen["x"].min() < -0.1 and seen["x"].abs().max() < 1  # tanh range, not ReLU's
    assert result.extras["penalty_final"] < 0.05 * result.extras["penalty_initial"]
    assert abs(result.extras["row_norm_mean"] - 0.1) < 0.02  # rows pulled to norm s
    assert (logits.argmax(1) == train.labels[:64]).float().mean() > 0.9  # and it still classifies


# ---- PGD robust accuracy -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained_plain():
    torch.manual_seed(0)
    train, test = quadrant_data(256, seed=0), quadrant_data(128, seed=1)
    model = Normalized(TinyNet(), (0.3,), (0.3,))
    tiny_trainer(epochs=5).fit(model, train, generator=torch.Generator().manual_seed(0))
    return model.eval(), to_float(test.images), test.labels


def test_pgd_at_zero_radius_is_clean_accuracy(trained_plain):
    model, x, y = trained_plain
    with torch.no_grad():
        clean = (model(x).argmax(1) == y).float().mean().item()
    assert clean > 0.9
    assert pgd_accuracy(model, x, y, eps=0.0, steps=5, generator=torch.Generator().manual_seed(0)) == pytest.approx(clean)


def test_pgd_accuracy_falls_with_the_radius_and_beats_random_noise(trained_plain):
    model, x, y = trained_plain
    # the toy classes differ by >= 0.3 in brightness, so it takes eps ~0.3 to flip them
    radii = (0.0, 0.1, 0.2, 0.3, 0.4)
    accs = [pgd_accuracy(model, x, y, eps=eps, steps=8, batch_size=128, generator=torch.Generator().manual_seed(0))
            for eps in radii]
    assert all(a >= b for a, b in zip(accs, accs[1:])), accs
    assert accs[-1] < 0.5 * accs[0], accs
    g = torch.Generator().manual_seed(0)
    noisy = (x + (torch.rand(x.shape, generator=g) * 2 - 1) * 0.3).clamp(0, 1)
    with torch.no_grad():
        noise_acc = (model(noisy).argmax(1) == y).float().mean().item()
    assert accs[3] < noise_acc - 0.3, (accs, noise_acc)  # the gradient finds what random noise doesn't


def test_pgd_stays_in_the_ball_and_the_pixel_range(trained_plain):
    model, x, y = trained_plain
    x_adv = pgd_attack(model, x[:32], y[:32], eps=0.1, steps=5, step_size=0.05, generator=torch.Generator().manual_seed(0))
    assert (x_adv - x[:32]).abs().max() <= 0.1 + 1e-6
    assert x_adv.min() >= 0 and x_adv.max() <= 1
    assert (x_adv - x[:32]).abs().max() > 0.09  # it used the budget


def test_pgd_rejects_bad_arguments(trained_plain):
    model, x, y = trained_plain
    with pytest.raises(ConfigError, match="eps"):
        pgd_accuracy(model, x, y, eps=8)
    with pytest.raises(ConfigError, match="steps"):
        pgd_accuracy(model, x, y, eps=0.1, steps=0)
    with pytest.raises(ConfigError, match="float"):
        pgd_accuracy(model, (x * 255).to(torch.uint8), y, eps=0.1)
