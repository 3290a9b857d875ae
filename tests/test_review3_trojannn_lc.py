"""Since e1e0375, TrojanNN puts BackdoorBench's trigger on the images (the official square
mask, the optimized mask image added in 8 bits) and the surrogates of TrojanNN and Label-consistent
train as the trainer trains a victim (`surrogate_epochs: null`) under the backdoorbench protocol;
the quick protocol keeps its CPU recipe on mnist5k (docs/fidelity.md#trojannn, #label-consistent)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from PIL import Image

import backdoorbench.config  # noqa: F401  (registers the schemas the composed config needs)
from backdoorbench.attacks.label_consistent import LabelConsistent
from backdoorbench.attacks.trojannn import TrojanNN
from backdoorbench.datasets.base import Split
from backdoorbench.errors import ConfigError
from backdoorbench.models.base import Normalized
from backdoorbench.models.mnist_cnn import MnistCNN
from tests.tiny import one_thread  # noqa: F401  (autouse: one thread for these tiny tensors)

CLASSES = 4
SHAPE = (1, 16, 16)


class RecordingTrainer:
    """Stands in for the surrogate's training: records the epochs it was asked for, trains nothing."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.epochs: list[int | None] = []

    def fit(self, model, split, *, epochs=None, **kwargs):
        self.epochs.append(epochs)
        return [{"epoch": 1, "train_acc": 0.5}]


def tiny_model() -> Normalized:
    torch.manual_seed(0)
    return Normalized(MnistCNN(in_channels=1, num_classes=CLASSES, image_size=16, hidden=16, dropout=0.0), (0.5,), (0.5,))


