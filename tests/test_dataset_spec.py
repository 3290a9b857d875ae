"""A dataset's spec (what its config says before any data is read) agrees with the data its loader
returns: the preflight refuses runs on it, so a spec that drifted would refuse good runs."""

from __future__ import annotations

import torch

from backdoorbench.datasets.cifar10 import load_cifar10
from backdoorbench.datasets.gtsrb import load_gtsrb
from backdoorbench.datasets.mnist import load_mnist
from backdoorbench.datasets.mnist5k import load_mnist5k
from backdoorbench.datasets.spec import SPECS, dataset_spec
from backdoorbench.datasets.tiny_imagenet import load_tiny_imagenet
from tests import dataset_files as files


def agrees(spec, data) -> None:
    assert (spec.num_classes, spec.image_shape) == (data.num_classes, data.image_shape)
    if spec.train_class_counts is not None:
        counts = torch.bincount(data.train.labels, minlength=data.num_classes)
        assert tuple(counts.tolist()) == spec.train_class_counts
        assert torch.equal(spec.train_labels(), data.train.labels.sort().values)


def test_mnist5k_spec_is_exact_for_any_split(mnist5k):
    agrees(dataset_spec({"_target_": "backdoorbench.datasets.mnist5k.load_mnist5k"}), mnist5k)
    other = load_mnist5k(test_per_class=450)
    agrees(dataset_spec({"_target_": "backdoorbench.datasets.mnist5k.load_mnist5k", "test_per_class": 450}), other)


def test_file_datasets_agree_with_their_spec(tmp_path):
    files.write_mnist(tmp_path / "mnist")
    files.write_cifar10(tmp_path / "cifar")
    files.write_gtsrb(tmp_path / "gtsrb")
    files.write_tiny_imagenet(tmp_path / "tiny")
    loaded = {
        "backdoorbench.datasets.mnist.load_mnist": ({}, load_mnist(tmp_path / "mnist")),
        # the tests' batches are not the official ones: without the md5 check the spec claims no counts
        "backdoorbench.datasets.cifar10.load_cifar10": ({"verify_md5": False}, load_cifar10(tmp_path / "cifar", verify_md5=False)),
        "backdoorbench.datasets.gtsrb.load_gtsrb": ({"image_size": 48}, load_gtsrb(tmp_path / "gtsrb", image_size=48)),
        "backdoorbench.datasets.tiny_imagenet.load_tiny_imagenet": ({}, load_tiny_imagenet(tmp_path / "tiny")),
    }
    for target, (cfg, data) in loaded.items():
        agrees(dataset_spec({"_target_": target, **cfg}), data)
    assert set(loaded) | {"backdoorbench.datasets.mnist5k.load_mnist5k"} == set(SPECS)  # every spec is tested


def test_official_cifar10_has_5000_per_class_and_unknown_loaders_have_no_spec():
    spec = dataset_spec({"_target_": "backdoorbench.datasets.cifar10.load_cifar10", "verify_md5": True})
    assert spec.train_class_counts == (5000,) * 10 and len(spec.train_labels()) == 50000
    assert dataset_spec({"_target_": "my_lab.data.load_faces"}) is None
