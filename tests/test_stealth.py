"""Stealth metrics: SSIM/PSNR against scikit-image, norms by hand, LPIPS with and without weights."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch
import torchvision
from skimage import data as skdata
from skimage.filters import gaussian
from skimage.metrics import peak_signal_noise_ratio, structural_similarity
from skimage.transform import resize

from backdoorbench.errors import DataError
from backdoorbench.metrics import stealth
from backdoorbench.metrics.stealth import (
    PSNR_CAP_DB,
    LpipsUnavailableWarning,
    l2_distance,
    linf_distance,
    load_lpips,
    lpips_distance,
    psnr,
    ssim,
    stealth_metrics,
)


def _real_images(channels: int, size: int) -> list[np.ndarray]:
    """Photographs from skimage.data, resized with anti-aliasing, as (C, H, W) float64 in [0, 1]."""
    if channels == 1:
        photos = [skdata.camera(), skdata.moon(), skdata.coins()]
        return [resize(p / 255.0, (size, size), anti_aliasing=True)[None] for p in photos]
    photos = [skdata.astronaut(), skdata.coffee(), skdata.chelsea()]
    return [resize(p / 255.0, (size, size), anti_aliasing=True).transpose(2, 0, 1) for p in photos]


def _pairs(channels: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Clean/poisoned pairs of every kind: noise, smooth and real images; small and large changes."""
    rng = np.random.default_rng(channels * 1000 + size)
    shape = (channels, size, size)
    noise = rng.random(shape)
    smooth = gaussian(rng.random(shape), sigma=3, channel_axis=0)
    smooth = (smooth - smooth.min()) / (smooth.max() - smooth.min())
    real_a, real_b, real_c = _real_images(channels, size)
    patch = real_a.copy()
    patch[:, -4:, -4:] = 1.0  # a BadNets-style corner patch
    clean = [noise, noise, smooth, smooth, real_a, real_a, real_a, real_b, real_c]
    poisoned = [
        np.clip(noise + 0.02 * rng.standard_normal(shape), 0, 1),  # a little
        rng.random(shape),  # a lot: independent noise
        np.clip(smooth + 0.05 * rng.standard_normal(shape), 0, 1),
        0.8 * smooth + 0.2 * noise,  # blended trigger
        patch,
        real_b,  # a lot: another photograph
        np.clip(real_a + 4 / 255 * np.sign(rng.standard_normal(shape)), 0, 1),  # an eps=4/255 perturbation
        real_b,  # identical
        1 - real_c,
    ]
    return torch.tensor(np.stack(clean)), torch.tensor(np.stack(poisoned))


@pytest.mark.parametrize("gaussian_weights", [False, True], ids=["uniform7", "gaussian11"])
@pytest.mark.parametrize("size", [28, 32, 64])
@pytest.mark.parametrize("channels", [1, 3], ids=["gray", "color"])
def test_ssim_matches_scikit_image(channels: int, size: int, gaussian_weights: bool) -> None:
    clean, poisoned = _pairs(channels, size)
    ours = ssim(clean, poisoned, gaussian_weights=gaussian_weights, batch_size=4)  # several batches
    options = {"gaussian_weights": True, "sigma": 1.5, "use_sample_covariance": False} if gaussian_weights else {}
    reference = []
    for a, b in zip(clean.numpy(), poisoned.numpy()):
        if channels == 1:
            reference.append(structural_similarity(a[0], b[0], data_range=1, **options))
        else:
            reference.append(structural_similarity(a, b, data_range=1, channel_axis=0, **options))
    np.testing.assert_allclose(ours.numpy(), reference, atol=1e-4, rtol=0)
    # The pairs really span the scale, so the match is not a match of constants.
    assert max(reference) > 0.999 and min(reference) < 0.3


