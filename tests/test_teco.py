"""TeCo (Liu et al., CVPR 2023): the corruptions against the imagecorruptions tables and reference
computations, the first-flip deviation of hand-made predictions, and the defining property on a
small backdoored model: triggered inputs flip at very different severities across corruptions."""

from __future__ import annotations

import io
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from backdoorbench.attacks.badnets import BadNets
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses import corruptions as C
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.runner import run_defense
from backdoorbench.defenses.teco import Teco, deviation, first_flips
from backdoorbench.errors import ConfigError
from backdoorbench.models.base import Normalized
from tests.test_defenses_detect import SHAPE, TinyNet, context, quadrant_data, tiny_trainer
from tests.tiny import ZOO, zoo_model


def smooth_images(n: int, size: int = 32, channels: int = 3, seed: int = 0) -> np.ndarray:
    """(n, H, W, C) uint8 images with some structure (blurred noise stretched to 0..255)."""
    from scipy.ndimage import gaussian_filter
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        img = gaussian_filter(rng.random((size, size, channels)) * 255, (1.5, 1.5, 0))
        out.append(np.uint8((img - img.min()) / (img.max() - img.min()) * 255))
    return np.stack(out)


def as_tensor(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images).permute(0, 3, 1, 2).double() / 255


def as_uint8(x: torch.Tensor) -> np.ndarray:
    return (x.permute(0, 2, 3, 1) * 255).round().numpy().astype(np.int64)


def test_severity_tables_are_the_packages():
    # imagecorruptions v1.1.2, imagecorruptions/corruptions.py
    assert C.GAUSSIAN_NOISE == (0.08, 0.12, 0.18, 0.26, 0.38)
    assert C.SHOT_NOISE == (60, 25, 12, 5, 3)
    assert C.IMPULSE_NOISE == (0.03, 0.06, 0.09, 0.17, 0.27)
    assert C.DEFOCUS_BLUR[2] == (6, 0.5) and C.GLASS_BLUR[4] == (1.5, 4, 2) and C.MOTION_BLUR[0] == (10, 3)
    assert C.CONTRAST == (0.4, 0.3, 0.2, 0.1, 0.05) and C.BRIGHTNESS == (0.1, 0.2, 0.3, 0.4, 0.5)
    assert C.PIXELATE == (0.6, 0.5, 0.4, 0.3, 0.25) and C.JPEG_QUALITY == (25, 18, 15, 10, 7)
    assert C.ELASTIC_ALPHA[3] == 25.0 and C.FOG[4] == (3.0, 1.4) and C.SNOW[3] == (0.55, 0.3, 4.5, 0.85, 12, 8, 0.65)
    # np.arange(1, 1.31, 0.03): eleven zooms 1.00 .. 1.30
    assert len(np.arange(*C.ZOOM_BLUR[4])) == 11
    assert C.COMMON == ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
                        "zoom_blur", "snow", "fog", "brightness", "contrast", "elastic_transform", "pixelate",
                        "jpeg_compression") and "frost" in C.OMITTED


def test_deterministic_corruptions_match_reference_computations():
    images = smooth_images(2)
    x = as_tensor(images)
    g = torch.Generator().manual_seed(0)
    for severity in (1, 3, 5):
        # contrast: (x - per-channel mean) * c + mean, clipped, floored to uint8
        c = C.CONTRAST[severity - 1]
        f = images / 255.0
        means = f.mean(axis=(1, 2), keepdims=True)
        expected = np.uint8(np.clip((f - means) * c + means, 0, 1) * 255)
        assert (as_uint8(C.contrast(x, severity, g)) == expected).all()
        # pixelate and jpeg: PIL itself
        for k, img in enumerate(images):
            pil = Image.fromarray(img)
            size = int(32 * C.PIXELATE[severity - 1])
            small = pil.resize((size, size), Image.BOX).resize((32, 32), Image.NEAREST)
            assert (as_uint8(C.pixelate(x[k : k + 1], severity, g))[0] == np.array(small)).all()
            buffer = io.BytesIO()
            pil.save(buffer, "JPEG", quality=C.JPEG_QUALITY[severity - 1])
            assert (as_uint8(C.jpeg_compression(x[k : k + 1], severity, g))[0] == np.array(Image.open(buffer))).all()
    # brightness: V of HSV raised by c (skimage), equal up to one level of float rounding
    from skimage.color import hsv2rgb, rgb2hsv
    hsv = rgb2hsv(images[0] / 255.0)
    hsv[..., 2] = np.clip(hsv[..., 2] + 0.3, 0, 1)
    expected = np.uint8(np.clip(hsv2rgb(hsv), 0, 1) * 255).astype(np.int64)
    ours = as_uint8(C.brightness(x[:1], 3, g))[0]
    assert np.abs(ours - expected).max() <= 1 and (ours != expected).mean() < 0.02