def split(n: int = 40) -> Split:
    images = torch.randint(0, 256, (n, *SHAPE), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    return Split(images, torch.arange(n) % CLASSES)


def trojannn(trainer=None, **kw) -> TrojanNN:
    attack = TrojanNN(num_classes=CLASSES, image_shape=SHAPE, target=1, poison_rate=0.2, trigger_steps=30, **kw)
    attack.prepare(trainer=trainer or RecordingTrainer(), train=split(), generator=torch.Generator().manual_seed(0),
                   build_model=tiny_model)
    return attack


def test_trojannn_adds_the_optimized_mask_image_as_backdoorbench_does():
    """BackdoorBench's trojannn.py:130 adds its optimized full-image mask image (zero outside the mask)
    to the image, in 8 bits; the old default replaced a 5x5 patch. The poisoned pixel depends on the
    image below it, and nothing outside the mask changes."""
    attack = trojannn()
    assert (attack.mask, attack.stamp_mode, attack.selection, attack.surrogate_epochs) == ("square", "add", "weight", None)
    keep = attack.keep
    assert torch.equal(attack.pattern[~keep], torch.zeros(int((~keep).sum())))
    assert float((attack.pattern - attack.mask_image).abs().max()) <= 0.3 + 1e-6  # within eps of the mask image
    levels = torch.floor(attack.pattern * 255)  # ToPILImage: mul(255).byte()
    dark, mid = torch.full((1, *SHAPE), 20 / 255), torch.full((1, *SHAPE), 102 / 255)
    for x in (dark, mid):
        xt = attack.apply_trigger(x)
        assert torch.equal(xt[0][~keep], x[0][~keep])
        assert torch.allclose(xt[0], ((x[0] * 255).round() + levels).clamp(0, 255) / 255, atol=1e-6)
    assert not torch.equal(attack.apply_trigger(dark)[0][keep], attack.apply_trigger(mid)[0][keep])  # not a replacement
    replaced = TrojanNN(num_classes=CLASSES, image_shape=SHAPE, stamp="replace")
    replaced.pattern = attack.pattern
    assert torch.equal(replaced.apply_trigger(dark)[0][keep], replaced.apply_trigger(mid)[0][keep])


def test_the_square_mask_is_the_official_codes_square_resized():
    """act_max.tvd.center_part.py's square (144 < x, y < 204 of 224), BackdoorBench's square.png: at
    224 px exactly those pixels; resized like BackdoorBench's mask (antialiased bilinear), the pixels > 0
    are the ones it optimizes (a 9x9 block on MNIST's 28 px, 10x10 on 32 px)."""
    full = TrojanNN(num_classes=10, image_shape=(3, 224, 224)).mask_image
    expected = torch.zeros(3, 224, 224)
    expected[:, 145:204, 145:204] = 1
    assert torch.equal(full, expected)
    for size, side, first in ((28, 9, 17), (32, 10, 20)):
        attack = TrojanNN(num_classes=10, image_shape=(1, size, size))
        rows, cols = attack.patch_mask().nonzero(as_tuple=True)
        assert int(attack.patch_mask().sum()) == side * side
        assert (int(rows.min()), int(rows.max()), int(cols.min())) == (first, first + side - 1, first)
        assert attack.mask_image.max() == 1 and (attack.mask_image * 255).frac().abs().max() < 1e-4  # 8 bits


def test_a_mask_image_file_is_read_and_resized_and_a_missing_one_refused(tmp_path):
    canvas = np.zeros((224, 224, 3), dtype=np.uint8)
    canvas[145:204, 145:204] = 255  # the official square, as BackdoorBench's square.png holds it
    Image.fromarray(canvas).save(tmp_path / "square.png")
    from_file = TrojanNN(num_classes=10, image_shape=(1, 28, 28), mask=str(tmp_path / "square.png"))
    built = TrojanNN(num_classes=10, image_shape=(1, 28, 28))
    assert torch.equal(from_file.keep, built.keep)
    assert float((from_file.mask_image - built.mask_image).abs().max()) <= 1 / 255 + 1e-6
    with pytest.raises(ConfigError, match=r"^attack.mask='nope.png' is neither square, patch nor an image file that "
                                          r"exists; use square .*apple4.png\)$"):
        TrojanNN(num_classes=10, image_shape=(1, 28, 28), mask="nope.png")
    Image.fromarray(np.zeros_like(canvas)).save(tmp_path / "black.png")
    with pytest.raises(ConfigError, match=r"^attack.mask='.*black.png' has no pixel > 0 at 28x28; use a mask image"):
        TrojanNN(num_classes=10, image_shape=(1, 28, 28), mask=str(tmp_path / "black.png"))
    with pytest.raises(ConfigError, match=r"^attack.stamp='blend' is unknown; choose one of: add, add_wrap, replace$"):
        TrojanNN(num_classes=10, image_shape=(1, 28, 28), stamp="blend")


@pytest.mark.parametrize(("stamp", "expected"), [("add", 255), ("add_wrap", 44), ("replace", 100)])
def test_the_three_stamps_on_one_pixel(stamp, expected):
    """200 + 100 on 0-255: clipped (add), wrapped as BackdoorBench's astype("uint8") before its clip
    does (add_wrap), or overwritten (replace)."""
    attack = TrojanNN(num_classes=10, image_shape=(1, 28, 28), stamp=stamp)
    attack.pattern = attack.keep * (100 / 255)
    x = torch.full((1, 1, 28, 28), 200 / 255)
    out = attack.apply_trigger(x)
    assert round(float(out[0, 0, 20, 20]) * 255) == expected and float(out[0, 0, 0, 0]) == pytest.approx(200 / 255)


def test_the_surrogates_train_as_the_trainer_trains_a_victim_by_default():
    """surrogate_epochs: null hands the trainer no epochs of its own, so it trains the surrogate with
    its own recipe (the protocol's epochs and schedule), as a victim; a number is the surrogate's own."""
    trainer = RecordingTrainer()
    trojannn(trainer)
    trojannn(trainer, surrogate_epochs=3)
    lc = LabelConsistent(num_classes=CLASSES, image_shape=SHAPE, target=1, poison_rate=0.2)
    assert lc.surrogate_epochs is None
    lc.prepare(trainer=trainer, train=split(), generator=torch.Generator().manual_seed(0), build_model=tiny_model)
    assert trainer.epochs == [None, 3, None]
    with pytest.raises(ConfigError, match=r"^attack.surrogate_epochs=0 is invalid; use an integer >= 1 or null"):
        LabelConsistent(num_classes=CLASSES, image_shape=SHAPE, surrogate_epochs=0)


def test_the_prepared_trigger_survives_a_killed_run():
    """prepare_state holds the trigger, its stats and the surrogate's epoch rows: a resumed run does
    not train the (now fully trained) surrogate again."""
    attack = trojannn()
    state = attack.prepare_state()
    fresh = TrojanNN(num_classes=CLASSES, image_shape=SHAPE, target=1, poison_rate=0.2, trigger_steps=30)
    fresh.load_prepare_state(state)
    x = torch.rand(3, *SHAPE)
    assert torch.equal(fresh.apply_trigger(x), attack.apply_trigger(x))
    assert fresh.describe()["neurons"] == attack.describe()["neurons"] and state["history"] == [{"epoch": 1, "train_acc": 0.5}]


def resolved_attack(attack: str, protocol: str, dataset: str) -> dict:
    with initialize_config_module(config_module="backdoorbench.conf", version_base="1.3"):
        cfg = compose("config", overrides=[f"attack={attack}", f"protocol={protocol}", f"dataset={dataset}"])
    return OmegaConf.to_container(cfg.attack, resolve=True)


@pytest.mark.parametrize(("protocol", "dataset"), [("backdoorbench", "cifar10"), ("backdoorbench", "mnist5k"),
                                                   ("quick", "mnist5k")])
def test_each_protocol_resolves_its_recipe(protocol, dataset):
    trojan = resolved_attack("trojannn", protocol, dataset)
    lc = resolved_attack("label_consistent", protocol, dataset)
    picked = (trojan["mask"], trojan["stamp"], trojan["selection"], trojan["surrogate_epochs"], lc["surrogate_epochs"])
    if protocol == "quick":  # the committed mnist5k rows' recipe, a CPU run
        assert picked == ("patch", "replace", "responsive", 3, 3)
    else:
        assert picked == ("square", "add", "weight", None, None)
