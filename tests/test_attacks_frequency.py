"""FTrojan and CTRL: the windowed DCT and colour conversions against the official functions, the
trigger's energy at the official coefficients, the poisoning rule of each, and their refusals.

The FTrojan reference runs the official pipeline (SoftWiser-group/FTrojan, image.py and data.py:
OpenCV's 8-bit RGB<->YCrCb, `cv2.dct` per 32-px window, `magnitude` added at (15, 15) and (31, 31) of
Cr and Cb) with OpenCV itself; the CTRL reference is the official float pipeline (meet-cjli/CTRL,
utils/frequency.py: kornia 0.6.5's YUV, an orthonormal DCT per window) written out with scipy."""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest
import scipy.fft
import torch

from backdoorbench.attacks import frequency
from backdoorbench.attacks.ctrl import CTRL
from backdoorbench.attacks.ftrojan import FTrojan
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.errors import ConfigError
from tests.tiny import one_thread  # noqa: F401  (autouse: one thread for these small tensors)

OFFICIAL = ((15, 15), (31, 31))


def smooth_images(n: int, size: int = 32, seed: int = 0) -> np.ndarray:
    """(n, size, size, 3) uint8 images with natural-looking colour: blurred noise."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)
    return np.stack([cv2.GaussianBlur(image, (7, 7), 2) for image in noise])


def ours(attack, images: np.ndarray) -> np.ndarray:
    """The attack's trigger on (n, H, W, C) uint8 images, as 0-255 floats in the same layout."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    return attack.apply_trigger(x).permute(0, 2, 3, 1).double().numpy() * 255


def official_ftrojan(images: np.ndarray, magnitude: float = 30.0, round_levels: bool = True) -> np.ndarray:
    """The official poison_frequency with YUV on: x * 255 -> cv2 RGB2YCrCb of `astype(uint8)` ->
    cv2.dct per 32-px window -> + magnitude at the positions of channels 1, 2 -> cv2.idct ->
    `astype(uint8)` -> cv2 YCrCb2RGB -> / 255, clip. `round_levels`: round the inverse DCT's floats to
    levels where the official code truncates them (our recorded departure)."""
    x = images.astype(np.float64) / 255.0 * 255.0
    out = np.empty_like(x)
    for i, image in enumerate(x):
        ycc = cv2.cvtColor(image.astype(np.uint8), cv2.COLOR_RGB2YCrCb).astype(np.float64)
        for channel in (1, 2):
            coefficients = cv2.dct(np.ascontiguousarray(ycc[..., channel]))
            for u, v in OFFICIAL:
                coefficients[u, v] += magnitude
            ycc[..., channel] = cv2.idct(coefficients)
        ycc[..., 0] = cv2.idct(cv2.dct(np.ascontiguousarray(ycc[..., 0])))  # the official loop transforms Y too
        levels = np.clip(np.round(ycc), 0, 255) if round_levels else ycc
        out[i] = cv2.cvtColor(levels.astype(np.uint8), cv2.COLOR_YCrCb2RGB)
    return np.clip(out / 255.0, 0, 1) * 255


KORNIA_RGB_TO_YUV = np.array([[0.299, 0.587, 0.114], [-0.147, -0.289, 0.436], [0.615, -0.515, -0.100]])
KORNIA_YUV_TO_RGB = np.array([[1.0, 0.0, 1.14], [1.0, -0.396, -0.581], [1.0, 2.029, 0.0]])


def official_ctrl(images: np.ndarray, magnitude: float = 100.0, window: int = 32) -> np.ndarray:
    """The official Poison_Frequency_Diff: x * 255 -> kornia rgb_to_yuv -> dct_2d(norm='ortho') per
    window -> + magnitude at the positions of channels 1, 2 -> idct_2d -> yuv_to_rgb -> / 255, clamp."""
    x = images.astype(np.float64)
    yuv = x @ KORNIA_RGB_TO_YUV.T
    h, w = yuv.shape[1:3]
    for top in range(0, h, window):
        for left in range(0, w, window):
            tile = yuv[:, top:top + window, left:left + window, :]
            coefficients = scipy.fft.dctn(tile, axes=(1, 2), norm="ortho")
            for channel in (1, 2):
                for u, v in OFFICIAL:
                    coefficients[:, u, v, channel] += magnitude
            yuv[:, top:top + window, left:left + window, :] = scipy.fft.idctn(coefficients, axes=(1, 2), norm="ortho")
    return np.clip(yuv @ KORNIA_YUV_TO_RGB.T / 255.0, 0, 1) * 255


