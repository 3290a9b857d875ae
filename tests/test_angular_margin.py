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


@pytest.mark.parametrize("bad", [{"penalty_weight": -1.0}, {"scale": -0.1}, {"scale": float("nan")}, {"penalty_weight": True}])
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


# ---- the authors' recipe ---------------------------------------------------------------------

def test_paper_recipe_is_the_authors_training_network_and_evaluation(compose_cfg):
    from hydra.utils import instantiate

    from backdoorbench.models.rbc_mnist import NormActLinear, RbcMnist

    cfg = compose_cfg("paper=angular_margin/mnist", "attack=none", "defense=angular_margin")
    # MTandHJ/rbc@4f3b8a9 train_model.py / utils/config.py / utils/loadopts.py
    assert cfg.dataset._target_.endswith("load_mnist") and cfg.model._target_.endswith("RbcMnist")
    t = cfg.trainer
    assert (t.epochs, t.batch_size, t.schedule, t.augment, t.precision) == (400, 128, "constant", False, "fp32")
    optimizer = instantiate(t.optimizer)([nn.Parameter(torch.zeros(1))])
    assert type(optimizer) is torch.optim.Adam
    group = optimizer.param_groups[0]
    assert group["lr"] == 0.01 and tuple(group["betas"]) == (0.9, 0.999) and group["weight_decay"] == 0.0
    assert (cfg.defense.penalty_weight, cfg.defense.scale) == (100.0, 0.1)
    pgd = cfg.eval.pgd
    assert pgd.enabled and pgd.steps == 100 and pgd.random_start and pgd.step_size is None
    assert pgd.rel_step_size == pytest.approx(1 / 30, rel=1e-6)
    assert {0.05, 0.1, 0.2, 0.3} <= set(pgd.eps) and max(pgd.eps) >= 0.5  # 0.5: the gradient-masking check
    assert list(pgd.losses) == ["ce", "cw"] and pgd.transfer_from == "attacked"
    # A (the victim): their `MNIST` with the ReLU head; B/C (the defense's build): their `MNISTrbc`
    plain = instantiate(cfg.model, in_channels=1, num_classes=10, image_size=28)
    rbc = instantiate(cfg.model, in_channels=1, num_classes=10, image_size=28, head=SimplexHead, feature_act=nn.Identity)
    for net in (plain, rbc):
        assert isinstance(net, RbcMnist)
        convs = [m for m in net.features if isinstance(m, nn.Conv2d)]
        assert [(c.out_channels, c.kernel_size) for c in convs] == [(32, (3, 3)), (32, (3, 3)), (64, (3, 3)), (64, (3, 3))]
        linears = [m for m in net.features if isinstance(m, nn.Linear)]
        assert [(m.in_features, m.out_features) for m in linears] == [(1024, 200), (200, 200)]
        assert net.features(torch.zeros(2, 1, 28, 28)).shape == (2, 200)  # d = 200
    assert isinstance(plain.classifier, NormActLinear) and isinstance(plain.classifier.act, nn.ReLU)
    assert plain.classifier.linear.bias is not None
    assert isinstance(rbc.classifier.act, nn.Tanh) and rbc.classifier.linear.bias is None
    assert isinstance(rbc.features[-1], nn.Identity)  # BN -> tanh happen in the head, right before W


def test_experiment_sweeps_the_three_models_and_lambda_over_three_seeds(compose_cfg):
    from hydra.core.global_hydra import GlobalHydra
    from hydra import compose, initialize_config_module

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="backdoorbench.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["experiment=angular_margin_xu2020"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert [float(v) for v in params["defense.penalty_weight"].split(",")] == [0, 1, 10, 100, 1000]
    assert params["seed"] == "0,1,2"
    assert cfg.attack._target_.endswith("NoAttack") and cfg.defense._target_.endswith("AngularMargin")
    assert cfg.model._target_.endswith("RbcMnist") and cfg.trainer.schedule == "constant"


def test_penalty_weight_zero_is_the_tanh_head_alone():
    defense = AngularMargin(penalty_weight=0.0)
    net = TinyNet(head=SimplexHead, feature_act=nn.Identity)
    x, y = torch.rand(4, 1, 8, 8), torch.arange(4)

    def step(model, x, y):
        logits = model(x)
        return nn.functional.cross_entropy(logits, y), logits, y

    assert torch.equal(defense.wrap_step(step)(net, x, y)[0], step(net, x, y)[0])
    assert float(AngularMargin(penalty_weight=100.0).wrap_step(step)(net, x, y)[0]) > float(step(net, x, y)[0])


