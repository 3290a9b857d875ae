"""Shared pieces of the tests that train tiny nets on 16x16, 4-class data (WaNet, IAD, LIRA, WB)."""

from __future__ import annotations

import pytest
import torch

from backdoorbench.models.base import Normalized
from backdoorbench.models.mnist_cnn import MnistCNN

SHAPE = (1, 16, 16)
COMMON = dict(num_classes=4, image_shape=SHAPE, target=0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These nets are tiny: a second OpenMP thread only adds barrier waits on a shared machine.
    Autouse in each module that imports it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_model(seed: int = 0) -> Normalized:
    torch.manual_seed(seed)
    return Normalized(MnistCNN(in_channels=1, num_classes=4, image_size=16, hidden=16), (0.5,), (0.25,))


class Killed(Exception):
    """Raised from a fit's `on_epoch` to stop it as a kill would, after that epoch's checkpoint."""


def kill_after_epoch(epoch: int = 1):
    """An `on_epoch` callback that raises Killed once epoch `epoch` (1-based) is done."""

    def on_epoch(row):
        if row["epoch"] == epoch:
            raise Killed

    return on_epoch


class RecordingTrainer:
    """Stands in for the Trainer: `fit` records the crop and rotation of the trainer it was called on."""

    def __init__(self, seen: list):
        self.crop_padding, self.rotation, self.rotation_p = 2, 0.0, 0.5
        self.seen = seen

    def fit(self, model, split, **kwargs):
        self.seen.append((self.crop_padding, self.rotation, self.rotation_p))
        return []


# The scale rehearsal's zoo: (model name, image shape, classes, model kwargs) at 10, 43 and 200 classes and 28, 32
# and 64 px, small widths where the model takes one.
ZOO = [("mnist_cnn", (1, 28, 28), 10, {}), ("preact_resnet18", (3, 32, 32), 43, {"width": 8}),
       ("resnet18", (3, 64, 64), 200, {"width": 8}), ("vgg16_bn", (3, 32, 32), 43, {})]


def zoo_model(name: str, shape: tuple[int, int, int], classes: int, kwargs: dict):
    """A ZOO entry built from its conf/model yaml (seed 0), inside a Normalized, in eval mode."""
    from pathlib import Path

    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    import backdoorbench
    from backdoorbench.models.base import Normalized

    node = OmegaConf.load(Path(backdoorbench.__file__).parent / "conf" / "model" / f"{name}.yaml")
    torch.manual_seed(0)
    net = instantiate(node, in_channels=shape[0], num_classes=classes, image_size=shape[1], **kwargs)
    return Normalized(net, (0.5,) * shape[0], (0.25,) * shape[0]).eval()


def two_stage_net(num_classes: int):
    """A tiny two-conv-stage classifier (an ImageClassifier named `two_stage`) for the detectors' tests."""
    from torch import nn

    from backdoorbench.models.base import ImageClassifier

    class Net(ImageClassifier):
        name = "two_stage"

        def __init__(self, classes: int):
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                          nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                          nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, 16), nn.ReLU())
            self.classifier = nn.Linear(16, classes)

    return Net(num_classes)


def tiny_badnets_victim(n_train: int, num_classes: int, n_clean: int):
    """A two-stage net trained 6 epochs on quadrant data with BadNets (a 3 px patch, 10%, target 0), in eval
    mode; returns (model, poisoned data, the poisoned mask over the training set, n_clean clean samples)."""
    from backdoorbench.attacks.badnets import BadNets
    from backdoorbench.models.base import Normalized
    from tests.test_defenses_detect import quadrant_data, tiny_trainer

    torch.manual_seed(0)
    train = quadrant_data(n_train, seed=0, num_classes=num_classes)
    attack = BadNets(num_classes=num_classes, image_shape=(1, 8, 8), patch_size=3, poison_rate=0.1)  # target 0
    poisoned = attack.poison_dataset(train, torch.Generator().manual_seed(0))
    model = Normalized(two_stage_net(num_classes), (0.3,), (0.3,))
    tiny_trainer(6).fit(model, poisoned.split, generator=torch.Generator().manual_seed(0))
    is_poison = torch.zeros(len(train), dtype=torch.bool)
    is_poison[poisoned.indices] = True
    return model.eval(), poisoned, is_poison, quadrant_data(n_clean, seed=3, num_classes=num_classes)
