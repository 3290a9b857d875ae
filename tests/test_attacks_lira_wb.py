"""LIRA and WB: bounded learned triggers, the two training stages, all2all targets, the sliced
Wasserstein regularizer, persistence and determinism. Tiny data and nets, CPU, a few steps."""

from __future__ import annotations

import io
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf

from backdoorbench.attacks.lira import LIRA
from backdoorbench.attacks.trigger_nets import (
    ColourAutoencoder,
    MnistAutoencoder,
    UNet,
    build_trigger_generator,
)
import backdoorbench.attacks.wb as wb_module
from backdoorbench.attacks.wb import WB, sliced_wasserstein, wasserstein_1d
from backdoorbench.datasets.base import Split
from backdoorbench.datasets.spec import dataset_spec
from backdoorbench.errors import ConfigError, DataError
from backdoorbench.models.base import Normalized
from backdoorbench.models.mnist_cnn import MnistCNN
from backdoorbench.train import Trainer
from tests.tiny import COMMON, SHAPE, make_model, one_thread  # noqa: F401  (one_thread: autouse fixture)

CONF = Path(__file__).resolve().parents[1] / "backdoorbench" / "conf" / "attack"
SMALL = dict(generator_width=2, stage1_epochs=1, generator_lr=1e-2, eps=0.1, test_eps=0.05, lookahead=False)
ATTACKS = {"lira": LIRA, "wb": WB}




def make_split(n: int = 32, seed: int = 0) -> Split:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, *SHAPE), generator=g, dtype=torch.uint8)
    return Split(images, torch.arange(n) % 4)


def make_trainer(epochs: int = 1, **optimizer) -> Trainer:
    return Trainer(epochs=epochs, batch_size=16,
                   optimizer=partial(torch.optim.SGD, **{"lr": 0.05, "momentum": 0.9, **optimizer}),
                   device="cpu", progress=False)


def make_attack(kind: str, **overrides):
    return ATTACKS[kind](**{**COMMON, **SMALL, **overrides})


def batch(seed: int = 1, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, *SHAPE, generator=g), torch.arange(n) % 4


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----- trigger generators ---------------------------------------------------------------------


def test_generators_keep_shape_range_and_depend_on_the_input():
    for net, shape in ((MnistAutoencoder(1, 4), (3, 1, 28, 28)), (MnistAutoencoder(1, 2), (3, 1, 16, 16)),
                       (UNet(3, 4), (3, 3, 32, 32)), (UNet(3, 2), (3, 3, 28, 28)),
                       (ColourAutoencoder(3, 4), (3, 3, 32, 32)), (ColourAutoencoder(3, 2), (3, 3, 28, 28))):
        x = torch.rand(*shape, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            for _ in range(30):  # batch-norm statistics as after a few training steps; then eval mode
                net.train()(torch.rand(*shape))
            out = net.eval()(x)
        assert out.shape == x.shape and torch.isfinite(out).all() and out.abs().max() <= 1
        assert (out[0] - out[1]).abs().max() > 1e-4  # input-specific, not one fixed pattern


def conv_layout(net: torch.nn.Module, kind: type) -> list[tuple[int, int, tuple[int, int]]]:
    """(in, out, stride) of each layer of type `kind`, in order."""
    return [(m.in_channels, m.out_channels, m.stride) for m in net.modules() if type(m) is kind]


@pytest.mark.parametrize("kind", ["auto", "autoencoder"])
@pytest.mark.parametrize("side", [32, 64])
def test_colour_autoencoder_is_the_official_stride_two_16_32_64_128(kind, side):
    # khoadoan106/backdoor_attacks python/attack_models/autoencoders.py `Autoencoder`, BackdoorBench's
    # attack/lira.py `Autoencoder(channels)`: four stride-2 4x4 convs down, four transposed back.
    net = build_trigger_generator(kind, (3, side, side))
    assert conv_layout(net, torch.nn.Conv2d) == [(3, 16, (2, 2)), (16, 32, (2, 2)), (32, 64, (2, 2)), (64, 128, (2, 2))]
    assert conv_layout(net, torch.nn.ConvTranspose2d) == [(128, 64, (2, 2)), (64, 32, (2, 2)), (32, 16, (2, 2)),
                                                          (16, 3, (2, 2))]
    assert all(m.kernel_size == (4, 4) for m in net.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)))
    assert sum(p.numel() for p in net.parameters()) == 346_659  # the official net's count
    with torch.no_grad():
        assert net.eval()(torch.rand(2, 3, side, side)).shape == (2, 3, side, side)