def test_cw_margin_is_the_best_wrong_logit_minus_the_true_one():
    from backdoorbench.metrics.robustness import attack_loss, cw_margin

    logits = torch.tensor([[2.0, 1.0, 0.5], [0.0, 3.0, 1.0], [1.0, 1.0, -4.0]])
    labels = torch.tensor([0, 0, 2])
    assert cw_margin(logits, labels).tolist() == [-1.0, 3.0, 5.0]  # > 0 exactly where misclassified
    assert torch.equal(cw_margin(logits + 7.0, labels), cw_margin(logits, labels))  # logits only, no softmax
    assert float(attack_loss("cw", logits, labels)) == 7.0


class Saturated(nn.Module):
    """A linear classifier whose logits are scaled by 1e4: the softmax saturates, so the cross-entropy's
    gradient is exactly 0 in float32 (a masked gradient), while the logit margin's is not."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 2)
        with torch.no_grad():
            self.linear.weight.copy_(torch.stack([torch.ones(16), -torch.ones(16)]) / 16)
            self.linear.bias.zero_()

    def forward(self, x):
        return 1e4 * self.linear(x.flatten(1) - 0.5)


def test_cw_loss_attacks_where_the_cross_entropy_gradient_is_masked():
    from backdoorbench.metrics.robustness import masking_suspects, robustness_curve

    model = Saturated().eval()
    x = torch.full((8, 1, 4, 4), 0.7)  # class 0 by a margin of 0.2 per pixel
    y = torch.zeros(8, dtype=torch.long)
    rows, _ = robustness_curve(model, x, y, eps=[0.1, 0.5], losses=["ce", "cw"], steps=10, rel_step_size=1 / 5,
                               random_start=False)
    acc = {(r["loss"], r["eps"]): r["acc"] for r in rows}
    assert acc[("ce", 0.1)] == acc[("ce", 0.5)] == 1.0  # no gradient: the CE attack never moves
    assert acc[("cw", 0.1)] == 1.0 and acc[("cw", 0.5)] == 0.0  # 0.5 crosses the 0.2 margin, 0.1 cannot
    assert [(r["loss"], r["eps"]) for r in masking_suspects(rows)] == [("ce", 0.5)]


@pytest.mark.parametrize("loss", ["ce", "cw"])
def test_pgd_projects_and_clamps_at_each_eps(trained_plain, loss):
    model, x, y = trained_plain
    x = x[:32].clone()
    x[:, :, :2] = 0.0  # pixels at both ends of the range: the clamp must hold them in [0, 1]
    x[:, :, -2:] = 1.0
    for eps in (0.05, 0.1, 0.2, 0.3, 0.5):
        x_adv = pgd_attack(model, x, y[:32], eps=eps, steps=100, rel_step_size=1 / 30, loss=loss,
                           generator=torch.Generator().manual_seed(0))
        delta = (x_adv - x).abs()
        assert delta.max() <= eps + 1e-6, (eps, float(delta.max()))
        assert x_adv.min() >= 0 and x_adv.max() <= 1
        assert delta.max() >= eps - 1e-6  # 100 steps of eps/30 reach the ball's surface
        assert (x_adv[:, :, :2] <= eps + 1e-6).all() and (x_adv[:, :, -2:] >= 1 - eps - 1e-6).all()


def test_pgd_step_is_absolute_relative_or_madrys_rule():
    from backdoorbench.metrics.robustness import step_length

    assert step_length(0.3, 100, rel_step_size=1 / 30) == pytest.approx(0.01)
    assert step_length(0.3, 100, step_size=0.02) == 0.02
    assert step_length(0.3, 40) == pytest.approx(2.5 * 0.3 / 40)


@pytest.mark.parametrize("override,message", [
    ("eval.pgd.eps=[0.1,1.5]", "eval.pgd.eps=[0.1, 1.5] holds 1.5; every radius must be a number in [0, 1]"),
    ("eval.pgd.eps=[]", "eval.pgd.eps=[] is empty"),
    ("eval.pgd.losses=[ce,fgsm]", "eval.pgd.losses=['ce', 'fgsm'] must be a non-empty list of ce, cw"),
    ("eval.pgd.rel_step_size=0.1", "eval.pgd.step_size=0.01 and eval.pgd.rel_step_size=0.1 are both set"),
    ("eval.pgd.transfer_from=plain", "eval.pgd.transfer_from='plain' is not a model of the run; use null or attacked"),
])
def test_bad_pgd_settings_are_one_line_config_errors_before_any_data(compose_cfg, override, message, tmp_path):
    from backdoorbench.validation import validate_config

    extra = ["eval.pgd.step_size=0.01"] if "rel_step_size" in override else []
    cfg = compose_cfg(override, *extra, f"results_dir={tmp_path / 'out'}")
    with pytest.raises(ConfigError) as caught:
        validate_config(cfg)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_pgd_images_are_a_seeded_choice_not_the_first_sorted_ones(mnist5k):
    from omegaconf import OmegaConf

    from backdoorbench.pgd_memo import pgd_images

    _, labels = pgd_images(mnist5k, OmegaConf.create({"images": 50, "seed": 0}))
    assert len(labels) == 50 and len(labels.unique()) >= 8  # mnist5k's test split is sorted: the first 50 are all 0
    _, again = pgd_images(mnist5k, OmegaConf.create({"images": 50, "seed": 0}))
    assert torch.equal(labels, again)
    _, every = pgd_images(mnist5k, OmegaConf.create({"images": 5000, "seed": 3}))
    assert torch.equal(every, mnist5k.test.labels)  # all of them, in order, when there are no more


def test_the_record_holds_a_row_per_loss_eps_and_source(tiny_results):
    runs, _ = tiny_results
    for name, lam in (("angular_margin_0", 0.0), ("angular_margin_100", 100.0)):
        record, _ = runs[name]
        assert record.defense["penalty_weight"] == lam and record.model["name"] == "rbc_mnist"
        attacked, defended = record.metrics["attacked"], record.metrics["defended"]
        assert "pgd_acc" not in attacked  # a list of eps: no single number
        keys = {(r["loss"], r["eps"], r["source"]) for r in attacked["pgd"]}
        assert keys == {(loss, eps, "self") for loss in ("ce", "cw") for eps in (0.1, 0.5)}
        keys = {(r["loss"], r["eps"], r["source"]) for r in defended["pgd"]}
        assert keys == {(loss, eps, source) for loss in ("ce", "cw") for eps in (0.1, 0.5) for source in ("self", "attacked")}
        assert all(0 <= r["acc"] <= 1 for r in attacked["pgd"] + defended["pgd"])


def test_the_attacked_models_pgd_is_memoised_beside_its_cached_victim(mnist5k, tmp_path):
    """A sweep over defenses attacks one cached victim once: the second run reads the first's PGD
    (rows and adversarial images) instead of attacking again, and an unusable memo is recomputed."""
    from omegaconf import OmegaConf

    from backdoorbench.pgd_memo import attacked_pgd, pgd_memo_path

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10)).eval()
    pgd = OmegaConf.create({"eps": [0.1, 0.3], "steps": 2, "step_size": None, "rel_step_size": 0.5, "random_start": True,
                            "losses": ["ce", "cw"], "transfer_from": "attacked", "images": 12, "seed": 0})
    victim = {"cache": "miss", "path": str(tmp_path / "abc.pt")}
    first, examples, state = attacked_pgd(model, mnist5k, pgd, torch.device("cpu"), victim, keep_examples=True)
    path = pgd_memo_path(victim, pgd, torch.device("cpu"), True)
    assert state == "saved" and path.exists() and path.name.startswith("abc.pgd-")
    with torch.no_grad():  # the memo must not be a recomputation: spoil the model, the hit still gives the first numbers
        model[1].weight.zero_()
    again, kept, state = attacked_pgd(model, mnist5k, pgd, torch.device("cpu"), {**victim, "cache": "hit"}, keep_examples=True)
    assert state == "hit" and again == first and kept.keys() == examples.keys()
    assert all(torch.equal(kept[k], examples[k]) for k in examples)
    # another PGD setting has its own memo; without a victim cache nothing is kept
    other = OmegaConf.merge(pgd, {"steps": 3})
    assert pgd_memo_path(victim, other, torch.device("cpu"), True) != path
    assert attacked_pgd(model, mnist5k, pgd, torch.device("cpu"), {"cache": "off", "key": "abc"})[2] == "off"
    path.write_bytes(b"truncated")
    _, _, state = attacked_pgd(model, mnist5k, pgd, torch.device("cpu"), {**victim, "cache": "hit"}, keep_examples=True)
    assert state == "saved"


def test_a_sweep_over_lambda_attacks_the_shared_victim_once(tiny_results):
    runs, _ = tiny_results
    (first, _), (second, _) = runs["angular_margin_0"], runs["angular_margin_100"]
    assert first.victim["pgd_memo"] == "saved" and second.victim["cache"] == "hit" and second.victim["pgd_memo"] == "hit"
    assert first.metrics["attacked"]["pgd"] == second.metrics["attacked"]["pgd"]
    assert {r["source"] for r in second.metrics["defended"]["pgd"]} == {"self", "attacked"}  # the memo's images transfer
