"""Defining properties of BadNets and Blended, and of seeded poisoned-index selection."""

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from backdoorbench.attacks.badnets import BadNets
from backdoorbench.attacks.blended import Blended
from backdoorbench.attacks.patterns import load_pattern
from backdoorbench.datasets.base import Split
from backdoorbench.errors import ConfigError, DataError

COMMON = {"num_classes": 10, "image_shape": (1, 28, 28)}
CONF = Path(__file__).resolve().parents[1] / "backdoorbench" / "conf" / "attack"


def random_images(n=8, shape=(1, 28, 28), seed=0):
    return torch.rand((n, *shape), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("location", ["bottom_right", "top_left", "top_right", "bottom_left", [5, 7]])
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_badnets_changes_only_its_patch(location, shape):
    attack = BadNets(num_classes=10, image_shape=shape, patch_size=4, location=location)
    x = random_images(shape=shape)
    out = attack.apply_trigger(x)
    mask = attack.patch_mask()
    assert torch.equal(out[..., ~mask], x[..., ~mask])
    assert torch.equal(out[..., mask], attack.patch.reshape(shape[0], -1).unsqueeze(0).expand(len(x), -1, -1))
    assert int(mask.sum()) == 16


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_badnets_default_is_backdoorbenchs_3x3_white_square_bottom_right(shape):
    """BackdoorBench's trigger_image.png and BackdoorBox's pattern, not a checkerboard."""
    channels, height, width = shape
    attack = instantiate(OmegaConf.load(CONF / "badnets.yaml"), num_classes=10, image_shape=shape)
    out = attack.apply_trigger(torch.full((1, *shape), 0.5))
    assert torch.equal(out[0, :, height - 3 :, width - 3 :], torch.ones(channels, 3, 3))
    assert (out[0, :, : height - 3] == 0.5).all() and (out[0, :, :, : width - 3] == 0.5).all()
    checker = BadNets(**COMMON).apply_trigger(torch.full((1, 1, 28, 28), 0.5))  # the class default
    assert torch.equal(checker[0, 0, 25:, 25:], torch.tensor([[1.0, 0, 1], [0, 1, 0], [1, 0, 1]]))


def test_badnets_rejects_a_patch_outside_the_image():
    with pytest.raises(ConfigError, match="outside"):
        BadNets(**COMMON, patch_size=3, location=[27, 0])
    with pytest.raises(ConfigError, match="patch_size"):
        BadNets(**COMMON, patch_size=40)


@pytest.mark.parametrize("alpha", [0.1, 0.2, 1.0])
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_blended_is_convex_combination(alpha, shape):
    attack = Blended(num_classes=10, image_shape=shape, alpha=alpha)
    x = random_images(shape=shape)
    expected = (1 - alpha) * x + alpha * attack.pattern
    assert torch.allclose(attack.apply_trigger(x), expected, atol=1e-7)
    assert attack.pattern.shape == shape and 0 <= attack.pattern.min() and attack.pattern.max() <= 1


def test_blended_default_pattern_is_the_chelsea_photo_in_gray():
    import skimage.data

    pattern = Blended(**COMMON).pattern
    assert pattern.shape == (1, 28, 28)
    # A real photo, not noise: neighbouring pixels are strongly correlated.
    def neighbour_correlation(p):
        return torch.corrcoef(torch.stack([p[0, :, :-1].flatten(), p[0, :, 1:].flatten()]))[0, 1]

    assert neighbour_correlation(pattern) > 0.5
    assert abs(neighbour_correlation(load_pattern("random", (1, 28, 28)))) < 0.2
    assert skimage.data.chelsea().shape == (300, 451, 3)


def test_pattern_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="neither an image file"):
        load_pattern(str(tmp_path / "missing.png"), (1, 28, 28))
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image at all")
    with pytest.raises(DataError, match="not a readable image"):
        load_pattern(str(bad), (1, 28, 28))


def test_pattern_from_an_image_file(tmp_path):
    from PIL import Image

    array = (torch.arange(64 * 64 * 3) % 256).to(torch.uint8).reshape(64, 64, 3).numpy()
    Image.fromarray(array).save(tmp_path / "p.png")
    pattern = load_pattern(str(tmp_path / "p.png"), (3, 16, 16))
    assert pattern.shape == (3, 16, 16) and pattern.dtype == torch.float32