def test_generator_choice_follows_channels_and_rejects_bad_names():
    assert isinstance(build_trigger_generator("auto", (1, 28, 28)), MnistAutoencoder)
    assert isinstance(build_trigger_generator("mnist_autoencoder", (3, 28, 28), width=4), MnistAutoencoder)
    assert isinstance(build_trigger_generator("autoencoder", (1, 28, 28), width=4), ColourAutoencoder)
    assert isinstance(build_trigger_generator("unet", (3, 32, 32), width=4), UNet)
    with pytest.raises(ConfigError, match="attack.generator='vae'"):
        build_trigger_generator("vae", (1, 28, 28))
    with pytest.raises(ConfigError, match="generator_width"):
        build_trigger_generator("unet", (3, 32, 32), width=0)


@pytest.mark.parametrize("field,value", [("eps", 0.0), ("eps", 1.5), ("test_eps", -0.1), ("alpha", 1.0),
                                         ("stage1_epochs", 0), ("generator_lr", 0.0), ("lookahead", "yes"),
                                         ("stage1_classifier", "robust"), ("stage1_lr", 0.0),
                                         ("stage1_momentum", 1.0)])
def test_bad_parameters_raise_one_line_config_errors(field, value):
    with pytest.raises(ConfigError, match=f"attack.{field}=") as info:
        make_attack("lira", **{field: value})
    assert "\n" not in str(info.value)


def test_wb_rejects_unknown_reference_and_negative_beta():
    with pytest.raises(ConfigError, match="latent_reference"):
        make_attack("wb", latent_reference="all")
    with pytest.raises(ConfigError, match="attack.beta="):
        make_attack("wb", beta=-1.0)
    with pytest.raises(ConfigError, match="attack.wasserstein_order="):
        make_attack("wb", wasserstein_order=3)
    with pytest.raises(ConfigError, match="attack.reference_bank=-1") as info:
        make_attack("wb", reference_bank=-1)
    assert "\n" not in str(info.value)


# ----- the trigger bound ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ATTACKS)
def test_trigger_is_bounded_by_eps_before_and_after_training(kind):
    attack = make_attack(kind)
    x = torch.rand(8, *SHAPE, generator=torch.Generator().manual_seed(3))
    for trained in (False, True):
        delta = attack.apply_trigger(x) - x
        assert delta.abs().max() <= attack.test_eps + 1e-6
        if trained:
            assert delta.abs().max() > 0.1 * attack.test_eps  # the trigger is really there
            assert (delta[0] - delta[1]).abs().max() > 1e-5  # and differs between inputs
        assert attack.apply_trigger(x).min() >= 0 and attack.apply_trigger(x).max() <= 1
        # stage I's training-time trigger obeys the (larger) stage-I eps
        trig = attack._triggered(x, attack.eps)
        assert (trig - x).abs().max() <= attack.eps + 1e-6
        attack.begin_stage1(make_trainer())
        model = make_model()
        xb, yb = batch()
        for _ in range(5):
            attack.stage1_step(model, xb, yb)