def test_ssim_float32_input_and_too_small_images() -> None:
    clean, poisoned = _pairs(3, 32)
    np.testing.assert_allclose(ssim(clean.float(), poisoned.float()).numpy(), ssim(clean, poisoned).numpy(), atol=1e-6)
    with pytest.raises(DataError, match="at least 7x7"):
        ssim(torch.zeros(1, 1, 6, 6), torch.zeros(1, 1, 6, 6))


@pytest.mark.parametrize("channels", [1, 3])
def test_psnr_matches_scikit_image(channels: int) -> None:
    clean, poisoned = _pairs(channels, 32)
    ours = psnr(clean, poisoned).numpy()
    with np.errstate(divide="ignore"):
        reference = np.array([peak_signal_noise_ratio(a, b, data_range=1) for a, b in zip(clean.numpy(), poisoned.numpy())])
    finite = np.isfinite(reference)
    assert (~finite).sum() == 1  # the identical pair
    np.testing.assert_allclose(ours[finite], reference[finite], rtol=1e-10)
    assert ours[~finite] == PSNR_CAP_DB


def test_norms_and_summary_by_hand() -> None:
    # Two black 1x16x16 images; poisoned with a white 2x2 and a white 4x4 patch.
    clean = torch.zeros(2, 1, 16, 16)
    poisoned = clean.clone()
    poisoned[0, :, :2, :2] = 1.0
    poisoned[1, :, :4, :4] = 0.5
    assert linf_distance(clean, poisoned).tolist() == [1.0, 0.5]
    assert l2_distance(clean, poisoned).tolist() == pytest.approx([2.0, math.sqrt(16 * 0.25)])
    assert psnr(clean, poisoned).tolist() == pytest.approx([10 * math.log10(256 / 4), 10 * math.log10(256 / 4)])
    with pytest.warns(LpipsUnavailableWarning):
        result = stealth_metrics(clean, poisoned)
    assert result["n"] == 2 and result["n_psnr_capped"] == 0
    assert result["linf"] == pytest.approx({"mean": 0.75, "std": 0.25})  # population std
    assert result["l2"] == pytest.approx({"mean": 2.0, "std": 0.0})
    assert result["psnr"]["mean"] == pytest.approx(10 * math.log10(64))


def test_identical_images_give_valid_json(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    monkeypatch.delenv(stealth.LPIPS_WEIGHTS_ENV, raising=False)
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with pytest.warns(LpipsUnavailableWarning):
        result = stealth_metrics(images, images.clone())
    assert result["psnr"] == {"mean": PSNR_CAP_DB, "std": 0.0}
    assert result["n_psnr_capped"] == 3
    assert result["ssim"]["mean"] == pytest.approx(1.0, abs=1e-12)
    assert result["linf"] == {"mean": 0.0, "std": 0.0} and result["l2"] == {"mean": 0.0, "std": 0.0}
    assert json.loads(json.dumps(result, allow_nan=False)) == result
    for key in ("psnr", "ssim", "linf", "l2"):
        assert all(type(v) is float for v in result[key].values())


@pytest.mark.parametrize(
    ("clean", "poisoned", "message"),
    [
        (torch.zeros(2, 1, 8, 8), torch.full((2, 1, 8, 8), 1.5), r"poisoned images must lie in \[0, 1\], got values in \[1.5, 1.5\]"),
        (torch.zeros(2, 1, 8, 8), torch.full((2, 1, 8, 8), float("nan")), "poisoned images must lie in"),
        (torch.zeros(2, 1, 8, 8), torch.zeros(2, 1, 8, 9), "same shape"),
        (torch.zeros(1, 8, 8), torch.zeros(1, 8, 8), r"shape \(N, C, H, W\)"),
        (torch.zeros(0, 1, 8, 8), torch.zeros(0, 1, 8, 8), "at least one image pair"),
        (torch.zeros(1, 1, 8, 8, dtype=torch.int32), torch.zeros(1, 1, 8, 8), "float in"),
    ],
)
def test_bad_input_is_one_line_data_error(clean, poisoned, message) -> None:
    with pytest.raises(DataError, match=message) as info:
        stealth_metrics(clean, poisoned)
    assert "\n" not in str(info.value)


def test_uint8_images_are_read_as_pixels_over_255() -> None:
    clean = torch.zeros(1, 1, 8, 8, dtype=torch.uint8)
    poisoned = clean.clone()
    poisoned[0, 0, 0, 0] = 255
    assert linf_distance(clean, poisoned).item() == 1.0


# ----------------------------------------------------------------------------- LPIPS


@pytest.fixture(autouse=True)
def no_lpips_weights_on_machine(monkeypatch: pytest.MonkeyPatch, tmp_path_factory):
    """Every test sees an empty torch hub and no env var, unless it sets them."""
    empty = tmp_path_factory.mktemp("hub")
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(empty))
    monkeypatch.delenv(stealth.LPIPS_WEIGHTS_ENV, raising=False)
    return empty


