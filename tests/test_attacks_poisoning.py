"""The data-poisoning attacks: the contract every one of them keeps (seeding, untouched samples, both target
modes or the clean-label all2all error, its config, a cache hit's description), over every data-poisoning
attack the registry lists, so a new one is held to it alone; then each one's defining property."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from backdoorbench.attacks.adaptive_blend import AdaptiveBlend, piece_bounds
from backdoorbench.attacks.bpp import Bpp, floyd_steinberg, quantize
from backdoorbench.attacks.label_consistent import LabelConsistent, corner_pattern
from backdoorbench.attacks.refool import Refool, blend, focal_blur_blend, ghost_reflection, vignette
from backdoorbench.attacks.sig import SIG
from backdoorbench.attacks.trojannn import TrojanNN, feature_layer, select_neurons
from backdoorbench import registry
from backdoorbench.datasets.base import Split, to_float, to_uint8
from backdoorbench.errors import ConfigError
from backdoorbench.models.base import Normalized
from backdoorbench.models.mnist_cnn import MnistCNN
from backdoorbench.train import Trainer

RESULTS = Path(__file__).resolve().parents[1] / "results"
CONF = Path(__file__).resolve().parents[1] / "backdoorbench" / "conf" / "attack"
# every data-poisoning attack (attack=none poisons nothing); built below from its own config unless
# `build` shrinks it (a surrogate's epochs) or sets what makes its effect visible on 16x16 noise
NAMES = [name for name, cls in registry.classes("attack", builtin_only=True).items()
         if cls.kind == "data_poisoning" and name != "none"]
CLEAN_LABEL = [name for name in NAMES if registry.method_class("attack", name).clean_label]
CLASSES = 4
SHAPE = (1, 16, 16)


def make_split(n: int = 80, shape=SHAPE, seed: int = 0) -> Split:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8)
    labels = torch.arange(n) % CLASSES
    return Split(images, labels)


def tiny_model() -> nn.Module:
    return Normalized(MnistCNN(in_channels=1, num_classes=CLASSES, image_size=16, hidden=16, dropout=0.0), (0.5,), (0.5,))


def tiny_trainer() -> Trainer:
    return Trainer(epochs=1, batch_size=32, augment=False, progress=False, device="cpu")


class InstantTrainer:
    """Test double for the surrogate training in prepare(): the model arrives already trained."""

    device = torch.device("cpu")

    def fit(self, model, split, **kwargs):
        return []


_SURROGATE: dict[str, nn.Module] = {}


def trained_surrogate() -> nn.Module:
    """One tiny surrogate trained once (1 epoch on the tiny split) and copied for each attack."""
    if "model" not in _SURROGATE:
        torch.manual_seed(0)
        model = tiny_model()
        tiny_trainer().fit(model, make_split(), generator=torch.Generator().manual_seed(0))
        _SURROGATE["model"] = model
    return copy.deepcopy(_SURROGATE["model"])


def prepared(attack, split: Split, seed: int = 0):
    attack.prepare(trainer=InstantTrainer(), train=split, generator=torch.Generator().manual_seed(seed),
                   build_model=trained_surrogate)
    return attack


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: extra intra-op threads only add overhead on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def common(**kw):
    return {"num_classes": CLASSES, "image_shape": SHAPE, "target": 1, **kw}


def build(name: str, mode: str = "all2one", **kw):
    """One attack of each kind, ready to poison (surrogates trained on tiny data where needed)."""
    if name == "sig":
        return SIG(**common(target_mode=mode, poison_rate=0.2, **kw))
    if name == "label_consistent":
        return prepared(LabelConsistent(**common(target_mode=mode, poison_rate=0.2, pgd_steps=3, surrogate_epochs=1, **kw)), make_split())
    if name == "bpp":
        return Bpp(**common(target_mode=mode, poison_rate=0.2, **kw))
    if name == "trojannn":
        # unconstrained, on a replaced corner patch, among the units that fire: the optimization visibly drives them
        kw = {"start": "random", "mask": "patch", "stamp": "replace", "selection": "responsive", **kw}
        return prepared(TrojanNN(**common(target_mode=mode, poison_rate=0.2, patch_size=4, trigger_steps=20,
                                          trigger_lr=0.05, surrogate_epochs=1, **kw)), make_split())
    if name == "refool":
        return Refool(**common(target_mode=mode, poison_rate=0.2, **kw))
    if name == "adaptive_blend":
        return AdaptiveBlend(**common(target_mode=mode, poison_rate=0.2, cover_rate=0.2, **kw))
    if name == "poison_ink":  # its injection and extraction networks at their smallest, one epoch on 16 images
        kw = {"epochs": 1, "stages": [["crop", "flip"]], "train_images": 16, "width": 4, "depth": 1,
              "extractor_width": 4, "extractor_blocks": 1, **kw}
    if name == "ssba":  # its encoder and decoder at their smallest, two epochs of the tiny split
        kw = {"epochs": 2, "width": 8, "code_bits": 8, **kw}
    node = OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml"), resolve=True)  # its defaults
    return prepared(instantiate({**node, **common(target_mode=mode, poison_rate=0.2, **kw)}), make_split())


# --- every attack ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_poisoned_indices_and_images(name):
    split = make_split()
    a = build(name).poison_dataset(split, torch.Generator().manual_seed(7))
    b = build(name).poison_dataset(split, torch.Generator().manual_seed(7))
    c = build(name).poison_dataset(split, torch.Generator().manual_seed(8))
    assert torch.equal(a.indices, b.indices) and torch.equal(a.split.images, b.split.images)
    assert torch.equal(a.split.labels, b.split.labels)
    assert not torch.equal(a.indices, c.indices)
    # clean-label attacks poison a share of the target class (20 of 80 here), the others of the whole set
    pool = int((split.labels == 1).sum()) if name in CLEAN_LABEL else len(split)
    assert len(a.indices) == round(0.2 * pool)


@pytest.mark.parametrize("name", NAMES)
def test_untouched_samples_stay_clean(name):
    split = make_split()
    attack = build(name)
    poisoned = attack.poison_dataset(split, torch.Generator().manual_seed(1))
    changed = torch.zeros(len(split), dtype=torch.bool)
    changed[poisoned.indices] = True
    if name == "bpp":
        changed[attack.negative_indices] = True
    if name == "adaptive_blend":
        changed[attack.cover_indices] = True
    assert torch.equal(poisoned.split.images[~changed], split.images[~changed])
    assert torch.equal(poisoned.split.labels[~changed], split.labels[~changed])


@pytest.mark.parametrize("name", NAMES)
def test_dirty_label_all2all_relabels_to_next_class(name):
    split = make_split()
    kw = {"clean_label": False} if name in CLEAN_LABEL else {}  # the dirty-label variant of a clean-label attack
    poisoned = build(name, "all2all", **kw).poison_dataset(split, torch.Generator().manual_seed(3))
    idx = poisoned.indices
    assert torch.equal(poisoned.split.labels[idx], (split.labels[idx] + 1) % CLASSES)


@pytest.mark.parametrize("cls", [registry.method_class("attack", name) for name in CLEAN_LABEL])
def test_clean_label_all2all_is_a_config_error(cls):
    with pytest.raises(ConfigError, match="all2all"):
        cls(**common(target_mode="all2all"))


@pytest.mark.parametrize("name", CLEAN_LABEL)
def test_clean_label_attacks_never_change_a_label(name):
    split = make_split()
    poisoned = build(name).poison_dataset(split, torch.Generator().manual_seed(0))
    assert torch.equal(poisoned.split.labels, split.labels)
    assert bool((split.labels[poisoned.indices] == 1).all())  # only target-class images are touched


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_config_instantiates(name, shape):
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    attack = instantiate(cfg, num_classes=10, image_shape=shape)
    assert attack.name == name and attack.describe()["name"] == name


# --- SIG ---------------------------------------------------------------------------------------

def test_sig_trigger_is_the_column_sinusoid_before_clipping():
    attack = SIG(num_classes=10, image_shape=(3, 5, 28), delta=20 / 255, frequency=6)
    x = torch.full((2, 3, 5, 28), 0.5)
    diff = attack.apply_trigger(x) - x
    expected = torch.tensor([20 / 255 * math.sin(2 * math.pi * j * 6 / 28) for j in range(28)])
    assert torch.allclose(diff, expected.expand_as(diff), atol=1e-6)  # same on every row and channel
    bright = attack.apply_trigger(torch.ones(1, 3, 5, 28))
    assert bright.max() <= 1.0 and bright.min() >= 1 - 20 / 255 - 1e-6


def test_sig_test_delta_differs_from_training_delta():
    split = make_split()
    attack = SIG(**common(poison_rate=0.2, delta=0.05, test_delta=0.2))
    poisoned = attack.poison_dataset(split, torch.Generator().manual_seed(0))
    i = poisoned.indices
    assert torch.equal(poisoned.split.images[i], to_uint8(attack.add_signal(to_float(split.images[i]), 0.05)))
    x = torch.full((1, *SHAPE), 0.5)
    assert torch.allclose((attack.apply_trigger(x) - x).abs().max(), torch.tensor(0.2 * max(
        abs(math.sin(2 * math.pi * j * 6 / 16)) for j in range(16))), atol=1e-6)


def test_sig_defaults_are_backdoorbench_40_over_255_in_training_and_at_test_time():
    """One named reference (BackdoorBench: sig_delta 40 on 0-255, f 6), not 60/100."""
    for attack in (instantiate(OmegaConf.load(CONF / "sig.yaml"), num_classes=10, image_shape=(1, 28, 28)),
                   SIG(num_classes=10, image_shape=(1, 28, 28))):
        assert math.isclose(attack.delta, 40 / 255, rel_tol=1e-8) and attack.test_delta == attack.delta
        assert attack.frequency == 6


def test_sig_rejects_bad_amplitude():
    with pytest.raises(ConfigError, match="attack.delta=20"):
        SIG(**common(delta=20))


def test_sig_ramp_is_the_papers_mnist_signal_before_clipping():
    """Barni et al.'s MNIST ramp v(i, j) = delta * j / m, j = 1..m: rising along the columns, the same
    on every row and channel, the whole delta on the last column; clipped to [0, 1] on bright pixels."""
    attack = SIG(num_classes=10, image_shape=(3, 5, 28), delta=30 / 255, signal="ramp")
    x = torch.full((2, 3, 5, 28), 0.25)
    diff = attack.apply_trigger(x) - x
    expected = torch.tensor([30 / 255 * j / 28 for j in range(1, 29)])
    assert torch.allclose(diff, expected.expand_as(diff), atol=1e-6)
    assert torch.all(diff[..., 1:] > diff[..., :-1])  # monotone: no period, unlike the sinusoid
    bright = attack.apply_trigger(torch.full((1, 3, 5, 28), 0.95))
    assert bright.max() <= 1.0 and torch.equal(bright[..., -1], torch.ones(1, 3, 5))
    assert attack.describe()["signal"] == "ramp"


def test_sig_rejects_an_unknown_signal():
    with pytest.raises(ConfigError, match="attack.signal='triangle' is invalid; choose one of: sinusoid, ramp"):
        SIG(**common(signal="triangle"))


def test_sig_paper_mnist_preset_resolves_to_the_papers_setting(compose_cfg):
    """paper=sig/mnist: Sec. 4.1 and Table I (ramp at 30/255 on 0.3 of digit 3, tested at 80/255; Adam 1e-3,
    20 epochs, batch 64); `dataset=mnist5k` runs the same setting offline."""
    cfg = compose_cfg("paper=sig/mnist", "attack=sig", "dataset=mnist5k")
    attack, trainer = cfg.attack, cfg.trainer
    assert (attack.signal, attack.target, attack.poison_rate, attack.clean_label) == ("ramp", 3, 0.3, True)
    assert math.isclose(attack.delta, 30 / 255, rel_tol=1e-8) and math.isclose(attack.test_delta, 80 / 255, rel_tol=1e-8)
    assert (trainer.epochs, trainer.batch_size, trainer.schedule, trainer.optimizer.lr) == (20, 64, "constant", 0.001)
    assert trainer.optimizer._target_ == "torch.optim.Adam" and cfg.protocol.name == "paper"
    assert cfg.dataset._target_.endswith("load_mnist5k")
    assert compose_cfg("paper=sig/mnist", "attack=sig").dataset._target_.endswith("datasets.mnist.load_mnist")


def test_a_paper_presets_own_attack_values_are_its_defaults_in_the_report():
    """A run of paper=sig/mnist at the preset's values is at its attack's defaults (the board's canonical
    row of its section) and lists no setting; a value off the preset is the setting (a committed record)."""
    import dataclasses

    from backdoorbench.records import load_record
    from backdoorbench.run_facts import run_report

    record = load_record(RESULTS / "runs" / "mnist5k" / "sig_all2one" / "560dc725cbababaf.json")
    assert "paper=sig/mnist" in record.overrides and record.config["attack"]["poison_rate"] == 0.3
    report = run_report(record)
    assert report["attack_at_defaults"] is True and report["setting"]["attack"] == {}
    config = copy.deepcopy(record.config)
    config["attack"]["poison_rate"] = 1.0
    report = run_report(dataclasses.replace(record, config=config))
    assert report["attack_at_defaults"] is False and report["setting"]["attack"] == {"poison_rate": 1.0}
    plain = run_report(dataclasses.replace(record, overrides=[o for o in record.overrides if not o.startswith("paper=")]))
    assert plain["attack_at_defaults"] is False and plain["setting"]["attack"]["signal"] == "ramp"


def test_sig_signal_key_at_its_default_keeps_the_run_id(compose_cfg):
    """attack.signal was added after the SIG records: at `sinusoid` it is left out of the run id and
    the victim key, so every committed SIG run keeps its id and cached victim; `ramp` is a new run."""
    from omegaconf import OmegaConf as OC

    from backdoorbench.run_keys import run_config_hash

    config = OC.to_container(compose_cfg("attack=sig"), resolve=True)
    older = {**config, "attack": {k: v for k, v in config["attack"].items() if k != "signal"}}
    assert config["attack"]["signal"] == "sinusoid"
    assert run_config_hash(config) == run_config_hash(older)
    ramp = {**config, "attack": {**config["attack"], "signal": "ramp"}}
    assert run_config_hash(ramp) != run_config_hash(config)


# --- Label-Consistent ----------------------------------------------------------------------------

def test_lc_pgd_stays_within_eps_and_raises_the_loss():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(256, CLASSES))
    attack = LabelConsistent(**common(eps=8 / 255, pgd_steps=5))
    x = torch.rand(16, *SHAPE)
    y = torch.arange(16) % CLASSES
    adv = attack.perturb(model, x, y)
    assert (adv - x).abs().max() <= 8 / 255 + 1e-6
    assert adv.min() >= 0 and adv.max() <= 1
    with torch.no_grad():
        assert F.cross_entropy(model(adv), y) > F.cross_entropy(model(x), y) + 0.05


def test_lc_l2_pgd_stays_in_each_images_l2_ball_and_raises_the_loss():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(256, CLASSES))
    attack = LabelConsistent(**common(eps=1.5, norm="l2", pgd_steps=5))
    x = torch.rand(16, *SHAPE)
    y = torch.arange(16) % CLASSES
    adv = attack.perturb(model, x, y)
    assert float((adv - x).flatten(1).norm(dim=1).max()) <= 1.5 + 1e-4
    assert float((adv - x).abs().max()) > 0.05  # not an L_inf step of eps / steps
    assert adv.min() >= 0 and adv.max() <= 1
    with torch.no_grad():
        assert F.cross_entropy(model(adv), y) > F.cross_entropy(model(x), y) + 0.05
    with pytest.raises(ConfigError, match="attack.norm='l1'"):
        LabelConsistent(**common(norm="l1"))


def test_lc_corner_trigger_pixels():
    full = LabelConsistent(**common())
    x = torch.full((1, *SHAPE), 0.5)
    out = full.apply_trigger(x)[0, 0]
    pattern = corner_pattern(16, 16, "all")
    assert torch.equal(out[pattern > 0], torch.ones(int((pattern > 0).sum())))
    assert torch.equal(out[pattern < 0], torch.zeros(int((pattern < 0).sum())))
    assert torch.equal(out[pattern == 0], x[0, 0][pattern == 0])
    assert int((pattern != 0).sum()) == 36  # four 3x3 corners
    assert torch.equal(pattern[-3:, -3:], torch.tensor([[-1.0, -1, 1], [-1, 1, -1], [1, -1, 1]]))
    flipped = torch.rand(2, *SHAPE)  # the four-corner trigger survives a horizontal flip
    assert torch.equal(full.apply_trigger(flipped.flip(-1)), full.apply_trigger(flipped).flip(-1))
    faint = LabelConsistent(**common(amplitude=0.25, corners="bottom_right")).apply_trigger(x)[0, 0]
    br = corner_pattern(16, 16, "bottom_right")
    assert torch.allclose(faint, 0.5 + 0.25 * br)
    assert int((br != 0).sum()) == 9


def test_lc_poisoned_images_are_pgd_within_eps_plus_trigger():
    split = make_split()
    attack = build("label_consistent", eps=8 / 255)
    poisoned = attack.poison_dataset(split, torch.Generator().manual_seed(0))
    i = poisoned.indices
    off_trigger = corner_pattern(16, 16, "all") == 0
    diff = (to_float(poisoned.split.images[i]) - to_float(split.images[i]))[..., off_trigger]
    assert diff.abs().max() <= 8 / 255 + 0.5 / 255 + 1e-6  # eps, plus uint8 rounding
    assert diff.abs().max() > 4 / 255  # PGD did move the pixels
    stats = attack.describe()
    assert stats["surrogate_error_hardened"] == pytest.approx(1 - stats["surrogate_acc_perturbed"])


def test_lc_prepare_trains_the_surrogate_with_the_trainer():
    torch.manual_seed(0)
    attack = LabelConsistent(**common(poison_rate=0.2, pgd_steps=2, surrogate_epochs=1, surrogate_adv_eps=4 / 255,
                                      surrogate_adv_steps=1))
    attack.prepare(trainer=tiny_trainer(), train=make_split(), generator=torch.Generator().manual_seed(0),
                   build_model=tiny_model)
    assert 0 <= attack.stats["surrogate_train_acc"] <= 1
    assert attack.poison_dataset(make_split(), torch.Generator().manual_seed(0)).indices.numel() == 4  # 0.2 of 20


def test_lc_defaults_harden_against_an_adversarially_trained_surrogate_as_backdoorbench():
    """BackdoorBench's CIFAR-10 recipe (PGD 8/255, step 1.5/255, 100 steps) against
    a PGD-trained surrogate (8/255, step 2/255, 10 steps), not 16/255 against a clean one."""
    for attack in (LabelConsistent(**common()),
                   instantiate(OmegaConf.load(CONF / "label_consistent.yaml"), num_classes=10, image_shape=(3, 32, 32))):
        assert attack.norm == "linf" and attack.eps == pytest.approx(8 / 255) and attack.pgd_steps == 100
        assert attack.step_size == pytest.approx(1.5 / 255)
        assert attack.surrogate_adv_eps == pytest.approx(8 / 255) and attack.surrogate_adv_steps == 10
        assert 2.5 * attack.surrogate_adv_eps / attack.surrogate_adv_steps == pytest.approx(2 / 255)


def test_lc_needs_prepare():
    with pytest.raises(RuntimeError, match="prepare"):
        LabelConsistent(**common(poison_rate=0.2)).poison_dataset(make_split(), torch.Generator())


# --- BppAttack -----------------------------------------------------------------------------------

def _reference_floyd_steinberg(image: np.ndarray, levels: int) -> np.ndarray:
    """Scalar Floyd-Steinberg as in the official code, for (C, H, W) in [0, 1]."""
    img = image.astype(np.float64).copy()
    _, h, w = img.shape
    scale = levels - 1
    for y in range(h):
        for x in range(w):
            old = img[:, y, x].copy()
            new = np.clip(np.round(old * scale), 0, scale) / scale
            err = old - new
            img[:, y, x] = new
            if x + 1 < w:
                img[:, y, x + 1] += err * 7 / 16
            if y + 1 < h and x + 1 < w:
                img[:, y + 1, x + 1] += err * 1 / 16
            if y + 1 < h:
                img[:, y + 1, x] += err * 5 / 16
            if x - 1 >= 0 and y + 1 < h:
                img[:, y + 1, x - 1] += err * 3 / 16
    return img


def test_bpp_dithering_matches_scalar_reference_and_stays_on_grid():
    x = torch.rand(3, 2, 7, 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = floyd_steinberg(x, 4)
    for b in range(3):
        assert np.allclose(out[b].numpy(), _reference_floyd_steinberg(x[b].numpy(), 4), atol=1e-12)
    assert torch.allclose(out * 3, torch.round(out * 3), atol=1e-9)


def test_bpp_dithering_keeps_the_mean_where_plain_quantization_loses_it():
    flat = torch.full((1, 1, 16, 16), 0.3)
    assert quantize(flat, 2).mean() == 0  # 1 bit: everything rounds to black
    dithered = floyd_steinberg(flat, 2)
    assert set(dithered.unique().tolist()) == {0.0, 1.0}
    assert abs(float(dithered.mean()) - 0.3) < 0.03


@pytest.mark.parametrize("dithering", [True, False])
def test_bpp_trigger_output_is_on_the_quantization_grid(dithering):
    attack = Bpp(**common(squeeze_num=8, dithering=dithering))
    out = attack.apply_trigger(torch.rand(4, *SHAPE))
    # dithered: the levels as 8-bit pixels (the official code rounds the dithered image); plain: the levels
    levels = torch.tensor([round(255 * j / 7) / 255 if dithering else j / 7 for j in range(8)])
    assert bool(((out.reshape(-1, 1) - levels).abs().min(1).values < 1e-6).all())
    assert out.min() >= 0 and out.max() <= 1


def test_bpp_poisoned_on_grid_negatives_keep_labels():
    split = make_split()
    attack = Bpp(**common(poison_rate=0.2, neg_ratio=0.25, squeeze_num=4))
    poisoned = attack.poison_dataset(split, torch.Generator().manual_seed(0))
    grid = {round(255 * j / 3) for j in range(4)}  # levels once stored as uint8
    assert set(poisoned.split.images[poisoned.indices].unique().tolist()) <= grid
    assert bool((poisoned.split.labels[poisoned.indices] == 1).all())
    neg = attack.negative_indices
    assert len(neg) == 20 and not set(neg.tolist()) & set(poisoned.indices.tolist())
    assert torch.equal(poisoned.split.labels[neg], split.labels[neg])
    assert not torch.equal(poisoned.split.images[neg], split.images[neg])
    assert not set(poisoned.split.images[neg].unique().tolist()) <= grid  # residuals of others, not quantized
    assert attack.describe()["n_negative"] == 20


# --- TrojanNN ------------------------------------------------------------------------------------

def test_trojannn_selects_most_connected_neurons():
    model = tiny_model()
    layer = feature_layer(model)
    assert isinstance(layer, nn.Linear) and layer.out_features == 16
    expected = layer.weight.abs().sum(1).argsort(descending=True)[:3]
    assert torch.equal(select_neurons(model, 3, "incoming"), expected)
    outgoing = model.classifier.weight.abs().sum(0).argsort(descending=True)[:3]
    assert torch.equal(select_neurons(model, 3, "outgoing"), outgoing)


def test_trojannn_ranks_neurons_by_outgoing_weights_by_default():
    """The official code (fc6 units by their fc7 weights) and BackdoorBench rank
    the selected layer's units by the weights leaving them."""
    yaml_attack = instantiate(OmegaConf.load(CONF / "trojannn.yaml"), num_classes=10, image_shape=(1, 28, 28))
    assert TrojanNN(**common()).connection == yaml_attack.connection == "outgoing"
    model = trained_surrogate()
    attack = TrojanNN(**common(mask="patch", patch_size=4, trigger_steps=1, surrogate_epochs=1, selection="weight"))
    attack.prepare(trainer=InstantTrainer(), train=make_split(), generator=torch.Generator().manual_seed(0),
                   build_model=lambda: copy.deepcopy(model))
    expected = model.classifier.weight.abs().sum(0).argsort(descending=True)[:2]
    assert attack.stats["neurons"] == expected.tolist()