# ----- the two stages -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ATTACKS)
def test_stage_one_trains_both_and_stage_two_freezes_the_generator(kind):
    attack, model, trainer, split = make_attack(kind), make_model(), make_trainer(), make_split()
    gen0, cls0 = state(attack.trigger_net), state(model)
    attack.begin_stage1(trainer)
    trainer.fit(model, split, generator=torch.Generator().manual_seed(0), step=attack.stage1_step)
    gen1, cls1 = state(attack.trigger_net), state(model)
    assert not same(gen0, gen1) and not same(cls0, cls1)
    attack.freeze()
    trainer.fit(model, split, generator=torch.Generator().manual_seed(1), step=attack.stage2_step)
    assert same(gen1, state(attack.trigger_net))  # weights and batch-norm statistics untouched
    assert not same(cls1, state(model))


def test_train_victim_runs_stage_one_once_then_only_injects():
    attack, trainer, split = make_attack("lira", lookahead=True), make_trainer(), make_split()
    gen0 = state(attack.trigger_net)
    calls = []

    def spy(step):
        def wrapped(model, x, y):
            calls.append(step.__name__)
            return step(model, x, y)
        return wrapped

    attack.train_victim(trainer, make_model(), split, torch.Generator().manual_seed(0), wrap_step=spy)
    assert attack.trained and not same(gen0, state(attack.trigger_net))
    assert calls == ["stage1_step"] * 2 + ["stage2_step"] * 2  # the defense's wrapper sees every step
    learned = state(attack.trigger_net)
    attack.train_victim(trainer, make_model(1), split, torch.Generator().manual_seed(0))
    assert same(learned, state(attack.trigger_net))


def test_stage_one_trains_the_classifier_with_its_own_plain_sgd_at_a_constant_lr(tmp_path):
    # Official stage I: optim.SGD(clsmodel.parameters(), lr=0.01, momentum=0.9), created once, no
    # scheduler, no weight decay; stage II keeps the trainer's recipe (here lr 0.05, wd 5e-4, cosine).
    attack, model, split = make_attack("lira", stage1_epochs=2), make_model(), make_split()
    trainer = make_trainer(epochs=2, weight_decay=5e-4)
    rows = []
    trainer.on_epoch = rows.append
    attack.train_victim(trainer, model, split, torch.Generator().manual_seed(0), checkpoint=tmp_path / "victim.pt")
    assert [(r["stage"], r["lr"]) for r in rows] == [("lira stage I", 0.01), ("lira stage I", 0.01),
                                                     ("lira stage II", 0.05), ("lira stage II", 0.025)]
    # What a resumed stage I restores: SGD's state after its last epoch, momentum buffers included.
    stage1 = torch.load(tmp_path / "victim.stage1.pt", weights_only=True)["optimizer"]
    [group] = stage1["param_groups"]
    assert (group["lr"], group["momentum"], group["weight_decay"], group["nesterov"]) == (0.01, 0.9, 0.0, False)
    assert stage1["state"] and all("momentum_buffer" in v for v in stage1["state"].values())
    [group] = torch.load(tmp_path / "victim.pt", weights_only=True)["optimizer"]["param_groups"]
    assert group["weight_decay"] == 5e-4
    assert attack._virtual_lr == 0.01  # the look-ahead's virtual step is stage I's SGD step too


def test_lookahead_changes_the_generator_step():
    x, y = batch()
    grads = {}
    for lookahead in (False, True):
        attack, model = make_attack("lira", lookahead=lookahead), make_model()
        attack.begin_stage1(make_trainer())
        xp, yp = attack._poisoned_part(x, y)
        loss = attack.generator_loss(model, x, y, xp, yp)
        grads[lookahead] = torch.autograd.grad(loss, list(attack.trigger_net.parameters()))
    assert all(torch.isfinite(g).all() for g in grads[True])
    assert any(not torch.allclose(a, b) for a, b in zip(grads[False], grads[True]))


@pytest.mark.parametrize("kind,lookahead", [("lira", True), ("lira", False), ("wb", False)])
def test_generator_update_leaves_the_classifier_untouched(kind, lookahead):
    attack, model = make_attack(kind, lookahead=lookahead), make_model()
    attack.begin_stage1(make_trainer())
    before, gen_before = state(model), state(attack.trigger_net)
    attack._update_generator(model, *batch())
    assert same(before, state(model))  # weights and batch-norm statistics
    assert all(p.grad is None for p in model.parameters())
    assert not same(gen_before, state(attack.trigger_net))


