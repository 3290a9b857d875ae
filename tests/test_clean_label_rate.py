"""A clean-label attack's poison rate is a share of the target class (since 5bba9cf), so
every clean-label default runs on many-class data where the target class is far below 10% of
the set, and a rate that cannot be met fails before any surrogate trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from backdoorbench import registry
from backdoorbench.attacks.label_consistent import LabelConsistent
from backdoorbench.attacks.sig import SIG
from backdoorbench.attacks.trojannn import TrojanNN
from backdoorbench.datasets.base import Split
from backdoorbench.errors import ConfigError

CONF = Path(__file__).resolve().parents[1] / "backdoorbench" / "conf" / "attack"
CLEAN_LABEL = [name for name, cls in registry.classes("attack", builtin_only=True).items() if cls.clean_label]


def skewed_labels(num_classes: int, per_class: int, target_count: int) -> torch.Tensor:
    """Class 0 (the target) holds `target_count` images, every other class `per_class`: GTSRB's
    class 0 is ~210 of 39k images (0.5%), Tiny-ImageNet's 500 of 100k."""
    counts = [target_count] + [per_class] * (num_classes - 1)
    return torch.cat([torch.full((n,), c) for c, n in enumerate(counts)])


@pytest.mark.parametrize("name", CLEAN_LABEL)
@pytest.mark.parametrize("num_classes, per_class, target_count, shape", [
    (43, 900, 210, (3, 32, 32)),    # GTSRB-like: target class 0.5% of the set
    (200, 50, 50, (3, 64, 64)),     # Tiny-ImageNet-like: 0.5%
    (10, 600, 590, (1, 28, 28)),    # full MNIST: class 0 is 9.9% (< the old 10% of the whole set)
])
def test_clean_label_defaults_poison_the_target_class_on_many_class_data(name, num_classes, per_class, target_count, shape):
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    attack = instantiate(cfg, num_classes=num_classes, image_shape=shape)
    y = skewed_labels(num_classes, per_class, target_count)
    indices = attack.poison_indices(y, torch.Generator().manual_seed(0))
    share = 0.5 if name == "ctrl" else 1.0  # default: the whole target class (CTRL: half, BackdoorBench's CIFAR-10 count)
    assert len(indices) == round(share * target_count)  # a share of the target class, whatever its size
    assert bool((y[indices] == 0).all())
    assert attack.describe()["poison_rate_of"] == "target_class"


def test_clean_label_rate_counts_the_target_class_and_dirty_label_the_whole_set():
    y = skewed_labels(43, 100, 40)  # 4,240 images, 40 of the target class
    clean = SIG(num_classes=43, image_shape=(3, 32, 32), poison_rate=0.25)
    assert clean.poison_count(y) == 10  # 0.25 * 40
    dirty = SIG(num_classes=43, image_shape=(3, 32, 32), poison_rate=0.25, clean_label=False)
    assert dirty.poison_count(y) == 1060  # 0.25 * 4240
    assert SIG(num_classes=43, image_shape=(3, 32, 32), clean_label=False).poison_rate == 0.1  # null: 0.1 of the set


class FailingTrainer:
    """A surrogate must not train when the poisoning would be refused afterwards."""

    device = torch.device("cpu")

    def fit(self, *args, **kwargs):
        raise AssertionError("the surrogate trained before the poison rate was checked")


@pytest.mark.parametrize("cls, rate, kw", [(LabelConsistent, 0.1, {}), (TrojanNN, 0.0001, {"patch_size": 3})])
def test_an_unmeetable_rate_fails_before_the_surrogate_trains(cls, rate, kw):
    y = skewed_labels(43, 20, 3)
    split = Split(torch.zeros(len(y), 3, 8, 8, dtype=torch.uint8), y)
    attack = cls(num_classes=43, image_shape=(3, 8, 8), poison_rate=rate, **kw)  # LC: 0.1 of 3 target images
    with pytest.raises(ConfigError, match=rf"^attack.poison_rate={rate} poisons no sample"):
        attack.prepare(trainer=FailingTrainer(), train=split, generator=torch.Generator().manual_seed(0),
                       build_model=lambda **_: None)
