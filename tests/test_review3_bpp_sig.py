"""BPP, SIG and the 8-bit rounding against the official code (e1e0375): BPP's test-time trigger is the official
8-bit dithered image and its victim trains with the official crop and rotation; dirty-label SIG
draws from every class as BackdoorBench; stored pixels round where BackdoorBench truncates (a
recorded departure, docs/fidelity.md#sig), by at most one level."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backdoorbench.attacks.bpp import Bpp
from backdoorbench.attacks.sig import SIG
from backdoorbench.datasets.base import Split, to_float, to_uint8
from backdoorbench.errors import ConfigError
from tests.tiny import one_thread  # noqa: F401  (autouse: one thread for these tiny tensors)
from tests.tiny import RecordingTrainer

CLASSES = 4


def random_split(n: int = 80, shape=(3, 8, 8), seed: int = 0) -> Split:
    g = torch.Generator().manual_seed(seed)
    return Split(torch.randint(0, 256, (n, *shape), generator=g, dtype=torch.uint8), torch.arange(n) % CLASSES)


def official_dithered(image: np.ndarray, squeeze_num: int) -> np.ndarray:
    """BppAttack's test-time trigger for one (C, H, W) image on 0-255: Floyd-Steinberg on the float
    0-255 image (floydDitherspeed), then torch.round (bppattack.py:350-353), written out again here."""
    img = image.astype(np.float64).copy()
    _, h, w = img.shape
    for y in range(h):
        for x in range(w):
            old = img[:, y, x].copy()
            new = np.round(old / 255.0 * (squeeze_num - 1)) / (squeeze_num - 1) * 255
            error = old - new
            img[:, y, x] = new
            if x + 1 < w:
                img[:, y, x + 1] += error * 0.4375
            if y + 1 < h and x + 1 < w:
                img[:, y + 1, x + 1] += error * 0.0625
            if y + 1 < h:
                img[:, y + 1, x] += error * 0.3125
            if x - 1 >= 0 and y + 1 < h:
                img[:, y + 1, x - 1] += error * 0.1875
    return np.round(img)


# --- BPP: the test-time trigger --------------------------------------------------------------------

def test_bpp_test_time_trigger_is_the_official_8_bit_dithered_image():
    split = random_split(4)
    attack = Bpp(num_classes=CLASSES, image_shape=(3, 8, 8), squeeze_num=8)
    out = attack.apply_trigger(to_float(split.images)).double() * 255
    reference = np.stack([official_dithered(img, 8) for img in split.images.numpy()])
    assert torch.equal(out.round(), out.round().clamp(0, 255)) and bool((out - out.round()).abs().max() < 1e-4)
    assert np.abs(out.numpy() - reference).max() < 1e-4  # 8-bit integers, the official ones


def test_bpp_stored_and_test_time_triggered_images_are_the_same_pixels():
    split = random_split()
    attack = Bpp(num_classes=CLASSES, image_shape=(3, 8, 8), poison_rate=0.2, target=1)
    poisoned = attack.poison_dataset(split, torch.Generator().manual_seed(0))
    i = poisoned.indices
    assert torch.equal(to_float(poisoned.split.images[i]), attack.apply_trigger(to_float(split.images[i])))


def test_bpp_without_dithering_keeps_the_float_levels_as_the_official_test_images():
    attack = Bpp(num_classes=CLASSES, image_shape=(3, 8, 8), squeeze_num=8, dithering=False)
    out = attack.apply_trigger(to_float(random_split(4).images))
    assert torch.allclose(out * 7, (out * 7).round(), atol=1e-6)  # k / 7, not rounded to k * 255 / 7 pixels


# --- BPP: the victim's augmentation ----------------------------------------------------------------

def test_bpp_trains_the_victim_with_the_official_crop_and_rotation_and_leaves_the_trainer_alone():
    official = Bpp.__init__.__kwdefaults__["augment"]
    for augment, expected in ((official, (5, 10.0, 0.25)), (None, (2, 0.0, 0.5)),
                              ({"crop_padding": None, "rotation": 15}, (2, 15.0, 0.5))):
        seen: list = []
        trainer = RecordingTrainer(seen)
        attack = Bpp(num_classes=CLASSES, image_shape=(3, 8, 8), augment=augment)
        attack.train_victim(trainer, torch.nn.Identity(), random_split(), torch.Generator().manual_seed(0))
        assert seen == [expected]
        assert (trainer.crop_padding, trainer.rotation, trainer.rotation_p) == (2, 0.0, 0.5)  # untouched


def test_bpp_config_gives_the_official_augmentation_under_every_default_protocol(compose_cfg):
    from hydra.utils import instantiate

    for overrides in (("attack=bpp",), ("attack=bpp", "dataset=cifar10")):
        cfg = compose_cfg(*overrides)
        assert dict(cfg.attack.augment) == {"crop_padding": 5, "rotation": 10, "rotation_p": 0.25}
    attack = instantiate(cfg.attack, num_classes=10, image_shape=(3, 32, 32))
    assert attack.augment == {"crop_padding": 5, "rotation": 10.0, "rotation_p": 0.25}
    assert attack.describe()["augment"] == attack.augment


@pytest.mark.parametrize(("augment", "message"), [
    ({"rotate": 10}, r"attack.augment has unknown key\(s\) \['rotate'\]; use crop_padding, rotation, rotation_p"),
    ({"rotation": 200}, r"attack.augment.rotation=200 is out of range; use a number in \[0, 180\] or null"),
    ({"rotation_p": 2}, r"attack.augment.rotation_p=2 is out of range"),
    ({"crop_padding": 2.5}, r"attack.augment.crop_padding=2.5 is invalid; use an integer >= 0 or null"),
    (5, r"attack.augment=5 is invalid; use a mapping"),
])
def test_bpp_bad_augmentation_is_one_config_error(augment, message):
    with pytest.raises(ConfigError, match=message):
        Bpp(num_classes=CLASSES, image_shape=(3, 8, 8), augment=augment)


def test_bpp_bad_augmentation_is_refused_before_data_loads(compose_cfg, monkeypatch):
    from backdoorbench import validation

    def no_data(*args, **kwargs):
        raise AssertionError("the data was loaded")

    monkeypatch.setattr("backdoorbench.datasets.mnist5k.load_mnist5k", no_data)
    with pytest.raises(ConfigError, match=r"attack.augment.rotation=-1"):
        validation.validate_config(compose_cfg("attack=bpp", "attack.augment.rotation=-1"))


# --- SIG: dirty-label draws from every class -------------------------------------------------------

def test_sig_dirty_label_draws_from_every_class_target_included_as_backdoorbench():
    split = random_split(400, shape=(1, 8, 8))
    for mode in ("all2one", "all2all"):
        attack = SIG(num_classes=CLASSES, image_shape=(1, 8, 8), target=1, target_mode=mode, clean_label=False)
        poisoned = attack.poison_dataset(split, torch.Generator().manual_seed(0))
        i = poisoned.indices
        assert len(i) == round(0.1 * 400)  # null = 0.1 of the whole set, BackdoorBench's round(pratio * N)
        assert set(split.labels[i].tolist()) == set(range(CLASSES))  # the target class 1 included
        assert torch.equal(poisoned.split.labels[i], attack.target_rule(split.labels[i]))
    assert "non-target images" not in SIG.__doc__ and "every class, target class included" in " ".join(SIG.__doc__.split())


# --- rounding: a recorded departure from BackdoorBench's truncation ----------------------------------

def test_stored_sig_pixels_round_where_backdoorbench_truncates_at_most_one_level_brighter():
    """BackdoorBench: np.uint8(np.clip(np.uint32(img) + pattern, 0, 255)) (utils/bd_img_transform/sig.py:50-51),
    which truncates; we round (to_uint8). docs/fidelity.md#sig records the share measured here."""
    split = random_split(500, shape=(3, 32, 32))
    attack = SIG(num_classes=CLASSES, image_shape=(3, 32, 32))
    ours = to_uint8(attack.add_signal(to_float(split.images), attack.delta)).int()
    pattern = np.array([40 * np.sin(2 * np.pi * j * 6 / 32) for j in range(32)], dtype=np.float32)  # sig_delta 40, f 6
    theirs = np.uint8(np.clip(split.images.numpy().astype(np.uint32) + pattern, 0, 255))
    diff = ours.numpy() - theirs.astype(np.int64)
    assert set(np.unique(diff).tolist()) == {0, 1}  # never darker, at most one level brighter
    assert diff.mean() == pytest.approx(0.366, abs=0.001)  # 36.6% of the pixels
    # 3.1 points of it are column 16, where BackdoorBench's float32 sin(6 pi) is just below 0
    assert pattern[16] < 0 and diff[..., 16].mean() == pytest.approx(1.0, abs=0.01)