@pytest.mark.parametrize("kind", ATTACKS)
def test_all2all_poisoned_term_targets_the_next_class(kind):
    extra = {"beta_classifier": 0.0} if kind == "wb" else {}  # the plain combined loss, for comparison
    attack, model = make_attack(kind, target_mode="all2all", poison_rate=0.5, **extra), make_model()
    attack.freeze()
    model.eval()  # no dropout, so the loss can be recomputed exactly
    x, y = batch()
    loss, logits, scored = attack.stage2_step(model, x, y)
    xp, yp = x[:8], (y[:8] + 1) % 4
    assert torch.equal(scored, torch.cat([y, yp]))
    with torch.no_grad():
        expected = attack.alpha * F.cross_entropy(model(x), y) + (1 - attack.alpha) * F.cross_entropy(
            model(attack.apply_trigger(xp)), yp)
    assert torch.allclose(loss, expected, atol=1e-6)


def test_clean_and_triggered_images_share_one_batch_norm_batch():
    attack = make_attack("lira")
    torch.manual_seed(0)
    model = Normalized(MnistCNN(in_channels=1, num_classes=4, image_size=16, hidden=16, dropout=0.0), (0.5,), (0.25,))
    x, y = batch()
    x_trig = attack.apply_trigger(x)
    logits = attack.classifier_loss(model.train(), x, y, x_trig, attack.target_rule(y))[1]
    with torch.no_grad():
        assert torch.allclose(logits, model(torch.cat([x, x_trig])), atol=1e-5)
        # a separate forward would normalize the triggered batch by its own statistics
        assert not torch.allclose(logits[16:], model(x_trig), atol=1e-4)


def test_true_labels_stage_one_trains_the_classifier_on_triggered_images_with_their_labels():
    attack, model = make_attack("lira", stage1_classifier="true_labels", poison_rate=0.5), make_model()
    attack.begin_stage1(make_trainer())
    model.eval()
    x, y = batch()
    loss, logits, scored = attack.stage1_step(model, x, y)
    assert torch.equal(scored, y)  # no target label anywhere in this classifier step
    with torch.no_grad():
        mixed = torch.cat([attack._triggered(x[:8], attack.eps), x[8:]])
        assert torch.allclose(loss, F.cross_entropy(model(mixed), y), atol=1e-6)


def test_wb_classifier_term_joins_only_after_stage_one():
    attack, model = make_attack("wb", beta_classifier=0.5), make_model()
    model.eval()
    x, y = batch()
    x_trig = attack.apply_trigger(x)
    plain = LIRA.classifier_loss(attack, model, x, y, x_trig, attack.target_rule(y))[0]
    assert torch.allclose(attack.classifier_loss(model, x, y, x_trig, attack.target_rule(y))[0], plain)
    attack.freeze()
    with torch.no_grad():
        feats, feats_trig = model.features(x), model.features(x_trig)
        reg = attack.latent_distance(feats_trig, attack.target_rule(y), feats, y,
                                     F.normalize(model.classifier.weight, dim=1))
    regularized = attack.classifier_loss(model, x, y, x_trig, attack.target_rule(y))[0]
    assert float(reg) > 0 and torch.allclose(regularized, plain + 0.5 * reg, atol=1e-5)


# ----- sliced Wasserstein ---------------------------------------------------------------------


def test_wasserstein_1d_exact_for_unequal_sample_counts():
    u, v = torch.tensor([[0.0, 1.0]]), torch.tensor([[0.0, 0.5, 1.0]])
    assert torch.allclose(wasserstein_1d(u, v, p=2), torch.tensor([1 / 12]))
    scipy_stats = pytest.importorskip("scipy.stats")
    a, b = torch.randn(1, 7, generator=torch.Generator().manual_seed(0)), torch.randn(1, 4) + 0.3
    reference = scipy_stats.wasserstein_distance(a[0].numpy(), b[0].numpy())
    assert abs(float(wasserstein_1d(a, b, p=1)) - reference) < 1e-5