# --- the transform --------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [8, 28, 32])
def test_the_dct_matrix_is_the_orthonormal_dct_ii_of_the_official_codes(n):
    d = frequency.dct_matrix(n)
    assert torch.allclose(d @ d.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    x = np.random.default_rng(n).normal(size=(n, n))
    assert np.allclose((d @ torch.from_numpy(x) @ d.T).numpy(), cv2.dct(x), atol=1e-9)
    # the DCT-II sum itself, k = 5, l = 3: c_k c_l sum_ij x_ij cos(pi (2i+1) k / 2n) cos(pi (2j+1) l / 2n)
    c = lambda k: math.sqrt((1 if k == 0 else 2) / n)  # noqa: E731
    i = np.arange(n)
    by_hand = c(5) * c(3) * (x * np.outer(np.cos(np.pi * (2 * i + 1) * 5 / (2 * n)),
                                          np.cos(np.pi * (2 * i + 1) * 3 / (2 * n)))).sum()
    assert math.isclose((d @ torch.from_numpy(x) @ d.T)[5, 3].item(), by_hand, abs_tol=1e-9)


def test_block_dct_transforms_each_tile_and_inverts_exactly():
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    coefficients = frequency.block_dct(x, 32)
    tile = scipy.fft.dctn(x[:, :, 32:, :32].numpy(), axes=(-2, -1), norm="ortho")  # the bottom-left tile alone
    assert np.allclose(coefficients[:, :, 32:, :32].numpy(), tile, atol=1e-10)
    assert torch.allclose(frequency.block_idct(coefficients, 32), x, atol=1e-12)


@pytest.mark.parametrize("shape, window, channels", [((3, 64, 64), 32, (1, 2)), ((1, 28, 28), 28, (0,))])
def test_the_added_pattern_is_the_transform_bump_invert_pipeline(shape, window, channels):
    # trigger adds bump_pattern instead of transforming every image: the same levels, to float64's rounding
    levels = torch.randint(0, 256, (6, *shape), generator=torch.Generator().manual_seed(1)).double()
    positions = ((window // 2 - 1, window // 2 - 1), (window - 1, window - 1))
    pipeline = frequency.block_idct(frequency.bump(frequency.block_dct(levels, window), channels, window, positions, 30.0), window)
    added = levels + frequency.bump_pattern(shape, channels, window, positions, 30.0)
    assert (added - pipeline).abs().max() < 1e-9
    # a real bump, and only the bumped channels move
    assert set(torch.nonzero((added - levels).abs().sum((0, 2, 3)) > 1e-9).flatten().tolist()) == set(channels)
    x = levels / 255
    assert torch.allclose(frequency.trigger(x, 30.0, channels, window, positions), (pipeline / 255).clamp(0, 1), atol=1e-12)


def test_the_8_bit_colour_conversions_are_opencvs():
    images = np.random.default_rng(1).integers(0, 256, size=(20, 16, 16, 3), dtype=np.uint8)
    as_tensor = lambda a: torch.from_numpy(a).permute(0, 3, 1, 2).double()  # noqa: E731
    ycc = frequency.rgb_to_ycrcb(as_tensor(images), True).permute(0, 2, 3, 1).numpy()
    reference = np.stack([cv2.cvtColor(image, cv2.COLOR_RGB2YCrCb) for image in images])
    assert np.abs(ycc - reference).max() <= 1 and (ycc != reference).mean() < 0.01  # OpenCV's fixed point, 1 level
    rgb = frequency.ycrcb_to_rgb(as_tensor(reference), True).permute(0, 2, 3, 1).numpy()
    back = np.stack([cv2.cvtColor(image, cv2.COLOR_YCrCb2RGB) for image in reference])
    assert np.abs(rgb - back).max() <= 1 and (rgb != back).mean() < 0.01


def test_positions_and_channels_from_the_config_are_taken():
    """Hydra hands lists over as OmegaConf ListConfigs: a positions or channels override from the
    command line is taken, and a bad one still refused in one line showing the plain list."""
    from omegaconf import OmegaConf
    for cls in (FTrojan, CTRL):
        attack = cls(num_classes=10, image_shape=(3, 32, 32), positions=OmegaConf.create([[15, 15], [31, 31]]),
                     channels=OmegaConf.create([1, 2]))
        assert attack.positions == ((15, 15), (31, 31)) and attack.channels == (1, 2)
        with pytest.raises(ConfigError, match=r"positions=\[\[15, 32\]\] is invalid"):
            cls(num_classes=10, image_shape=(3, 32, 32), positions=OmegaConf.create([[15, 32]]))


# --- FTrojan ---------------------------------------------------------------------------------------

def test_ftrojan_is_the_official_pipeline_with_levels_rounded():
    images = smooth_images(60)
    attack = FTrojan(num_classes=10, image_shape=(3, 32, 32))
    assert (attack.window, attack.positions, attack.channels) == (32, OFFICIAL, (1, 2))
    diff = np.abs(ours(attack, images) - official_ftrojan(images))
    assert diff.max() < 2.01 and (diff > 0.5).mean() < 0.01  # OpenCV's fixed-point conversions, a level or two
    # The official truncation of the inverse DCT's floats: about half of all values a level darker.
    truncated = official_ftrojan(images, round_levels=False)
    darker = (ours(attack, images) - truncated) >= 0.5
    assert 0.3 < darker.mean() < 0.7


def test_ftrojans_trigger_sits_at_the_official_coefficients_of_the_chroma_channels():
    images = smooth_images(20, seed=3)
    attack = FTrojan(num_classes=10, image_shape=(3, 32, 32), eight_bit=False)
    x = torch.from_numpy(images).permute(0, 3, 1, 2).double()
    before = frequency.block_dct(frequency.rgb_to_ycrcb(x, False), 32)
    triggered = torch.from_numpy(ours(attack, images)).permute(0, 3, 1, 2)
    after = frequency.block_dct(frequency.rgb_to_ycrcb(triggered, False), 32)
    change = after - before
    for channel in (1, 2):
        for u, v in OFFICIAL:
            assert torch.allclose(change[:, channel, u, v], torch.full((20,), 30.0, dtype=torch.float64), atol=0.5)
    energy = change.pow(2)
    at_positions = sum(energy[:, c, u, v].sum() for c in (1, 2) for u, v in OFFICIAL)
    assert at_positions / energy.sum() > 0.99  # little leaks elsewhere (only clipping at 0 or 255 would)
    assert change[:, 0].abs().max() < 1.0  # luma untouched
    psnr = 10 * np.log10(255 ** 2 / np.mean((ours(attack, images) - images) ** 2))
    assert psnr > 40  # invisible: a couple of levels of chroma


def test_ftrojan_on_grayscale_and_other_sizes_keeps_the_positions_place_in_the_spectrum():
    mnist = FTrojan(num_classes=10, image_shape=(1, 28, 28))
    assert (mnist.window, mnist.positions, mnist.channels, mnist.yuv) == (28, ((13, 13), (27, 27)), (0,), False)
    tiny = FTrojan(num_classes=200, image_shape=(3, 64, 64))
    assert (tiny.window, tiny.positions) == (32, OFFICIAL)  # four tiles, as the official loop cuts 64 px
    x = torch.full((2, 1, 28, 28), 0.5)
    change = frequency.block_dct(mnist.apply_trigger(x).double() * 255 - 127.5, 28)
    assert change[:, 0, 13, 13].sub(30).abs().max() < 1 and change[:, 0, 27, 27].sub(30).abs().max() < 1
    assert mnist.describe()["positions"] == [[13, 13], [27, 27]]


def test_ftrojan_poisons_a_share_of_the_whole_set_and_relabels_it():
    g = torch.Generator().manual_seed(0)
    split = Split(torch.randint(0, 256, (200, 3, 32, 32), generator=g, dtype=torch.uint8), torch.arange(200) % 10)
    attack = FTrojan(num_classes=10, image_shape=(3, 32, 32), target=3)
    poisoned = attack.poison_dataset(split, torch.Generator().manual_seed(1))
    assert len(poisoned.indices) == 20 and set(split.labels[poisoned.indices].tolist()) != {3}
    assert (poisoned.split.labels[poisoned.indices] == 3).all()
    untouched = torch.ones(200, dtype=torch.bool)
    untouched[poisoned.indices] = False
    assert torch.equal(poisoned.split.images[untouched], split.images[untouched])
    all2all = FTrojan(num_classes=10, image_shape=(3, 32, 32), target_mode="all2all")
    relabelled = all2all.poison_dataset(split, torch.Generator().manual_seed(1))
    assert torch.equal(relabelled.split.labels[relabelled.indices], (split.labels[relabelled.indices] + 1) % 10)


# --- CTRL ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [32, 64])
def test_ctrl_is_the_official_float_pipeline(size):
    images = smooth_images(12, size=size, seed=size)
    attack = CTRL(num_classes=10, image_shape=(3, size, size))
    assert np.abs(ours(attack, images) - official_ctrl(images)).max() < 1e-3


def test_ctrls_trigger_sits_at_the_official_coefficients_of_u_and_v():
    images = smooth_images(20, seed=5)
    attack = CTRL(num_classes=10, image_shape=(3, 32, 32))
    as_yuv = lambda a: frequency.rgb_to_yuv_kornia(torch.from_numpy(a).permute(0, 3, 1, 2).double())  # noqa: E731
    change = frequency.block_dct(as_yuv(ours(attack, images)), 32) - frequency.block_dct(as_yuv(images.astype(float)), 32)
    energy = change.pow(2)
    at_positions = sum(energy[:, c, u, v].sum() for c in (1, 2) for u, v in OFFICIAL)
    assert at_positions / energy.sum() > 0.95  # kornia's rounded inverse leaks a little into the other coefficients
    for channel in (1, 2):
        for u, v in OFFICIAL:
            assert (change[:, channel, u, v] - 100).abs().max() < 5


def test_ctrl_is_clean_label_half_the_target_class_and_refuses_clean_label_all2all():
    labels = torch.arange(400) % 10
    split = Split(torch.randint(0, 256, (400, 3, 32, 32), generator=torch.Generator().manual_seed(2),
                                dtype=torch.uint8), labels)
    attack = CTRL(num_classes=10, image_shape=(3, 32, 32), target=0)
    poisoned = attack.poison_dataset(split, torch.Generator().manual_seed(0))
    assert len(poisoned.indices) == 20 and (labels[poisoned.indices] == 0).all()  # 0.5 of the 40 target images
    assert torch.equal(poisoned.split.labels, labels)
    with pytest.raises(ConfigError, match="all2all is not meaningful for clean-label CTRL"):
        CTRL(num_classes=10, image_shape=(3, 32, 32), target_mode="all2all")
    dirty = CTRL(num_classes=10, image_shape=(3, 32, 32), target_mode="all2all", clean_label=False)
    assert dirty.poison_rate == 0.1 and not dirty.clean_label


# --- refusals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls", [FTrojan, CTRL])
@pytest.mark.parametrize("kwargs, message", [
    (dict(magnitude=0), "attack.magnitude=0 is invalid"),
    (dict(window=5), "attack.window=5 does not tile 32x32 images; use a divisor of 32"),
    (dict(window=64), "attack.window=64 is out of range"),
    (dict(positions=[[15, 32]]), "attack.positions=[[15, 32]] is invalid"),
    (dict(positions=[15, 31]), "attack.positions=[15, 31] is invalid"),
    (dict(channels=[3]), "attack.channels=[3] is invalid for 3-channel images"),
    (dict(channels=[1, 1]), "attack.channels=[1, 1] is invalid"),
])
def test_bad_values_are_one_line(cls, kwargs, message):
    with pytest.raises(ConfigError) as err:
        cls(num_classes=10, image_shape=(3, 32, 32), **kwargs)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_to_float_images_keep_their_range():
    x = to_float(torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8))
    for attack in (FTrojan(num_classes=10, image_shape=(3, 32, 32)), CTRL(num_classes=10, image_shape=(3, 32, 32))):
        out = attack.apply_trigger(x)
        assert out.shape == x.shape and out.dtype == x.dtype and out.min() >= 0 and out.max() <= 1