@pytest.fixture(scope="module")
def standin_alexnet(tmp_path_factory):
    """A seeded, untrained torchvision AlexNet standing in for the ImageNet weights (features only,
    with torchvision's key names, to keep the file small)."""
    with torch.device("meta"):  # the classifier's 58M parameters would take seconds to initialise
        features = torchvision.models.alexnet(weights=None).features
    features = features.to_empty(device="cpu")
    torch.manual_seed(0)
    for layer in features:
        if hasattr(layer, "reset_parameters"):
            layer.reset_parameters()  # torchvision's AlexNet keeps PyTorch's default conv init
    path = tmp_path_factory.mktemp("weights") / stealth.ALEXNET_FILE
    torch.save({f"features.{k}": v for k, v in features.state_dict().items()}, path)
    return path


def test_lpips_absent_is_none_with_reason_and_one_warning(no_lpips_weights_on_machine) -> None:
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = stealth_metrics(images, images.flip(-1))
    lpips_warnings = [w for w in caught if issubclass(w.category, LpipsUnavailableWarning)]
    assert len(lpips_warnings) == 1 and len(caught) == 1
    expected_path = str(no_lpips_weights_on_machine / "checkpoints" / stealth.ALEXNET_FILE)
    assert expected_path in str(lpips_warnings[0].message)
    assert result["lpips"] is None
    assert expected_path in result["lpips_reason"] and stealth.LPIPS_WEIGHTS_ENV in result["lpips_reason"]
    assert result["ssim"] is not None and result["psnr"]["mean"] < PSNR_CAP_DB  # the rest is still measured


def test_lpips_configured_path_missing_is_data_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    images = torch.rand(1, 3, 32, 32)
    with pytest.raises(DataError, match="eval.lpips=.*nope.pth.* is not a file"):
        stealth_metrics(images, images, lpips=tmp_path / "nope.pth")
    monkeypatch.setenv(stealth.LPIPS_WEIGHTS_ENV, str(tmp_path / "gone.pth"))
    with pytest.raises(DataError, match=f"{stealth.LPIPS_WEIGHTS_ENV}=.*gone.pth"):
        stealth_metrics(images, images)


