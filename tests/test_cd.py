"""Cognitive Distillation (Huang et al., ICLR 2023): the mask optimisation against a transcription of the
official `CognitiveDistillation.forward`, the total-variation term by hand, the official threshold, the
defining property on a tiny BadNets victim (poisoned images distil to smaller masks, which sit on the
trigger; without the L1 penalty they do not), and the zoo at scale."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from backdoorbench.attacks.badnets import BadNets
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses import cd
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.cd import CognitiveDistillation
from backdoorbench.errors import ConfigError
from backdoorbench.metrics.detection import auroc
from backdoorbench.models.base import ImageClassifier, Normalized
from tests.tiny import ZOO, one_thread, zoo_model  # noqa: F401  (one_thread: autouse fixture)


def test_total_variation_matches_a_hand_computation():
    # one 2 x 2 mask [[0, 1], [1, 1]]: vertical differences (1, 0), horizontal (1, 0): 2 / (1 * 2 * 2)
    mask = torch.tensor([[0.0, 1.0], [1.0, 1.0]]).reshape(1, 1, 2, 2)
    assert cd.total_variation(mask).item() == pytest.approx(0.5)
    # squared: a step of 0.5 counts 0.25; two channels double C * H * W
    half = torch.tensor([[0.5, 0.0], [0.5, 0.0]]).reshape(1, 1, 2, 2).repeat(1, 2, 1, 1)
    assert cd.total_variation(half).item() == pytest.approx(4 * 0.25 / 8)


def official_forward(model, images, lr=0.1, p=1, gamma=0.01, beta=1.0, num_steps=100):
    """A transcription of the official `CognitiveDistillation.forward` (logits, mask_channel 1): the
    noise from the global stream, Adam on a ones-initialised parameter through the whole graph."""
    model.eval()
    b, c, h, w = images.shape
    param = nn.Parameter(torch.ones(b, 1, h, w, dtype=images.dtype))
    opt = torch.optim.Adam([param], lr=lr, betas=(0.1, 0.1))
    logits = model(images).detach()
    for _ in range(num_steps):
        opt.zero_grad()
        mask = (torch.tanh(param) + 1) / 2
        x_adv = images * mask + (1 - mask) * torch.rand(b, c, 1, 1)
        loss = torch.nn.L1Loss(reduction="none")(model(x_adv), logits).mean(dim=1)
        tv_h = torch.pow(mask[:, :, 1:, :] - mask[:, :, :-1, :], 2).sum(dim=[1, 2, 3])
        tv_w = torch.pow(mask[:, :, :, 1:] - mask[:, :, :, :-1], 2).sum(dim=[1, 2, 3])
        total = loss + gamma * torch.norm(mask, p=p, dim=[1, 2, 3]) + beta * (tv_h + tv_w) / (h * w)
        total.mean().backward()
        opt.step()
    return ((torch.tanh(param) + 1) / 2).detach()


def test_masks_equal_the_official_code_with_the_same_noise():
    torch.manual_seed(0)
    model = Normalized(TinyNet(2), (0.3,), (0.3,)).double().eval()
    images = torch.rand(6, 1, 8, 8, dtype=torch.float64)  # float64: Adam at betas (0.1, 0.1) amplifies rounding
    torch.manual_seed(5)  # the official draws from the global stream; ours from a generator seeded alike
    official = official_forward(model, images, num_steps=10, beta=10.0)
    ours = cd.distill_masks(model, images, steps=10, beta=10.0, generator=torch.Generator().manual_seed(5))
    assert ours.shape == (6, 1, 8, 8)
    assert torch.allclose(ours, official, atol=1e-9)


# ---- the defining property on a tiny backdoored model ---------------------------------------------

class TinyNet(ImageClassifier):
    name = "tiny_cd"

    def __init__(self, num_classes: int = 2, **_):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 16), nn.ReLU())
        self.classifier = nn.Linear(16, num_classes)


SIDE = 16


def halves(n: int, seed: int) -> Split:
    """16 x 16 images on dark noise (<= 0.3): class 0 has a bright top half, class 1 a bright left half."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 2
    images = torch.rand(n, 1, SIDE, SIDE, generator=g) * 0.3
    images[labels == 0, :, : SIDE // 2, :] += 0.6
    images[labels == 1, :, :, : SIDE // 2] += 0.6
    return Split((images * 255).round().to(torch.uint8), labels)


class PlantedBackdoor(nn.Module):
    """A backdoored classifier of `halves` built by hand, the shortcut a trained victim learns: clean
    evidence spread over the image (the halves' mean brightness differences), and a gate that, when the
    pixels under the trigger show its pattern, replaces the logits by the target's whatever the rest."""

    def __init__(self, where: Tensor, pattern: Tensor) -> None:
        super().__init__()
        self.register_buffer("where", where)
        self.register_buffer("pattern", pattern.flatten())

    def forward(self, x: Tensor) -> Tensor:
        half = SIDE // 2
        top, bottom = x[..., :half, :].mean((1, 2, 3)), x[..., half:, :].mean((1, 2, 3))
        left, right = x[..., :, :half].mean((1, 2, 3)), x[..., :, half:].mean((1, 2, 3))
        clean = 10 * torch.stack([top - bottom, left - right], 1)
        mismatch = (x[:, 0][:, self.where] - self.pattern).abs().mean(1)
        gate = torch.sigmoid(20 * (0.35 - mismatch)).unsqueeze(1)
        return (1 - gate) * clean + gate * torch.tensor([5.0, -5.0])


@pytest.fixture(scope="module")
def badnets_victim():
    train = halves(200, seed=0)
    attack = BadNets(num_classes=2, image_shape=(1, SIDE, SIDE), patch_size=3, poison_rate=0.1)  # a checkerboard, bottom-right
    poisoned = attack.poison_dataset(train, torch.Generator().manual_seed(0))
    is_poison = torch.zeros(len(train), dtype=torch.bool)
    is_poison[poisoned.indices] = True
    model = PlantedBackdoor(attack.patch_mask(), attack.patch[0]).eval()
    with torch.no_grad():  # the backdoor works: every poisoned image goes to the target, the clean ones to their class
        predicted = model(to_float(poisoned.split.images)).argmax(1)
    assert bool((predicted[is_poison] == 0).all()) and bool((predicted[~is_poison] == train.labels[~is_poison]).all())
    return model, poisoned, is_poison, halves(20, seed=3), attack.patch_mask()


def context(model, poisoned, clean) -> DefenseContext:
    return DefenseContext(model=model, poisoned_train=poisoned.split, poisoned_indices=poisoned.indices,
                          clean_subset=clean, trainer=SimpleNamespace(device="cpu"), num_classes=2,
                          generator=torch.Generator().manual_seed(4))


def test_poisoned_images_distil_to_smaller_masks_and_are_flagged(badnets_victim):
    model, poisoned, is_poison, clean, _ = badnets_victim
    result = CognitiveDistillation().apply(context(model, poisoned, clean))
    assert result.sample_scores.shape == is_poison.shape and result.flagged.dtype == torch.bool
    assert auroc(result.sample_scores, is_poison) > 0.95
    assert bool(result.flagged[is_poison].all())  # every poisoned image; the toy's clean norms spread widely (FPR ~0.7)
    # the official verdict: a norm below mean - 0.5 std of the clean subset's norms
    threshold = result.extras["clean_norm_mean"] - 0.5 * result.extras["clean_norm_std"]
    assert result.extras["norm_threshold"] == pytest.approx(threshold)
    assert bool((result.flagged == (-result.sample_scores < threshold)).all())


def trigger_share(model, images, patch, **settings) -> tuple[Tensor, Tensor]:
    """Per image: the share of its distilled mask's mass on the patch's pixels, and the mask's L1 norm."""
    masks = cd.distill_masks(model, images, generator=torch.Generator().manual_seed(1), **settings)[:, 0]
    return masks[:, patch].sum(1) / masks.flatten(1).sum(1), masks.flatten(1).sum(1)


def test_the_mask_of_a_poisoned_image_sits_on_the_trigger_and_needs_the_l1_penalty(badnets_victim):
    model, poisoned, is_poison, _, patch = badnets_victim
    images = to_float(poisoned.split.images)
    picked = torch.cat([torch.nonzero(is_poison).flatten()[:10], torch.nonzero(~is_poison).flatten()[:10]])
    truth = is_poison[picked]
    share, norms = trigger_share(model, images[picked], patch)
    # the patch is 9 of 256 pixels (3.5%); the poisoned images' masks put most of their mass there
    assert float(share[truth].mean()) > 0.9 and float(share[~truth].mean()) < 0.3
    assert auroc(-norms, truth) == 1.0
    assert float(norms[truth].mean()) < 0.3 * float(norms[~truth].mean())  # about 8 pixels against 46 here
    # without the L1 penalty nothing makes the mask small: it keeps nearly the whole image, trigger or not
    share, norms = trigger_share(model, images[picked], patch, alpha=0.0)
    assert float(share[truth].mean()) < 0.1
    assert float(norms[truth].mean()) > 0.8 * float(norms[~truth].mean())  # about 239 against 253


def test_cd_config_errors():
    for kwargs, fragment in ((dict(steps=0), "defense.steps=0 is invalid"), (dict(lr=0), "defense.lr=0 is invalid"),
                             (dict(alpha=-1), "defense.alpha=-1 is invalid"), (dict(p=0), "defense.p=0 is invalid"),
                             (dict(std_factor=-0.5), "defense.std_factor=-0.5 is invalid"),
                             (dict(budget="gpu"), "defense.budget='gpu' is unknown"),
                             (dict(clean_fraction=0), "defense.clean_fraction=0 is out of range")):
        with pytest.raises(ConfigError, match=fragment):
            CognitiveDistillation(**kwargs)
    assert CognitiveDistillation(budget="cpu").steps == 30 and CognitiveDistillation().steps == 100
    assert CognitiveDistillation(budget="cpu", steps=7).steps == 7


# ---- the scale rehearsal: the zoo at 10, 43 and 200 classes, 28, 32 and 64 px ---------------------

@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_cd_runs_on_the_zoo(name, shape, classes, kwargs):
    model = zoo_model(name, shape, classes, kwargs)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (6, *shape), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, classes, (6,), generator=g)
    ctx = DefenseContext(model=model, poisoned_train=Split(data, labels), poisoned_indices=torch.arange(0),
                         clean_subset=Split(data[:3], labels[:3]), trainer=SimpleNamespace(device="cpu"),
                         num_classes=classes, generator=g)
    result = CognitiveDistillation(steps=2, batch_size=4).apply(ctx)  # shapes are what is rehearsed
    assert result.sample_scores.shape == (6,) and result.flagged.dtype == torch.bool
    assert torch.isfinite(result.sample_scores).all()
    assert bool((-result.sample_scores > 0).all()) and bool((-result.sample_scores <= shape[1] * shape[2]).all())