def labels_of_size(n=1000, seed=0):
    return torch.randint(0, 10, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", ["all2one", "all2all"])
def test_poison_indices_are_seeded_sized_and_drawn_from_every_class(mode):
    attack = BadNets(**COMMON, target_mode=mode, target=3, poison_rate=0.1)
    y = labels_of_size()
    first = attack.poison_indices(y, torch.Generator().manual_seed(7))
    again = attack.poison_indices(y, torch.Generator().manual_seed(7))
    other = attack.poison_indices(y, torch.Generator().manual_seed(8))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert len(first) == 100 and len(set(first.tolist())) == 100
    # BackdoorBench's rule: dirty-label poison is drawn from all classes, the target class included
    assert set(y[first].tolist()) == set(range(10))


def test_dirty_label_all2one_keeps_target_class_labels_and_stamps_them():
    attack = BadNets(**COMMON, target=3, poison_rate=0.5)
    y = labels_of_size(200)
    chosen = attack.poison_indices(y, torch.Generator().manual_seed(0))
    in_target = chosen[y[chosen] == 3]
    assert len(in_target) > 0  # the old rule excluded these
    assert (attack.target_rule(y[chosen]) == 3).all()


def test_full_poison_rate_is_allowed_for_dirty_label_attacks():
    attack = BadNets(**COMMON, target=0, poison_rate=1.0)
    y = labels_of_size()
    assert len(attack.poison_indices(y, torch.Generator().manual_seed(0))) == len(y)


@pytest.mark.parametrize("rate", [0, -0.1, 1.5, "0.1", True])
def test_poison_rate_out_of_range(rate):
    with pytest.raises(ConfigError, match="poison_rate"):
        BadNets(**COMMON, poison_rate=rate)


@pytest.mark.parametrize("mode", ["all2one", "all2all"])
def test_poison_dataset_relabels_and_triggers_only_chosen_samples(mode):
    y = labels_of_size(200)
    images = (random_images(200) * 255).round().to(torch.uint8)
    train = Split(images, y)
    attack = BadNets(**COMMON, target_mode=mode, target=2, poison_rate=0.2)
    poisoned = attack.poison_dataset(train, torch.Generator().manual_seed(0))
    idx = poisoned.indices
    rest = torch.ones(200, dtype=torch.bool)
    rest[idx] = False
    expected = torch.full_like(y[idx], 2) if mode == "all2one" else (y[idx] + 1) % 10
    assert torch.equal(poisoned.split.labels[idx], expected)
    assert torch.equal(poisoned.split.labels[rest], y[rest])
    assert torch.equal(poisoned.split.images[rest], images[rest])
    assert (poisoned.split.images[idx][..., 25:, 25:] != images[idx][..., 25:, 25:]).any()
    assert torch.equal(train.images, images) and torch.equal(train.labels, y)  # input untouched
    assert len(poisoned.indices_sha256) == 64


def test_no_attack_is_the_clean_control(tmp_path, compose_cfg):
    from backdoorbench.pipeline import run

    record, _ = run(compose_cfg("attack=none", "trainer.epochs=0", f"results_dir={tmp_path}", "trainer.progress=false"))
    assert record.attack["n_poisoned"] == 0 and record.attack["poison_rate"] == 0.0
    assert record.stealth is None  # an identity trigger has no finite PSNR to report
    # untrained model: ASR is just the share of non-target test images it already calls the target
    assert 0 <= record.metrics["attacked"]["asr"] <= 1


def test_no_attack_changes_nothing():
    from backdoorbench.attacks.none import NoAttack
    from backdoorbench.errors import ConfigError

    attack = NoAttack(num_classes=10, image_shape=(1, 28, 28))
    x = torch.rand(4, 1, 28, 28)
    assert torch.equal(attack.apply_trigger(x), x)
    assert len(attack.poison_indices(torch.arange(10), torch.Generator())) == 0
    with pytest.raises(ConfigError, match="poison_rate"):
        NoAttack(num_classes=10, image_shape=(1, 28, 28), poison_rate=0.1)