def test_lpips_with_weights_file(standin_alexnet) -> None:
    g = torch.Generator().manual_seed(2)
    clean = torch.rand(6, 3, 32, 32, generator=g)
    near = (clean + 0.03 * torch.randn(clean.shape, generator=g)).clamp(0, 1)
    far = (clean + 0.3 * torch.randn(clean.shape, generator=g)).clamp(0, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all when the weights are there
        same = stealth_metrics(clean, clean.clone(), lpips=standin_alexnet)
        small = stealth_metrics(clean, near, lpips=standin_alexnet)
        large = stealth_metrics(clean, far, lpips=standin_alexnet)
    assert same["lpips"] == {"mean": 0.0, "std": 0.0} and same["lpips_reason"] is None
    assert 0 < small["lpips"]["mean"] < large["lpips"]["mean"]
    assert all(math.isfinite(v) for v in (*small["lpips"].values(), *large["lpips"].values()))
    assert large["settings"]["lpips_input_size"] == [32, 32]


def test_lpips_uses_the_file_weights_not_a_random_trunk(standin_alexnet) -> None:
    import lpips

    model = load_lpips(standin_alexnet)
    saved = torch.load(standin_alexnet, weights_only=True)
    for name, param in model.net.state_dict().items():
        torch.testing.assert_close(param, saved[f"features.{name.split('.', 1)[1]}"], rtol=0, atol=0)
    shipped = torch.load(f"{lpips.__path__[0]}/weights/v0.1/alex.pth", map_location="cpu", weights_only=True)
    for name, param in shipped.items():
        torch.testing.assert_close(model.state_dict()[name], param, rtol=0, atol=0)
    assert not model.training


def test_lpips_sees_inputs_scaled_to_minus_one_one(standin_alexnet) -> None:
    model = load_lpips(standin_alexnet)
    seen = []
    handle = model.scaling_layer.register_forward_pre_hook(lambda _, args: seen.append(args[0].clone()))
    try:
        clean = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
        clean[:, :, 0, 0], clean[:, :, 0, 1] = 0.0, 1.0
        poisoned = clean.flip(-1)
        ours = lpips_distance(clean, poisoned, model)
    finally:
        handle.remove()
    assert seen[0].min().item() == -1.0 and seen[0].max().item() == 1.0
    torch.testing.assert_close(seen[0], clean * 2 - 1)
    with torch.no_grad():
        reference = model(clean, poisoned, normalize=True).flatten().double()  # lpips' own [0,1] -> [-1,1]
    torch.testing.assert_close(ours, reference)


def test_lpips_found_through_env_var_and_hub_cache(standin_alexnet, monkeypatch, no_lpips_weights_on_machine) -> None:
    g = torch.Generator().manual_seed(4)
    clean = torch.rand(3, 1, 28, 28, generator=g)  # gray MNIST-sized: repeated to RGB, upsampled to 32
    poisoned = (clean + 0.1 * torch.randn(clean.shape, generator=g)).clamp(0, 1)
    direct = stealth_metrics(clean, poisoned, lpips=standin_alexnet)
    assert direct["settings"]["lpips_input_size"] == [32, 32]
    monkeypatch.setenv(stealth.LPIPS_WEIGHTS_ENV, str(standin_alexnet))
    assert stealth_metrics(clean, poisoned)["lpips"] == direct["lpips"]
    monkeypatch.delenv(stealth.LPIPS_WEIGHTS_ENV)
    hub = no_lpips_weights_on_machine / "checkpoints"
    hub.mkdir()
    (hub / stealth.ALEXNET_FILE).write_bytes(standin_alexnet.read_bytes())
    assert stealth_metrics(clean, poisoned)["lpips"] == pytest.approx(direct["lpips"], abs=1e-7)


def test_lpips_bad_weights_file_is_one_line_data_error(tmp_path) -> None:
    images = torch.rand(1, 3, 32, 32)
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"PK\x03\x04 this is not a checkpoint")
    wrong = tmp_path / "wrong.pth"
    torch.save({"features.0.weight": torch.zeros(8, 3, 3, 3)}, wrong)
    pickled = tmp_path / "pickled.pth"
    torch.save({"features.0": torch.nn.Conv2d(3, 64, 11)}, pickled)  # a pickled module: weights_only refuses it
    for path, message in ((corrupt, "cannot be read"), (wrong, r"features.0.weight should have shape \(64, 3, 11, 11\)"),
                          (pickled, "cannot be read")):
        with pytest.raises(DataError, match=message) as info:
            stealth_metrics(images, images, lpips=path)
        assert "\n" not in str(info.value) and str(path) in str(info.value)