def test_blur_kernels_match_scipy_and_opencv():
    cv2 = pytest.importorskip("cv2")
    from scipy.ndimage import gaussian_filter, zoom

    # the disk of defocus_blur: cv2.GaussianBlur of the normalised float32 disk
    L = np.arange(-8, 9)
    X, Y = np.meshgrid(L, L)
    disk = np.array(X**2 + Y**2 <= 6**2, dtype=np.float32)
    disk /= disk.sum()
    assert np.allclose(C.disk_kernel(6, 0.5).numpy(), cv2.GaussianBlur(disk, (3, 3), sigmaX=0.5), atol=1e-7)
    images = smooth_images(1)
    x = as_tensor(images)
    f = images[0] / 255.0
    expected = np.stack([cv2.filter2D(f[..., d], -1, C.disk_kernel(6, 0.5).numpy()) for d in range(3)], -1)
    ours = C.defocus_blur(x, 3, torch.Generator())
    assert (as_uint8(ours)[0] == np.uint8(np.clip(expected, 0, 1) * 255)).all()
    # skimage's gaussian (scipy, mode 'nearest', truncate 4)
    assert np.allclose(C.gaussian_filter(x[0], (1.1, 1.1)).permute(1, 2, 0).numpy(),
                       gaussian_filter(f, (1.1, 1.1, 0), mode="nearest", truncate=4.0), atol=1e-12)
    # clipped_zoom: the centre ceil(32 / z) pixels zoomed by scipy (order 1), its top-left 32 x 32
    for factor in (1.06, 1.2, 1.3):
        m = int(np.ceil(32 / factor))
        top = (32 - m) // 2
        expected = zoom(f[top : top + m, top : top + m], (factor, factor, 1), order=1)[:32, :32]
        ours = C.clipped_zoom(x[0], factor)[:, :32, :32].permute(1, 2, 0).numpy()
        assert np.allclose(ours, expected, atol=1e-9)


def test_random_corruptions_have_the_packages_strength_and_any_size():
    x = as_tensor(smooth_images(64, seed=1))
    g = torch.Generator().manual_seed(0)
    # gaussian noise of sigma c (before clipping): the residual's std away from the clip
    mid = (x > 0.3) & (x < 0.7)
    for severity, c in ((1, 0.08), (3, 0.18)):
        residual = (C.gaussian_noise(x, severity, g) - x)[mid]
        assert float(residual.std()) == pytest.approx(c, rel=0.08)
    # impulse noise: a share `amount` of values set to 0 or 1
    moved = (C.impulse_noise(x, 4, g) != C.quantise(x)).double().mean()
    assert float(moved) == pytest.approx(0.17, abs=0.02)
    # every corruption: same shape, [0, 1], multiples of 1/255, also on one channel and 8 or 28 pixels
    for shape in ((2, 3, 32, 32), (2, 1, 28, 28), (2, 1, 8, 8)):
        y = torch.rand(shape, generator=g)
        for name in C.COMMON:
            for severity in (1, 5):
                out = C.corrupt(y, name, severity, g)
                assert out.shape == y.shape and (out >= 0).all() and (out <= 1).all(), name
                assert torch.allclose(out * 255, (out * 255).round(), atol=1e-4), name
                assert not torch.equal(out, y), name


def test_first_flips_and_deviation_by_hand():
    # one input, original prediction 2; three corruptions over severities 1..5
    original = torch.tensor([2])
    predictions = torch.tensor([[[2, 2, 1, 1, 0],    # first flip at severity 3
                                 [2, 2, 2, 2, 2],    # never: 6 (the official args.max)
                                 [0, 2, 2, 2, 2]]])  # severity 1
    flips = first_flips(original, predictions, [1, 2, 3, 4, 5])
    assert flips.tolist() == [[3.0, 6.0, 1.0]]
    # np.std([3, 6, 1]): mean 10/3, population variance ((1/3)^2 + (8/3)^2 + (7/3)^2) / 3 = 114 / 27
    assert deviation(flips).item() == pytest.approx(math.sqrt(114 / 27))
    # a subset of severities: never flipped counts as max + 1
    assert first_flips(original, predictions[..., [0, 2, 4]], [1, 3, 5]).tolist() == [[3.0, 6.0, 1.0]]
    assert first_flips(original, predictions[..., :2], [1, 2]).tolist() == [[3.0, 3.0, 1.0]]


class FlipAt(torch.nn.Module):
    """Predicts 1 while the image's mean stays within 0.02 of 0.5, else 0: a hand-checkable model."""
    def forward(self, x):
        near = ((x.flatten(1).mean(1) - 0.5).abs() < 0.02).float()
        return torch.stack([1 - near, near], 1)


def test_scores_of_a_hand_made_case():
    # a uniform gray image of 0.5: contrast keeps the mean (never flips: 6); brightness +0.1 moves it
    # at severity 1; everything else tested here either
    x = torch.full((1, 1, 32, 32), 128 / 255)
    detector = Teco(corruptions=["contrast", "brightness"])
    flips = detector.flips(FlipAt(), x)
    assert flips.tolist() == [[6.0, 1.0]]
    assert detector.score_inputs(FlipAt(), x).item() == pytest.approx(2.5)  # std of [6, 1]