def test_sliced_wasserstein_is_zero_positive_and_permutation_invariant():
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(20, 6, generator=g)
    directions = F.normalize(torch.randn(4, 6, generator=g), dim=1)
    assert float(sliced_wasserstein(feats, feats, directions)) == 0.0
    shift = torch.randn(6, generator=g)
    # Shifting a batch by s moves every projection by d.s, so W_2^2 = (d.s)^2 per direction.
    assert torch.allclose(sliced_wasserstein(feats, feats + shift, directions), ((directions @ shift) ** 2).mean())
    assert float(sliced_wasserstein(feats, feats + shift, directions)) > 0
    other = torch.randn(13, 6, generator=g)
    perm = torch.randperm(20, generator=g)
    assert torch.allclose(sliced_wasserstein(feats, other, directions), sliced_wasserstein(feats[perm], other, directions))


def test_wb_target_class_reference_compares_with_clean_target_latents():
    attack = make_attack("wb")  # all2one, target 0
    g = torch.Generator().manual_seed(0)
    directions = F.normalize(torch.randn(4, 5, generator=g), dim=1)
    clean = torch.randn(8, 5, generator=g)
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    target_clean = clean[y == 0]
    y_target = torch.zeros(2, dtype=torch.long)
    # triggered latents equal to the clean target-class latents: distance 0 for target_class ...
    assert float(attack.latent_distance(target_clean.clone(), y_target, clean, y, directions)) == 0.0
    # ... but not against the whole clean batch
    attack.latent_reference = "batch"
    assert float(attack.latent_distance(target_clean.clone(), y_target, clean, y, directions)) > 0


def test_wb_regularizer_gradient_reaches_the_generator():
    attack, model = make_attack("wb"), make_model()
    x, y = batch()
    net = attack.trigger_net.train()
    feats_trig = model.features(attack._triggered(x, attack.eps))
    reg = attack.latent_distance(feats_trig, attack.target_rule(y), model.features(x), y,
                                 F.normalize(model.classifier.weight.detach(), dim=1))
    grads = torch.autograd.grad(reg, list(net.parameters()), allow_unused=True)
    assert float(reg.detach()) > 0
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    # and the generator's loss does include it
    xp, yp = attack._poisoned_part(x, y)
    with_reg = attack.generator_loss(model.eval(), x, y, xp, yp).detach()
    attack.beta = 0.0
    assert with_reg.item() > attack.generator_loss(model, x, y, xp, yp).item()


# ----- the reference on many-class data (f1f81cb) -----------------------------------------------

# GTSRB's training split, images per class (39,209 in all; class 0, the usual target, has 210), and
# Tiny-ImageNet's (500 in each of 200 classes).
GTSRB_TRAIN_COUNTS = (210, 2220, 2250, 1410, 1980, 1860, 420, 1440, 1410, 1470, 2010, 1320, 2100, 2160, 780, 630,
                      420, 1110, 1200, 210, 360, 330, 390, 510, 270, 1500, 600, 240, 540, 270, 450, 780, 240, 689,
                      420, 1200, 390, 210, 2070, 300, 360, 240, 240)
MANY_CLASSES = {"gtsrb": GTSRB_TRAIN_COUNTS, "tiny_imagenet": (500,) * 200}