class SilentStrongUnits(nn.Module):
    """Four penultimate ReLU units: 0 and 1 carry the strongest weights into the classifier but are
    silenced by the bottom-right 4x4 mask (negative weights there), 2 and 3 are weak and fire on it:
    the situation of mnist5k's 5x5 corner square (ledger, trojannn)."""

    def __init__(self) -> None:
        super().__init__()
        linear = nn.Linear(SHAPE[1] * SHAPE[2], 4)
        with torch.no_grad():
            mask = torch.zeros(SHAPE[1], SHAPE[2])
            mask[-4:, -4:] = 1
            mixed = mask.clone()  # fires on the white square, and fires more as half of it darkens
            mixed[-2:, -4:] = -0.5
            linear.weight.copy_(torch.stack([-mask, -mask, 0.1 * mixed, 0.05 * mixed]).flatten(1))
            linear.bias.zero_()
        self.features = nn.Sequential(nn.Flatten(), linear, nn.ReLU())
        self.classifier = nn.Linear(4, CLASSES)
        with torch.no_grad():
            self.classifier.weight.copy_(torch.tensor([5.0, 4.0, 1.0, 0.5]).expand(CLASSES, 4))

    def forward(self, x):
        return self.classifier(self.features(x))


@pytest.mark.parametrize("selection", ["weight", "responsive"])
def test_trojannn_takes_the_most_connected_units_that_the_mask_can_move(selection):
    """Ranked by weight alone (BackdoorBench), the chosen units are silent on the mask: no gradient,
    and the optimization leaves them at 0 (the attack degenerates to BadNets with the mask image).
    `selection=responsive` (the quick protocol's on mnist5k) ranks only the units that fire on the start patch."""
    assert TrojanNN(**common()).selection == "weight"  # BackdoorBench's, the default since e1e0375
    attack = TrojanNN(**common(mask="patch", stamp="replace", patch_size=4, trigger_steps=20, trigger_lr=0.05,
                               surrogate_epochs=1, selection=selection))
    attack.prepare(trainer=InstantTrainer(), train=make_split(), generator=torch.Generator().manual_seed(0),
                   build_model=SilentStrongUnits)
    before, after = attack.stats["activation_before"], attack.stats["activation_after"]
    assert attack.stats["units_firing_on_start"] == 2
    if selection == "weight":
        assert attack.stats["neurons"] == [0, 1] and before == after == [0.0, 0.0]
    else:
        assert attack.stats["neurons"] == [2, 3] and min(before) > 0 and all(a > b for a, b in zip(after, before))
    with pytest.raises(ConfigError, match=r"^attack.selection='all' is unknown; choose one of: responsive, weight$"):
        TrojanNN(**common(selection="all"))


