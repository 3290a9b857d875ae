"""LF (Zeng, Park, Mao, Jia, ICCV 2021): a smooth universal adversarial perturbation of a clean model.
The filter against the official gauss_smooth, the crafted perturbation low-pass (its spectrum above
the filter's cutoff ~0, torch.fft), universal (one v fools most held-out images) and the same on
every image; BackdoorBench's pre-made files read as BackdoorBench reads them, never unpickled; the
clean control taken from the victim cache and said so in the record."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from backdoorbench.attacks.lf import LowFrequency, gauss_smooth, gaussian_taps, load_resource, targeted_deepfool
from backdoorbench.datasets.base import Split
from backdoorbench.errors import ConfigError, DataError
from tests.tiny import one_thread  # noqa: F401  (autouse)

SHAPE = (1, 32, 32)
# The Gaussian's response exp(-2 pi^2 sigma^2 f^2) is below 1e-3 above 0.0985 cycles/px at sigma = 6.
CUTOFF = 0.1


def high_frequency_share(v: torch.Tensor, cutoff: float = CUTOFF) -> float:
    """The share of a perturbation's (C, H, W) spectral energy above `cutoff` cycles/px (its mean
    removed, a Hann window against the edges' leakage), by torch.fft."""
    v = v.double() - v.double().mean((1, 2), keepdim=True)
    window = torch.hann_window(v.shape[-1], periodic=False, dtype=torch.float64)
    power = torch.fft.fft2(v * window[:, None] * window[None, :]).abs() ** 2
    f = torch.fft.fftfreq(v.shape[-1], dtype=torch.float64)
    radius = (f[:, None] ** 2 + f[None, :] ** 2).sqrt()
    return float(power[:, radius > cutoff].sum() / power.sum())


def official_gauss_smooth(image: np.ndarray, sig: float = 6) -> np.ndarray:
    """The official gauss_smooth (Sec5_Smooth_Trigger/gauss_smooth.py) on an (H, W, C) array, in
    numpy: its kernel formula, zero padding (before = after - 1 for an even size), columns then rows."""
    size_denom = 5.0
    sigma = sig * size_denom
    size = int(sigma)
    grid = (np.arange(size, dtype=np.float64) - (size - 1) / 2) * size_denom
    kernel = np.exp(-((grid / sigma) ** 2) * 0.5) / (sigma * math.sqrt(2 * math.pi))
    kernel /= kernel.sum()
    after = size // 2
    before = after - (1 - size % 2)
    padded = np.pad(image, ((before, after), (before, after), (0, 0)))
    cols = np.stack([np.apply_along_axis(lambda s: np.correlate(s, kernel, "valid"), 0, padded[..., c])
                     for c in range(image.shape[2])], -1)
    return np.stack([np.apply_along_axis(lambda s: np.correlate(s, kernel, "valid"), 1, cols[..., c])
                     for c in range(image.shape[2])], -1)


def test_the_low_pass_filter_is_the_official_gauss_smooth():
    rng = np.random.default_rng(0)
    image = rng.normal(size=(32, 32, 3))
    ours = gauss_smooth(torch.tensor(image).permute(2, 0, 1), 6.0).permute(1, 2, 0).numpy()
    assert np.allclose(ours, official_gauss_smooth(image), atol=1e-12)
    assert len(gaussian_taps(6.0)) == 30  # sig * size_denom taps
    # its frequency response: a Gaussian of std 6 px, cut at +-2.4 std (30 taps): its side lobes above
    # the cutoff stay under 1% in amplitude (1e-4 of the energy)
    response = torch.fft.rfft(torch.cat([gaussian_taps(6.0), torch.zeros(226, dtype=torch.float64)])).abs()
    f = torch.fft.rfftfreq(256, dtype=torch.float64)
    assert float(response[f > CUTOFF].max()) < 0.01 and float(response[0]) == pytest.approx(1.0)


class Toy(nn.Module):
    """Two classes, 1 = bright: the logit gap is 40 (mean - 0.45) plus a checkerboard term, so a raw
    DeepFool step is all high frequency; only its smooth part survives the filter."""

    def __init__(self) -> None:
        super().__init__()
        side = SHAPE[1]
        self.register_buffer("board", ((torch.arange(side)[:, None] + torch.arange(side)[None, :]) % 2 * 2 - 1).float())
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        gap = self.scale * (40 * (x.mean((1, 2, 3)) - 0.45) + 20 * (x[:, 0] * self.board).mean((1, 2)))
        return torch.stack([torch.zeros_like(gap), gap], 1)


