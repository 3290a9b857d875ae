"""Poison Ink (Zhang et al., IEEE TIP 2022): the edge map against scikit-image's, the defining property
(the trigger sits on the image's edges and the extraction network reads the coloured edge map back,
where a trigger spread over the image fails), the official network layout and BackdoorBench's
trained-network file, the network cache and its resume, both target rules, and bad values in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backdoorbench.attacks import poison_ink as module
from backdoorbench.attacks.poison_ink import PoisonInk
from backdoorbench.attacks.poison_ink_nets import InjectionUNet, edge_mask, grey_255, sobel_magnitude, watermark
from backdoorbench.datasets.base import Split
from backdoorbench.errors import ConfigError, DataError
from tests.tiny import one_thread  # noqa: F401  (autouse)

SIDE = 12
TINY = dict(width=8, depth=1, extractor_width=8, extractor_blocks=0, stages=[[]])


def rectangles(n: int, seed: int, side: int = SIDE) -> torch.Tensor:
    """A flat rectangle on a flat background per image, uint8 (n, 3, side, side): clear edges."""
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(n, 3, side, side)
    for i in range(n):
        x[i] = (torch.rand(3, generator=g) * 0.4).view(3, 1, 1)
        top, left = torch.randint(1, side // 3, (2,), generator=g).tolist()
        h, w = torch.randint(side // 3, side // 2 + 1, (2,), generator=g).tolist()
        x[i, :, top:top + h, left:left + w] = (0.6 + torch.rand(3, generator=g) * 0.4).view(3, 1, 1)
    return (x * 255).round().to(torch.uint8)


def attack(**kwargs) -> PoisonInk:
    return PoisonInk(num_classes=10, image_shape=(3, SIDE, SIDE), **{**TINY, **kwargs})


def edge_energy_ratio(clean: torch.Tensor, poisoned: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean squared change per pixel on the edge map's pixels over the same off them."""
    energy = ((poisoned - clean) ** 2).sum(1)
    on = mask[:, 0].bool()
    return float(energy[on].mean() / energy[~on].mean())


def test_the_edge_map_is_scikit_images():
    from skimage import filters
    from skimage.feature import canny

    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.integers(0, 256, (4, 3, 16, 16), dtype=np.uint8)).float() / 255
    grey = grey_255(images)
    for k in range(4):
        rgb = images[k].permute(1, 2, 0).double().numpy() * 255
        luma = 0.299 * rgb[..., 0] + 0.587 * rgb[..., 1] + 0.114 * rgb[..., 2]  # the official conversion
        assert np.allclose(sobel_magnitude(grey.double())[k].numpy(), filters.sobel(luma), atol=1e-9)
        assert np.array_equal(edge_mask(images, threshold=28)[k, 0].numpy() == 1, filters.sobel(luma) > 28)
        assert np.array_equal(edge_mask(images, detector="canny", sigma=1.0)[k, 0].numpy() == 1,
                              canny(grey[k].double().numpy() / 255, sigma=1.0))
    # the watermark: the colour on the edges, white elsewhere, three channels whatever the image's
    mark = watermark(torch.tensor([[[[1.0, 0.0]]]]), torch.tensor([[80.0, 160.0, 80.0]]))
    assert torch.allclose(mark[0, :, 0, 0], torch.tensor([80, 160, 80]) / 255) and bool((mark[0, :, 0, 1] == 1).all())


def test_the_trigger_sits_on_the_edges_and_the_extractor_reads_the_coloured_map():
    poison = attack(epochs=12, batch_size=16, lr=1e-2)
    injection, extraction, stats = poison.train_networks(rectangles(128, seed=0), seed=0, device="cpu")
    poison.injection = injection
    assert stats["network_epochs"] == 12 and stats["networks_s"] > 0 and set(stats["final_losses"]) >= {"image", "extract"}
    clean = rectangles(48, seed=1).float() / 255
    mask = poison.edges(clean)
    assert 0.05 < float(mask.mean()) < 0.5  # the images do have edges, and most pixels are not on them
    poisoned = poison.apply_trigger(clean)
    ratio = edge_energy_ratio(clean, poisoned, mask)
    assert ratio > 1.8, ratio
    # a wrong trigger of the same strength spread over the whole image fails the same measure
    spread = (clean + torch.randn(clean.shape, generator=torch.Generator().manual_seed(0)) * float((poisoned - clean).std())).clamp(0, 1)
    assert edge_energy_ratio(clean, spread, mask) < 1.3
    # the extractor returns the coloured edge map from the poisoned image and white from the clean one
    wanted = watermark(mask, torch.tensor([poison.colour], dtype=torch.float32).expand(len(clean), 3))
    on = mask.expand(-1, 3, -1, -1).bool()
    with torch.no_grad():
        from_poisoned, from_clean = extraction(poisoned), extraction(clean)
    white_error = float(((1 - wanted) ** 2)[on].mean())  # what answering white (no map) would cost
    assert float(((from_poisoned - wanted) ** 2)[on].mean()) < 0.25 * white_error
    assert float(((from_clean - wanted) ** 2)[on].mean()) > 0.5 * white_error