def test_trojannn_trigger_only_changes_the_mask_and_fires_the_neurons():
    attack = build("trojannn")
    x = torch.rand(5, *SHAPE)
    changed = (attack.apply_trigger(x) != x).any(0).any(0)
    mask = attack.patch_mask()
    assert not changed[~mask].any() and int(mask.sum()) == 16
    before, after = attack.stats["activation_before"], attack.stats["activation_after"]
    # the optimization drives the selected units up (a unit dead under the patch stays at 0)
    assert all(a >= b for a, b in zip(after, before)) and sum(after) > sum(before) + 0.05
    state = attack.state_dict()
    fresh = TrojanNN(**common(mask="patch", stamp="replace", patch_size=4))
    fresh.load_state_dict(state)
    assert torch.equal(fresh.apply_trigger(x), attack.apply_trigger(x))


def test_trojannn_starts_from_the_mask_image_and_stays_within_eps_of_it():
    """BackdoorBench optimizes from its mask image (here the white square) within
    L_inf 0.3 of it; the old default started from a random patch the selected units were silent on."""
    yaml_attack = instantiate(OmegaConf.load(CONF / "trojannn.yaml"), num_classes=10, image_shape=(1, 28, 28))
    assert (yaml_attack.start, yaml_attack.trigger_eps, yaml_attack.trigger_steps, yaml_attack.trigger_lr) == ("mask", 0.3, 1000, 0.1)
    attack = prepared(TrojanNN(**common(mask="patch", patch_size=4, trigger_steps=30, surrogate_epochs=1)), make_split())
    assert attack.pattern[attack.keep].min() >= 0.7 - 1e-6 and attack.pattern.max() <= 1.0
    before, after = attack.stats["activation_before"], attack.stats["activation_after"]
    assert max(before) > 0 and sum(after) > sum(before)  # the white square fires a unit; the steps raise it
    random_start = prepared(TrojanNN(**common(mask="patch", patch_size=4, trigger_steps=30, surrogate_epochs=1,
                                              start="random")), make_split())
    assert random_start.pattern[random_start.keep].min() < 0.7  # unconstrained: free to leave the mask image's neighbourhood
    with pytest.raises(ConfigError, match="attack.start='black' is unknown"):
        TrojanNN(**common(start="black"))