def dark_images(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    level = 0.3 + 0.14 * torch.rand(n, 1, 1, 1, generator=g)
    return (level + 0.05 * torch.randn(n, *SHAPE, generator=g)).clamp(0, 1)


class CPUTrainer:
    device = torch.device("cpu")
    epochs = 1


def crafted(**overrides) -> tuple[LowFrequency, Toy]:
    model = Toy()
    attack = LowFrequency(**{"num_classes": 2, "image_shape": SHAPE, "target": 1, "craft_images": 20,
                             "fooling_rate": 0.9, **overrides})
    train = Split((dark_images(40, 0) * 255).round().to(torch.uint8), torch.zeros(40, dtype=torch.long))
    attack.prepare(trainer=CPUTrainer(), train=train, generator=torch.Generator().manual_seed(1), build_model=None,
                   clean_model=lambda: (model, {"cache": "hit", "key": "0123abcd"}))
    return attack, model


def test_the_perturbation_is_low_pass_universal_and_the_same_for_every_image():
    attack, model = crafted()
    v = attack.pattern
    raw, steps = targeted_deepfool(model, dark_images(1, 5)[0], 1, overshoot=0.02, steps=200)
    assert steps >= 1 and high_frequency_share(raw) > 0.9  # what DeepFool alone would add
    assert high_frequency_share(v) < 1e-3  # what the filter leaves: ~0 above the cutoff
    # [0, 0.2] in 8-bit levels: 0 to 51, BackdoorBench's files' range
    levels = v * 255
    assert float(levels.min()) == 0 and float(levels.max()) == 51 and torch.equal(levels, levels.round())
    # universal: one v moves most held-out dark images to the target
    held = dark_images(200, 7)
    with torch.no_grad():
        assert bool((model(held).argmax(1) == 0).all())
        fooled = float((model(attack.apply_trigger(held)).argmax(1) == 1).float().mean())
    assert fooled > 0.5
    # the same for every image: x + v wherever the clip does not bite
    moved = attack.apply_trigger(held) - held
    inside = held + v < 1
    assert torch.allclose(moved[inside], v.expand_as(held)[inside], atol=1e-6)
    # the record says where the clean model came from
    assert attack.describe()["surrogate"] == "clean_control" and attack.stats["surrogate_cache"] == "hit"
    assert attack.stats["craft_target"] == 1 and attack.stats["passes"] >= 1


def test_deepfool_is_one_linear_step_on_a_linear_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(32 * 32, 3))
    x = torch.rand(*SHAPE)
    with torch.no_grad():
        logits = model(x[None])[0]
    top = int(logits.argmax())
    target = (top + 1) % 3
    r, steps = targeted_deepfool(model, x, target, overshoot=0.02, steps=200)
    w = (model[1].weight[target] - model[1].weight[top]).detach().view(SHAPE)
    gap = float(logits[target] - logits[top])
    expected = 1.02 * abs(gap) / float(w.flatten() @ w.flatten()) * w
    assert steps == 1 and torch.allclose(r, expected, atol=1e-6)
    assert int(model((x + r)[None]).argmax()) == target


class Deaf(nn.Module):
    """Says class 0 whatever it sees: no DeepFool step can reach class 1."""

    def forward(self, x):
        return torch.stack([torch.ones(len(x)), torch.zeros(len(x))], 1) + 0 * x.flatten(1).sum(1, keepdim=True)


def test_no_perturbation_at_all_is_one_line_not_an_empty_trigger():
    attack = LowFrequency(num_classes=2, image_shape=SHAPE, target=1, craft_images=4, max_passes=2, deepfool_steps=5)
    with pytest.raises(ConfigError) as info:
        attack.craft(Deaf(), dark_images(4, 0), torch.Generator().manual_seed(0))
    assert "DeepFool reached target 1 within attack.deepfool_steps=5 on none of the 4 crafting images" in str(info.value)
    assert "\n" not in str(info.value) and attack.pattern is None


def test_prepare_state_round_trips_and_a_wrong_state_is_refused():
    attack, _ = crafted(max_passes=1)
    fresh = LowFrequency(num_classes=2, image_shape=SHAPE, target=1)
    fresh.load_prepare_state(attack.prepare_state())
    assert torch.equal(fresh.pattern, attack.pattern) and fresh.stats == attack.stats
    with pytest.raises(DataError, match=r"expected \(1, 32, 32\)"):
        fresh.load_state_dict({"pattern": torch.zeros(3, 32, 32)})


