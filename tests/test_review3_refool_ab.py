"""Refool's fixed test-time draw and BackdoorBench's blend scale, and
Adaptive-Blend's per-protocol rates (docs/fidelity.md#refool, #adaptive-blend; since e1e0375)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from scipy import ndimage

import backdoorbench.config  # noqa: F401  (registers the schemas)
from backdoorbench.attacks.refool import Refool, gaussian_blur
from tests.tiny import one_thread  # noqa: F401  (autouse: one thread for these tiny tensors)

SHAPE = (3, 16, 16)


def refool(**kw) -> Refool:
    return Refool(num_classes=4, image_shape=SHAPE, target=1, **kw)


def eval_images(n: int = 12) -> torch.Tensor:
    """uint8-valued test images, as the evaluation hands them over."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, *SHAPE), generator=g).float() / 255


def resolved_attack(attack: str, dataset: str, protocol: str | None = None) -> dict:
    overrides = [f"attack={attack}", f"dataset={dataset}"] + ([f"protocol={protocol}"] if protocol else [])
    with initialize_config_module(config_module="backdoorbench.conf", version_base="1.3"):
        config = compose("config", overrides=overrides)
    return OmegaConf.to_container(config.attack, resolve=True)


# --- Refool: one fixed triggered test set -------------------------------------------------------

def test_refool_triggers_the_test_set_the_same_way_at_every_call():
    """The attacked and the defended ASR are measured on one draw: a second evaluation, another
    batch size or order, and a fresh instance of the same attack all see the same triggered images.
    The old code drew from a stream that every call advanced (refool.py:155,197)."""
    attack = refool(seed=3)
    x = eval_images()
    first = attack.apply_trigger(x)
    assert torch.equal(attack.apply_trigger(x), first)                       # the defended model's pass
    halves = torch.cat([attack.apply_trigger(x[:5]), attack.apply_trigger(x[5:])])
    assert torch.equal(halves, first)                                         # another batch size
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))
    assert torch.equal(attack.apply_trigger(x[order]), first[order])          # another order
    assert torch.equal(refool(seed=3).apply_trigger(x), first)                # another instance
    assert not torch.equal(refool(seed=4).apply_trigger(x), first)            # the seed picks the draw


def test_refool_test_draw_is_independent_of_poisoning_and_of_autocast():
    """Poisoning the training set draws from the run's generator, not the test draws; a detector
    scoring under the trainer's bf16 autocast sees the fp32 images the ASR was measured on."""
    attack = refool(seed=0, models=["focal_blur"])  # a convolution, which autocast would run in bf16
    x = eval_images()
    before = attack.apply_trigger(x)
    from backdoorbench.datasets.base import Split, to_uint8

    train = Split(to_uint8(eval_images(40)), torch.arange(40) % 4)
    attack.poison_dataset(train, torch.Generator().manual_seed(0))
    assert torch.equal(attack.apply_trigger(x), before)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        under_autocast = attack.apply_trigger(x)
    assert under_autocast.dtype == torch.float32 and torch.equal(under_autocast, before)


def test_refool_different_test_images_get_independent_draws():
    attack = refool(seed=0)
    x = eval_images(64)
    variants = [attack.draw(attack.test_generator(image)) for image in x]
    assert len({(v["model"], round(v["alpha_t"], 9)) for v in variants}) == 64
    assert {v["model"] for v in variants} == {"ghost", "focal_blur"}


# --- Refool: the blend scale of BackdoorBench ------------------------------------------------------

def test_refool_offsets_and_sigmas_are_the_official_pixels_at_the_image_size():
    """BackdoorBench calls blend_images with max_image_size = the image size
    (SCLBD/BackdoorBench@f02e353:attack/refool.py:233), so the official randint(3, 8) px offsets and
    uniform(1, 5) px sigmas apply at 28-64 px. The old defaults were [1, 3] and [0.5, 1.5]."""
    attack = refool()
    g = torch.Generator().manual_seed(0)
    offsets, sigmas = [], []
    for _ in range(400):
        v = attack.draw(g)
        offsets += list(v.get("offset", ()))
        sigmas += [v["sigma"]] if "sigma" in v else []
    assert set(offsets) == set(range(3, 9))
    assert 1 <= min(sigmas) < 1.2 and 4.8 < max(sigmas) <= 5
    for dataset in ("mnist5k", "cifar10"):
        conf = resolved_attack("refool", dataset)
        assert conf["ghost_offset"] == [3, 8] and conf["blur_sigma"] == [1, 5]


@pytest.mark.parametrize("sigma", [0.7, 1.0, 2.6, 5.0])
def test_refool_blur_is_cv2s_gaussian_with_mirrored_edges(sigma):
    """Kernel 2 ceil(2 sigma) + 1, border reflect-101 (cv2.GaussianBlur's default; scipy's 'mirror')."""
    r = torch.rand(SHAPE, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    radius = max(1, math.ceil(2 * sigma))
    expected = ndimage.gaussian_filter(r.numpy(), sigma=(0, sigma, sigma), mode="mirror", radius=(0, radius, radius))
    assert np.allclose(gaussian_blur(r, sigma).numpy(), expected, atol=1e-12)


# --- Adaptive-Blend: the protocol's rates -----------------------------------------------------------

@pytest.mark.parametrize(("dataset", "protocol", "rates"), [
    ("cifar10", None, (0.003, 0.003)),            # cifar10's default protocol is backdoorbench
    ("gtsrb", "backdoorbench", (0.003, 0.003)),
    ("mnist5k", None, (0.1, 0.1)),                # mnist5k's default is quick
    ("mnist5k", "quick", (0.1, 0.1)),
])
def test_adaptive_blend_rates_come_from_the_protocol(dataset, protocol, rates):
    """The paper's and the official README's 0.003 payload and 0.003 cover on CIFAR-10
    (vtu81/backdoor-toolbox@9d4d909:README.md:120) and GTSRB (:179); mnist5k's quick protocol keeps
    0.1 and 0.1, at which its 4,000 images are poisoned at all. The old config had 0.1 everywhere."""
    conf = resolved_attack("adaptive_blend", dataset, protocol)
    assert (conf["poison_rate"], conf["cover_rate"]) == rates