def test_trojannn_prepare_trains_the_surrogate_with_the_trainer():
    torch.manual_seed(0)
    attack = TrojanNN(**common(mask="patch", patch_size=3, trigger_steps=2, surrogate_epochs=1))
    attack.prepare(trainer=tiny_trainer(), train=make_split(), generator=torch.Generator().manual_seed(0),
                   build_model=tiny_model)
    assert attack.pattern.shape == SHAPE and int(attack.patch_mask().sum()) == 9 and len(attack.stats["neurons"]) == 2


def test_trojannn_needs_an_optimized_trigger():
    with pytest.raises(RuntimeError, match="prepare"):
        TrojanNN(**common()).apply_trigger(torch.rand(1, *SHAPE))


# --- Refool --------------------------------------------------------------------------------------

def test_refool_ghost_and_blend_formulas_on_a_hand_case():
    r = torch.zeros(1, 4, 4)
    r[0, 0, 0] = 1.0
    ghost = ghost_reflection(r, (1, 2), 0.6)
    expected = torch.zeros(1, 4, 4)
    expected[0, 0, 0], expected[0, 1, 2] = 0.6, 0.4
    assert torch.allclose(ghost, expected)
    x = torch.full((1, 4, 4), 0.5)
    assert torch.allclose(blend(x, ghost, 0.8, gamma=1.0), 0.8 * 0.5 + 0.2 * expected)
    value = (0.8 * 0.5**2.2 + 0.2 * 0.6) ** (1 / 2.2)
    assert math.isclose(float(blend(x, ghost, 0.8, gamma=2.2)[0, 0, 0]), value, rel_tol=1e-5)