# ------------------------------------------------------------------------ BackdoorBench's files


def test_a_backdoorbench_file_is_added_as_backdoorbench_adds_it(tmp_path):
    rng = np.random.default_rng(0)
    levels = rng.integers(0, 52, size=(32, 32, 3)).astype(np.uint8)  # the shipped files: uint8, 0-51, (H, W, C)
    np.save(tmp_path / "cifar10_preactresnet18_0_255.npy", levels)
    attack = LowFrequency(num_classes=10, image_shape=(3, 32, 32), resource=str(tmp_path / "cifar10_preactresnet18_0_255.npy"))
    x = torch.rand(4, 3, 32, 32)
    expected = np.clip(np.round(x.permute(0, 2, 3, 1).numpy() * 255) + levels, 0, 255) / 255
    out = (attack.apply_trigger(torch.round(x * 255) / 255) * 255).round() / 255
    assert np.allclose(out.permute(0, 2, 3, 1).numpy(), expected, atol=1e-6)
    assert attack.stats["surrogate"] == "resource" and len(attack.stats["resource_sha256"]) == 64
    attack.prepare(trainer=CPUTrainer(), train=Split(torch.zeros(20, 3, 32, 32, dtype=torch.uint8),
                                                      torch.arange(20) % 10),
                   generator=torch.Generator(), build_model=None)  # nothing to craft
    # a 4-D file gives its first element; a 2-D one is repeated over the channels
    np.save(tmp_path / "batch.npy", levels[None])
    np.save(tmp_path / "gray.npy", levels[..., 0])
    assert torch.equal(load_resource(str(tmp_path / "batch.npy"), (3, 32, 32)), attack.pattern)
    assert torch.equal(load_resource(str(tmp_path / "gray.npy"), (1, 32, 32))[0], attack.pattern[0])


@pytest.mark.parametrize("content, message", [
    (np.zeros((28, 28, 3), dtype=np.uint8), "has shape (28, 28, 3); expected (32, 32, 3)"),
    (np.zeros((32, 32, 1), dtype=np.uint8), "has shape (32, 32, 1); expected (32, 32, 3)"),
    (np.zeros((1, 32, 32, 3), dtype=np.float32) + 0.2, "changes no pixel"),  # BackdoorBench's [0, 1]-unit float files
    (np.array([{"a": 1}], dtype=object), "cannot be read as a plain numpy array"),
])
def test_a_wrong_file_is_refused_in_one_line_without_unpickling(tmp_path, content, message):
    path = tmp_path / "pattern.npy"
    np.save(path, content, allow_pickle=True)
    with pytest.raises(DataError) as info:
        LowFrequency(num_classes=10, image_shape=(3, 32, 32), resource=str(path))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("overrides, message", [
    ({"resource": "/no/such/lf.npy"}, "attack.resource='/no/such/lf.npy' does not exist"),
    ({"resource": "/etc/hostname"}, "is not a .npy file"),
    ({"sigma": 0}, "attack.sigma=0 is invalid"),
    ({"magnitude": 2}, "attack.magnitude=2 is out of range"),
    ({"fooling_rate": 0}, "attack.fooling_rate=0 is out of range"),
    ({"surrogate_epochs": 0}, "attack.surrogate_epochs=0 is invalid"),
])
def test_bad_values_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        LowFrequency(num_classes=10, image_shape=(3, 32, 32), **overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------------ the pipeline


def test_the_clean_control_comes_from_the_victim_cache_and_the_record_says_so(tmp_path, compose_cfg):
    from backdoorbench.pipeline import run

    def lf(*extra):
        cfg = compose_cfg("attack=lf", "trainer.epochs=0", "dataset.test_per_class=50", "eval.stealth_images=0",
                          "attack.craft_images=4", "attack.max_passes=1", "trainer.progress=false", "logger=none",
                          f"results_dir={tmp_path}", *extra)
        return run(cfg)[0]

    first = lf()
    second = lf("attack.poison_rate=0.05")  # another LF victim, the same clean control
    assert first.attack["surrogate"] == second.attack["surrogate"] == "clean_control"
    assert (first.attack["surrogate_cache"], second.attack["surrogate_cache"]) == ("miss", "hit")
    assert first.attack["surrogate_key"] == second.attack["surrogate_key"]
    assert (tmp_path / "cache" / "victims" / f"{first.attack['surrogate_key']}.pt").is_file()
    assert first.attack["n_poisoned"] == 450 and second.attack["n_poisoned"] == 225  # of 4,500