def test_threshold_rejects_at_most_frr_of_the_clean_subset():
    images = torch.randint(0, 256, (40, 1, 32, 32), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    clean = Split(images, torch.zeros(40, dtype=torch.long))
    model = Normalized(TinyNet(2), (0.5,), (0.25,)).eval()
    ctx = DefenseContext(model=model, poisoned_train=clean, poisoned_indices=torch.arange(0), clean_subset=clean,
                         trainer=tiny_trainer(1), num_classes=2, generator=torch.Generator().manual_seed(0))
    detector = Teco(corruptions=["gaussian_noise", "contrast", "pixelate"], frr=0.1)
    extras = detector.apply(ctx).extras
    assert extras["n_calibration"] == 40 and extras["calibration_frr"] <= 0.1 and math.isfinite(detector.threshold)


@pytest.fixture(scope="module")
def backdoored():
    """A 4-class toy whose class is a bright quadrant, BadNets' 3x3 checkerboard planted (target 0)."""
    torch.manual_seed(0)
    attack = BadNets(num_classes=4, image_shape=SHAPE, patch_size=3, poison_rate=0.1, target=0)
    poisoned = attack.poison_dataset(quadrant_data(400, seed=0), torch.Generator().manual_seed(0))
    model = Normalized(TinyNet(4), (0.3,), (0.3,))
    tiny_trainer(6).fit(model, poisoned.split, generator=torch.Generator().manual_seed(0))
    return model.eval(), attack, poisoned


def test_triggered_inputs_flip_inconsistently_across_corruptions_and_are_flagged(backdoored):
    model, attack, poisoned = backdoored
    test = quadrant_data(120, seed=5)
    x = to_float(test.images)
    triggered = attack.apply_trigger(x[test.labels != 0])
    detector = Teco()
    clean_flips, bad_flips = detector.flips(model, x), detector.flips(model, triggered)
    # the mechanism: the checkerboard survives noise (never flips) and dies under blur and
    # pixelation (severity 1), so the triggered inputs' severities spread across corruptions
    names = list(detector.corruptions)
    for robust in ("gaussian_noise", "brightness"):
        assert bad_flips[:, names.index(robust)].mean() > 5.5
    for fragile in ("defocus_blur", "glass_blur", "pixelate"):
        assert bad_flips[:, names.index(fragile)].mean() < 1.5
    assert deviation(bad_flips).mean() > 1.5 * deviation(clean_flips).mean()
    outcome = run_defense(detector, context(model, poisoned, quadrant_data(80, seed=7)), attack, test)
    assert outcome.detection["auroc"] > 0.95, outcome.detection
    assert outcome.detection["tpr"] > 0.8 and outcome.detection["fpr"] < 0.2, outcome.detection
    assert outcome.cost["per_input_forward_images"] == 1 + 14 * 5
    # the official in-place composition on this toy: garbage after a few corruptions is read as
    # the target, so triggered inputs never flip and the deviation no longer separates them
    chained = Teco(chained=True)
    assert deviation(chained.flips(model, triggered)).mean() < deviation(chained.flips(model, x)).mean()


def test_bad_values_are_refused_in_one_line():
    for kwargs, fragment in ((dict(corruptions=["frost", "snow"]), "frost is left out"),
                             (dict(corruptions=["snow"]), "two or more distinct"),
                             (dict(corruptions="snow"), "defense.corruptions='snow' is invalid"),
                             (dict(severities=[0, 1]), "defense.severities=[0, 1] is invalid"),
                             (dict(severities=[3, 1]), "increasing integers in 1..5"),
                             (dict(frr=0), "defense.frr=0"),
                             (dict(chained="yes"), "defense.chained='yes' is invalid; use true or false")):
        with pytest.raises(ConfigError) as info:
            Teco(**kwargs)
        assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_teco_scores_inputs_of_every_model_of_the_zoo(name, shape, classes, kwargs):
    model = zoo_model(name, shape, classes, kwargs)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (3, *shape), dtype=torch.uint8, generator=g)
    ctx = DefenseContext(model=model, poisoned_train=Split(data, torch.zeros(3, dtype=torch.long)),
                         poisoned_indices=torch.arange(0), clean_subset=Split(data, torch.arange(3) % classes),
                         trainer=SimpleNamespace(device=torch.device("cpu"), eval_batch_size=3, prepare=lambda m: m,
                                                 autocast=lambda: torch.autocast("cpu", enabled=False)),
                         num_classes=classes, generator=g)
    detector = Teco(corruptions=["gaussian_noise", "defocus_blur", "pixelate"], severities=[1, 5])
    assert detector.apply(ctx).extras["n_calibration"] == 3
    scores = detector.score_inputs(model, data[:2].float() / 255)
    assert scores.shape == (2,) and torch.isfinite(scores).all() and math.isfinite(detector.threshold)