def test_refool_draws_a_fresh_reflection_for_every_test_image():
    """No bank of fixed variants; each image gets its own draw, reproducibly."""
    attack = Refool(**common(seed=3))
    # 300 images that differ in one pixel only: any larger difference is the reflection's
    x = torch.full((300, *SHAPE), 0.4)
    x[:, 0, 0, 0] = torch.arange(300) % 256 / 255
    x[:, 0, 0, 1] = torch.arange(300) // 256 / 255
    out = attack.apply_trigger(x)
    assert out.min() >= 0 and out.max() <= 1
    assert len(torch.unique(out[:, :, 1:].flatten(1), dim=0)) == 300
    assert torch.equal(Refool(**common(seed=3)).apply_trigger(x), out)  # seeded
    assert not torch.equal(Refool(**common(seed=4)).apply_trigger(x), out)


def test_refool_training_reflections_come_from_the_run_generator_not_the_test_stream():
    split = make_split()
    attack = build("refool")
    first = attack.poison_dataset(split, torch.Generator().manual_seed(5))
    test_trigger = attack.apply_trigger(to_float(split.images[:4]))
    again = build("refool").poison_dataset(split, torch.Generator().manual_seed(5))
    assert torch.equal(first.split.images, again.split.images)
    assert torch.equal(build("refool").apply_trigger(to_float(split.images[:4])), test_trigger)  # untouched by poisoning