class LatentProbe(torch.nn.Module):
    """The least a WB victim needs: features (16-d) and a linear classifier over them."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(SHAPE[1] * SHAPE[2], 16))
        self.classifier = torch.nn.Linear(16, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


def shuffled_label_batches(counts: tuple[int, ...], batches: int, batch_size: int = 128) -> list[torch.Tensor]:
    """The labels of the first `batches` batches of one shuffled epoch with these class counts."""
    labels = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    return [labels[order[i * batch_size:(i + 1) * batch_size]] for i in range(batches)]


@pytest.mark.parametrize("stage", ["generator", "classifier"])
@pytest.mark.parametrize("dataset", MANY_CLASSES)
def test_wb_latent_term_is_active_and_broad_in_almost_every_batch_of_many_class_data(dataset, stage, monkeypatch):
    # Class 0 (the target) is 0.5% of the data: a batch of 128 holds none about half the time and
    # one or two otherwise, so a reference drawn from the batch alone is often empty and otherwise
    # pulls every triggered latent onto one or two points.
    counts = MANY_CLASSES[dataset]
    references: list[list[torch.Tensor]] = []
    real = wb_module.sliced_wasserstein

    def spy(a, b, directions, p=2.0):
        references[-1].append(b.detach().clone())
        return real(a, b, directions, p)

    monkeypatch.setattr(wb_module, "sliced_wasserstein", spy)
    attack = WB(**{**COMMON, **SMALL, "num_classes": len(counts), "beta_classifier": 0.1})
    model = LatentProbe(len(counts))
    if stage == "classifier":
        attack.freeze()  # stage II: the classifier's loss carries the term
    x = torch.rand(128, *SHAPE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for y in shuffled_label_batches(counts, 120):
            references.append([])
            x_poison, y_target = attack._poisoned_part(x, y)
            if stage == "generator":
                attack.generator_loss(model, x, y, x_poison, y_target)
            else:
                attack.classifier_loss(model, x, y, attack._triggered(x_poison, attack.test_eps), y_target)
    active = [refs for refs in references if refs and len(refs[0]) > 0]
    assert len(active) >= 0.95 * len(references), f"active in {len(active)} of {len(references)} batches"
    # Not collapsed: once the bank has filled (about 93 batches at 0.7 target rows per batch), each
    # reference holds dozens of distinct latents, not the batch's one or two.
    late = [refs[0] for refs in references[-20:]]
    assert all(len(torch.unique(ref, dim=0)) >= 32 for ref in late), [len(ref) for ref in late]


def test_wb_reference_bank_survives_a_checkpoint_and_resets_for_a_new_victim():
    def fill(attack, seeds):
        g = torch.Generator().manual_seed(seeds)
        directions = F.normalize(torch.randn(4, 5, generator=g), dim=1)
        out = []
        for _ in range(3):
            clean, y = torch.randn(16, 5, generator=g), torch.randint(0, 4, (16,), generator=g)
            out.append(attack.latent_term(torch.randn(8, 5, generator=g), torch.zeros(8, dtype=torch.long),
                                          clean, y, directions))
        return torch.stack(out)

    attack = make_attack("wb", reference_bank=8)
    fill(attack, 0)
    assert attack.banked(0) is not None and len(attack.banked(0)) == 8  # a full ring buffer
    buffer = io.BytesIO()
    torch.save(attack.training_state(), buffer)  # what Trainer.fit writes with each epoch checkpoint
    buffer.seek(0)
    restored = make_attack("wb", reference_bank=8)
    restored.load_training_state(torch.load(buffer, weights_only=True))
    assert torch.equal(restored.banked(0), attack.banked(0))
    assert torch.equal(fill(restored, 1), fill(attack, 1))  # and goes on exactly as the original
    with pytest.raises(ValueError, match="reference_bank=4"):
        make_attack("wb", reference_bank=4).load_training_state(attack.training_state())
    # A state written before the bank existed loads with an empty bank.
    old = {k: v for k, v in attack.training_state().items() if k != "reference_bank"}
    restored.load_training_state(old)
    assert restored.banked(0) is None

    # train_victim starts a new victim: latents of the previous model are no reference for it.
    sizes = []

    def spy(step):
        def wrapped(model, x, y):
            banked = attack.banked(0)
            sizes.append(0 if banked is None else len(banked))
            return step(model, x, y)
        return wrapped

    attack.train_victim(make_trainer(), make_model(), make_split(), torch.Generator().manual_seed(0), wrap_step=spy)
    assert sizes[0] == 0 and max(sizes) > 0


# ----- persistence, determinism, config -------------------------------------------------------


@pytest.mark.parametrize("kind", ATTACKS)
def test_state_dict_round_trip_reproduces_the_trigger(kind):
    attack, trainer = make_attack(kind), make_trainer()
    attack.train_victim(trainer, make_model(), make_split(), torch.Generator().manual_seed(0))
    buffer = io.BytesIO()
    torch.save(attack.state_dict(), buffer)
    buffer.seek(0)
    restored = make_attack(kind, seed=5)
    x = torch.rand(4, *SHAPE)
    assert not torch.equal(restored.apply_trigger(x), attack.apply_trigger(x))
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.trained
    assert torch.equal(restored.apply_trigger(x), attack.apply_trigger(x))
    with pytest.raises(DataError, match="does not fit"):
        make_attack(kind, generator_width=3).load_state_dict(attack.state_dict())


@pytest.mark.parametrize("kind", ATTACKS)
def test_same_seed_gives_the_same_attack(kind):
    results = []
    for _ in range(2):
        attack, model = make_attack(kind, lookahead=kind == "lira"), make_model()
        torch.manual_seed(7)  # dropout
        attack.train_victim(make_trainer(), model, make_split(), torch.Generator().manual_seed(0))
        results.append((state(attack.trigger_net), state(model)))
    assert same(*[r[0] for r in results]) and same(*[r[1] for r in results])


@pytest.mark.parametrize("kind", ATTACKS)
def test_config_file_instantiates_the_attack(kind):
    cfg = OmegaConf.load(CONF / f"{kind}.yaml")
    attack = instantiate(cfg, num_classes=10, image_shape=(1, 28, 28))
    assert isinstance(attack, ATTACKS[kind]) and attack.name == kind
    assert isinstance(attack.trigger_net, MnistAutoencoder)
    x = torch.rand(2, 1, 28, 28)
    assert (attack.apply_trigger(x) - x).abs().max() <= attack.test_eps + 1e-6


@pytest.mark.parametrize("dataset,expected", [("mnist", MnistAutoencoder), ("cifar10", UNet),
                                              ("gtsrb", ColourAutoencoder), ("tiny_imagenet", ColourAutoencoder)])
def test_each_dataset_gets_the_official_generator(dataset, expected, compose_cfg):
    # the authors' create_models: MNIST -> MNISTAutoencoder, CIFAR-10 -> UNet, GTSRB and Tiny-ImageNet
    # -> --attack_model, default autoencoder; without a preset, colour data gets the autoencoder too
    # (that default, and BackdoorBench's choice on every dataset)
    for overrides, want in (([f"paper=lira/{dataset}"], expected),
                            ([f"dataset={dataset}"], MnistAutoencoder if dataset == "mnist" else ColourAutoencoder)):
        cfg = compose_cfg(*overrides, "attack=lira")
        spec = dataset_spec(cfg.dataset)
        attack = instantiate(cfg.attack, num_classes=spec.num_classes, image_shape=spec.image_shape)
        assert type(attack.trigger_net) is want, (overrides, type(attack.trigger_net).__name__)


def test_wb_directions_come_from_the_last_linear_of_any_head():
    # the angular-margin defense retrains a WB victim with a BN -> tanh -> Linear head
    from backdoorbench.attacks.wb import classifier_directions
    from backdoorbench.defenses.angular_margin import SimplexHead
    from backdoorbench.models.mnist_cnn import MnistCNN

    for kwargs in ({}, {"head": SimplexHead}):
        model = MnistCNN(in_channels=1, num_classes=10, image_size=28, **kwargs)
        directions = classifier_directions(model)
        linear = model.classifier if not kwargs else model.classifier.linear
        assert directions.shape == linear.weight.shape
        assert torch.allclose(directions.norm(dim=1), torch.ones(10))
        assert torch.allclose(directions * linear.weight.norm(dim=1, keepdim=True), linear.weight.detach())