def test_the_official_layout_and_backdoorbenchs_network_file(tmp_path):
    official = InjectionUNet(6, 3, 64, 4).state_dict()
    assert tuple(official["inc.double_conv.0.weight"].shape) == (64, 6, 3, 3)
    assert tuple(official["down4.maxpool_conv.1.double_conv.0.weight"].shape) == (512, 512, 3, 3)
    assert tuple(official["up1.conv.double_conv.0.weight"].shape) == (512, 1024, 3, 3)
    assert tuple(official["up4.conv.double_conv.3.weight"].shape) == (64, 64, 3, 3)
    assert tuple(official["outc.conv.weight"].shape) == (3, 64, 1, 1)
    path = tmp_path / "netH_epoch_199.pth"
    torch.save({f"module.{k}": v for k, v in official.items()}, path)  # as DataParallel saves it
    loaded = PoisonInk(num_classes=10, image_shape=(3, 32, 32), resource=str(path))
    assert loaded.describe()["networks"] == "resource" and (loaded.width, loaded.depth) == (64, 4)
    x = torch.rand(2, 3, 32, 32)
    assert loaded.apply_trigger(x).shape == x.shape
    torch.save({"inc.double_conv.0.weight": torch.zeros(1)}, tmp_path / "wrong.pth")
    with pytest.raises(DataError, match=r"^attack.resource=.* is not the official injection UNet") as info:
        PoisonInk(num_classes=10, image_shape=(3, 32, 32), resource=str(tmp_path / "wrong.pth"))
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"^attack.resource=.* 3-channel injection network; this dataset's images have 1"):
        PoisonInk(num_classes=10, image_shape=(1, 28, 28), resource=str(path))
    with pytest.raises(ConfigError, match=r"^attack.resource='/no/such.pth' does not exist"):
        PoisonInk(num_classes=10, image_shape=(3, 32, 32), resource="/no/such.pth")


class Trainer:
    device = torch.device("cpu")


def test_the_networks_are_cached_and_a_killed_training_resumes(tmp_path, monkeypatch):
    images = rectangles(32, seed=2)
    train = Split(images, torch.arange(32) % 10)
    first = attack(epochs=2, batch_size=16)
    first.bind_run(data=None, network_cache=tmp_path)
    first.prepare(trainer=Trainer(), train=train, generator=torch.Generator().manual_seed(0), build_model=None)
    assert first.stats["networks"] == "cache_miss" and (tmp_path / "poison_ink" / f"{first.stats['networks_key']}.pt").exists()
    second = attack(epochs=2, batch_size=16)
    second.bind_run(data=None, network_cache=tmp_path)
    monkeypatch.setattr(PoisonInk, "train_networks", lambda *a, **k: pytest.fail("trained again"))
    second.prepare(trainer=Trainer(), train=train, generator=torch.Generator().manual_seed(0), build_model=None)
    assert second.stats["networks"] == "cache_hit" and second.stats["networks_s"] == first.stats["networks_s"]
    x = images[:4].float() / 255
    assert torch.equal(first.apply_trigger(x), second.apply_trigger(x))
    monkeypatch.undo()
    # killed after its first epoch: the partial file holds it, the next run goes on from there, to the same weights
    saves = []
    real_save = module.atomic_torch_save

    def save_then_die(obj, path):
        real_save(obj, path)
        saves.append(path)
        raise KeyboardInterrupt

    partial = tmp_path / "resume.partial.pt"
    monkeypatch.setattr(module, "atomic_torch_save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        attack(epochs=2, batch_size=16).train_networks(images, seed=5, device="cpu", partial=partial)
    monkeypatch.undo()
    assert saves == [partial]
    resumed, _, _ = attack(epochs=2, batch_size=16).train_networks(images, seed=5, device="cpu", partial=partial)
    whole, _, _ = attack(epochs=2, batch_size=16).train_networks(images, seed=5, device="cpu")
    for (name, a), (_, b) in zip(resumed.state_dict().items(), whole.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("mode", ["all2one", "all2all"])
def test_poisoned_images_are_the_injected_ones_relabelled(mode):
    poison = attack(epochs=1, batch_size=16, target_mode=mode, poison_rate=0.25)
    poison.injection, _, _ = poison.train_networks(rectangles(16, seed=3), seed=0, device="cpu")
    train = Split(rectangles(40, seed=4), torch.arange(40) % 10)
    out = poison.poison_dataset(train, torch.Generator().manual_seed(0))
    assert len(out.indices) == 10
    assert torch.equal(out.split.labels[out.indices], poison.target_rule(train.labels[out.indices]))
    expected = (poison.apply_trigger(train.float_images()[out.indices]) * 255).round().to(torch.uint8)
    assert torch.equal(out.split.images[out.indices], expected)


def test_the_extraction_terms_are_weighted_against_the_image_term():
    cover = rectangles(4, seed=6).float() / 255
    colours = torch.full((4, 3), 120.0)
    terms = []
    for weight in (1.0, 0.1):
        poison = attack(extract_weight=weight)
        torch.manual_seed(0)
        injection, extraction = poison.build_injection(), poison.build_extraction()
        terms.append(poison.losses(injection, extraction, cover, colours, [], torch.Generator().manual_seed(0)))
    official, light = terms
    assert torch.allclose(official["loss"], official["image"] + official["extract"])
    assert torch.allclose(light["extract"], official["extract"]) and torch.allclose(light["image"], official["image"])
    assert torch.allclose(light["loss"], light["image"] + 0.1 * light["extract"])


@pytest.mark.parametrize("kwargs, message", [
    ({"colour": [80, 160]}, "attack.colour=[80, 160] is invalid; use three 0-255 levels"),
    ({"stages": [["rotate"]]}, "attack.stages=[['rotate']] is invalid; use a non-empty list of lists of crop, flip"),
    ({"detector": "prewitt"}, "attack.detector='prewitt' is invalid; use one of sobel, canny"),
    ({"depth": 4}, "attack.depth=4 is out of range; use an integer in [1, 3]"),
    ({"image_loss": "ssim"}, "attack.image_loss='ssim' is invalid; use one of mse, l1"),
    ({"extract_weight": 0}, "attack.extract_weight=0 is invalid; use a number > 0"),
])
def test_bad_values_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ConfigError) as info:
        attack(**kwargs)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