def test_refool_ghost_image_is_the_two_pulse_kernel_of_its_source():
    attack = Refool(**common(models=["ghost"], reflections=["camera"]))
    from backdoorbench.attacks.patterns import load_pattern

    linear = load_pattern("camera", SHAPE) ** 2.2
    x = torch.rand(1, *SHAPE)
    g = torch.Generator().manual_seed(0)
    variant = attack.draw(g)
    assert 3 <= min(variant["offset"]) and max(variant["offset"]) <= 8
    out = attack.trigger_with(x, torch.Generator().manual_seed(0))
    expected = blend(x[0], ghost_reflection(linear, variant["offset"], variant["weight"]), variant["alpha_t"], 2.2)
    assert torch.allclose(out[0], expected, atol=1e-6)


def _official_vignette(side: int, nsig: float = 3.0) -> np.ndarray:
    """gen_kernel of the official insert_reflection.py (scipy's norm.cdf as math.erf)."""
    interval = (2 * nsig + 1.0) / side
    x = np.linspace(-nsig - interval / 2.0, nsig + interval / 2.0, side + 1)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    k = np.sqrt(np.outer(np.diff(cdf), np.diff(cdf)))
    return k / k.max()


def test_refool_focal_blur_uses_the_official_vignetted_weight():
    """The reflection is weighted by (1 - alpha_t / 2) x vignette, not by (1 - alpha_t)."""
    assert np.allclose(vignette(32, 32).numpy(), _official_vignette(32), atol=1e-6)
    mask = vignette(32, 32)
    assert float(mask.max()) == pytest.approx(1.0) and float(mask[16, 0]) < 0.15  # bright centre, dark edge
    t = torch.zeros(1, 32, 32)
    r = torch.full((1, 32, 32), 0.5)  # no saturation, so no darkening
    alpha_t = 0.9
    out = focal_blur_blend(t, r, alpha_t, att=1.1, mask=mask)
    assert torch.allclose(out, 0.5 * (1 - alpha_t / 2) * mask)
    assert float(out.max()) / (0.5 * (1 - alpha_t)) > 5  # 5.5x the old (1 - alpha_t) weight at the centre
    saturated = focal_blur_blend(torch.full((1, 32, 32), 0.8), torch.full((1, 32, 32), 0.6), 0.5, att=1.1,
                                 mask=torch.ones(32, 32))
    darkened = (0.6 - 0.4 * 1.1) * 0.75 + 0.5 * 0.8  # r lowered by att * (mean of t + r where > 1, minus 1)
    assert torch.allclose(saturated, torch.full_like(saturated, darkened))


def test_refool_rejects_bad_ranges_and_models():
    with pytest.raises(ConfigError, match="alpha_t"):
        Refool(**common(alpha_t=[0.9, 0.5]))
    with pytest.raises(ConfigError, match="models"):
        Refool(**common(models=["mirror"]))


# --- Adaptive-Blend ----------------------------------------------------------------------------

def test_adaptive_blend_training_images_carry_the_pattern_on_a_random_half_of_the_pieces():
    split = make_split()
    attack = build("adaptive_blend")
    poisoned = attack.poison_dataset(split, torch.Generator().manual_seed(0))
    touched = torch.cat([poisoned.indices, attack.cover_indices])
    original = split.images[touched]
    full = to_uint8(to_float(original) + 0.15 * (attack.pattern - to_float(original)))  # alpha everywhere
    out = poisoned.split.images[touched]
    bounds = piece_bounds(SHAPE[1], 4)
    layouts = set()
    for i in range(len(touched)):
        kept = []
        for r0, r1 in bounds:
            for c0, c1 in bounds:
                piece = out[i, :, r0:r1, c0:c1]
                if torch.equal(piece, full[i, :, r0:r1, c0:c1]) and not torch.equal(piece, original[i, :, r0:r1, c0:c1]):
                    kept.append(True)
                else:  # a hidden piece is left exactly as it was
                    assert torch.equal(piece, original[i, :, r0:r1, c0:c1]), (i, r0, c0)
                    kept.append(False)
        assert sum(kept) == 8  # 16 pieces, mask_rate 0.5
        layouts.add(tuple(kept))
    assert len(layouts) > len(touched) // 2  # drawn afresh for each image


def test_adaptive_blend_payload_is_relabelled_and_cover_keeps_its_labels():
    split = make_split()
    attack = build("adaptive_blend")
    poisoned = attack.poison_dataset(split, torch.Generator().manual_seed(2))
    payload, cover = poisoned.indices, attack.cover_indices
    assert len(payload) == len(cover) == round(0.2 * len(split))
    assert not set(payload.tolist()) & set(cover.tolist())
    assert bool((poisoned.split.labels[payload] == 1).all())
    assert set(split.labels[payload].tolist()) == set(range(CLASSES))  # from every class, as the official code
    assert torch.equal(poisoned.split.labels[cover], split.labels[cover])
    assert not torch.equal(poisoned.split.images[cover], split.images[cover])
    assert attack.describe()["n_cover"] == len(cover)


def test_adaptive_blend_test_trigger_is_the_whole_pattern_at_test_alpha():
    attack = build("adaptive_blend")
    x = to_float(make_split(4).images)
    assert torch.allclose(attack.apply_trigger(x), 0.8 * x + 0.2 * attack.pattern)


@pytest.mark.parametrize("kw, match", [({"pieces": 15}, "attack.pieces=15"), ({"pieces": 0}, "attack.pieces=0"),
                                       ({"pieces": 400}, "attack.pieces=400"), ({"mask_rate": 1.0}, "attack.mask_rate=1.0"),
                                       ({"mask_rate": 0.99}, "hides all 16 pieces"),
                                       ({"cover_rate": 0.95}, "attack.cover_rate=0.95"), ({"alpha": 0}, "attack.alpha=0"),
                                       ({"test_alpha": 1.5}, "attack.test_alpha=1.5")])
def test_adaptive_blend_rejects_bad_values(kw, match):
    with pytest.raises(ConfigError, match=match):
        AdaptiveBlend(**common(**kw))


def test_label_keeping_extras_avoid_the_poisoned_samples_and_say_when_too_few_are_left():
    from backdoorbench.attacks.base import choose_unpoisoned

    poisoned = torch.tensor([0, 2, 4, 6, 8, 9])
    chosen = choose_unpoisoned(poisoned, 10, 0.3, "cover_rate", "cover samples", torch.Generator().manual_seed(0))
    again = choose_unpoisoned(poisoned, 10, 0.3, "cover_rate", "cover samples", torch.Generator().manual_seed(0))
    assert torch.equal(chosen, again) and torch.equal(chosen, chosen.sort().values)
    assert len(chosen) == 3 and set(chosen.tolist()) <= {1, 3, 5, 7}
    with pytest.raises(ConfigError, match=r"^attack.neg_ratio=0.5 asks for 5 negative samples but only 4 images are "
                                          r"not poisoned; use attack.neg_ratio <= 0.4000$"):
        choose_unpoisoned(poisoned, 10, 0.5, "neg_ratio", "negative samples", torch.Generator())


@pytest.mark.parametrize("name", NAMES)
def test_a_cache_hit_describes_the_attack_as_the_run_that_filled_it(name):
    """A victim-cache hit restores the poisoned rows and `state_dict()`, not
    `poison_dataset`'s draws; the record's attack block must still be the training run's (it named
    BPP's negatives and Adaptive-Blend's cover samples 0)."""
    trained = build(name)
    trained.poison_dataset(make_split(), torch.Generator().manual_seed(3))
    hit = build(name)  # a fresh attack, as the pipeline builds it before it finds the cache entry
    hit.load_state_dict(trained.state_dict())
    assert untimed(hit.describe()) == untimed(trained.describe())


def untimed(block):
    """A describe() block without its wall-clock seconds (networks trained twice here, as Poison Ink's
    and SSBA's are, take different seconds on a loaded machine)."""
    if isinstance(block, dict):
        return {k: untimed(v) for k, v in block.items() if k not in ("seconds", "networks_s")}
    return block
