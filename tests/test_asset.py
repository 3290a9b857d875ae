"""ASSET (Pan et al., USENIX Security 2023): the medcouple, the adjusted outlyingness and the official
threshold against hand computations, the offset on a tiny BadNets victim (the poisoned samples' loss
pulled away from the clean ones', the base set's held flat; without the maximisation it is not), and
the zoo at scale."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from backdoorbench.attacks.badnets import BadNets
from backdoorbench.datasets.base import Split
from backdoorbench.defenses import asset
from backdoorbench.defenses.asset import Asset
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.errors import ConfigError
from backdoorbench.metrics.detection import auroc
from backdoorbench.models.base import Normalized
from tests.test_defenses_detect import TinyNet, quadrant_data, tiny_trainer
from tests.tiny import ZOO, zoo_model
from tests.tiny import one_thread  # noqa: F401  (autouse: one thread for these tiny nets)


# ---- the statistics ----------------------------------------------------------------------------

def test_the_medcouple_matches_hand_computations():
    # [1, 2, 3, 4, 10]: m = 3; pairs (u, l) over {3, 4, 10} x {1, 2, 3}: h = -1, -1, [tie: 0], -1/3, 0, 1,
    # 5/9, 3/4, 1; their median is 0
    assert asset.medcouple(np.array([1, 2, 3, 4, 10.0])) == pytest.approx(0.0)
    # [1, 2, 4, 10] (even count): m = 3, upper {1, 7}, lower {-2, -1}: h = -1/3, 0, 5/9, 3/4; median 5/18
    assert asset.medcouple(np.array([10, 1, 4, 2.0])) == pytest.approx((0 + 5 / 9) / 2)
    assert asset.medcouple(np.array([1, 2, 3, 4, 5.0])) == pytest.approx(0.0)  # symmetric
    # mirrored data: the skewness changes sign
    x = np.array([0.1, 0.2, 0.25, 0.4, 0.9, 2.0, 5.0])
    assert asset.medcouple(x) > 0 and asset.medcouple(-x) == pytest.approx(-asset.medcouple(x))
    # three ties at the median: the block gets -1 / 0 / 1 by anti-diagonal; [0, 0, 0] alone has median 0
    assert asset.medcouple(np.zeros(3)) == 0.0


def test_the_adjusted_outlyingness_matches_a_hand_computation():
    v = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0])
    # lower median 3, q1 2, q3 4, IQR 2, MC 0 (so e^0 = 1 on both sides): whiskers 2 - 3 = -1 and 4 + 3 = 7
    expected = [(3 - 1) / (3 + 1), (3 - 2) / 4, 0.0, (4 - 3) / (7 - 3), (10 - 3) / (7 - 3)]
    assert asset.adjusted_outlyingness(v).tolist() == pytest.approx(expected)
    assert torch.nonzero(asset.adjusted_outlyingness(v) > 1).flatten().tolist() == [4]


def test_the_threshold_is_the_official_gaussian_tail_of_the_lower_half():
    losses = np.array([1.0, 2.0, 3.0, 4.0, 100.0, 200.0])
    low = np.array([1.0, 2.0, 3.0])  # at or below the lower median 3
    sigma = math.sqrt(low.var() + 1e-6)  # sklearn's one-component GMM: biased variance + reg_covar
    expected = sigma * math.sqrt(-2 * math.log(1e-6) * sigma * math.sqrt(2 * math.pi)) + low.mean()
    assert asset.tail_threshold(losses, 1e-6) == pytest.approx(expected)
    assert 3 < asset.tail_threshold(losses, 1e-6) < 100
    assert asset.tail_threshold(losses, 1e-3) < asset.tail_threshold(losses, 1e-6)


# ---- the offset on a tiny BadNets victim -------------------------------------------------------

@pytest.fixture(scope="module")
def badnets_victim():
    train = quadrant_data(240, seed=0, num_classes=2)
    poisoned = BadNets(num_classes=2, image_shape=(1, 8, 8), patch_size=3, poison_rate=0.15).poison_dataset(
        train, torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = Normalized(TinyNet(2), (0.3,), (0.3,))
    tiny_trainer(4).fit(model, poisoned.split, generator=torch.Generator().manual_seed(0))
    is_poison = torch.zeros(len(train), dtype=torch.bool)
    is_poison[poisoned.indices] = True
    return model, poisoned, is_poison, quadrant_data(40, seed=3, num_classes=2)


# A shrunk budget for 240 samples: 8 offset steps in all (the official makes ~98 on CIFAR-10), so larger steps;
# the discriminator reads TinyNet's 32 features (the official 8,192), so a larger rate there too.
TINY = dict(batch_size=120, epochs=4, lr=3e-2, discriminator_steps=60, discriminator_lr=1e-2)


def run(victim, **kwargs):
    model, poisoned, is_poison, clean = victim
    torch.manual_seed(2)  # the detector's initialisation (ctx.build_model draws from the global stream)
    ctx = DefenseContext(model=model, poisoned_train=poisoned.split, poisoned_indices=poisoned.indices,
                         clean_subset=clean, trainer=SimpleNamespace(device="cpu", eval_batch_size=256), num_classes=2,
                         generator=torch.Generator().manual_seed(2),
                         build_model=lambda **kw: Normalized(TinyNet(2, **kw), (0.3,), (0.3,)))
    result = Asset(**{**TINY, **kwargs}).apply(ctx)
    losses = result.sample_scores
    return result, float(losses[is_poison].mean()), float(losses[~is_poison].mean())


def test_the_offset_pulls_the_poisoned_loss_away_and_holds_the_base_set_flat(badnets_victim):
    _, _, is_poison, _ = badnets_victim
    result, poison_loss, clean_loss = run(badnets_victim)
    assert auroc(result.sample_scores, is_poison) > 0.95  # 1.0 here
    # the maximisation reached the poison: its loss well above ln 2 = 0.69, where the clean samples stay
    assert poison_loss - clean_loss > 0.15, (poison_loss, clean_loss)  # 0.92 against 0.69 here
    # the base set is minimised: flat outputs, its loss the clean training samples' (it is the same distribution)
    assert result.extras["base_output_variance"] < 0.2  # 0.06 here
    assert abs(result.extras["base_loss"] - clean_loss) < 0.05
    assert result.extras["ascended_samples"] > 0
    tpr = float(result.flagged[is_poison].float().mean())
    fpr = float(result.flagged[~is_poison].float().mean())
    assert tpr > 0.9 and fpr < 0.05, (tpr, fpr)  # 0.97 and 0 here, at the official threshold
    assert bool((result.flagged == (result.sample_scores >= result.extras["threshold"])).all())


def test_without_the_maximisation_the_losses_do_not_separate(badnets_victim):
    # No suspect passes an infinite cut: only the base set's minimisation runs (the discriminator then
    # does not matter: one step). The poisoned samples' loss stays with the clean ones'.
    result, poison_loss, clean_loss = run(badnets_victim, outlyingness=1e12, discriminator_steps=1)
    assert result.extras["ascended_samples"] == 0
    assert abs(poison_loss - clean_loss) < 0.05, (poison_loss, clean_loss)


def test_asset_config_errors():
    for kwargs, fragment in ((dict(lr=0), "defense.lr=0 is invalid"), (dict(outlyingness=-1), "defense.outlyingness=-1"),
                             (dict(tail_eps=1), "defense.tail_eps=1 is out of range"),
                             (dict(discriminator_steps=0), "defense.discriminator_steps=0"),
                             (dict(clean_fraction=0), "defense.clean_fraction=0 is out of range")):
        with pytest.raises(ConfigError, match=fragment):
            Asset(**kwargs)
    with pytest.raises(ConfigError, match="no nn.Conv2d"):
        Asset().check_model(SimpleNamespace(features=torch.nn.Sequential(torch.nn.Flatten()), name="mlp"))


# ---- the scale rehearsal: the zoo at 10, 43 and 200 classes, 28, 32 and 64 px ---------------------

@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_asset_runs_on_the_zoo(name, shape, classes, kwargs):
    model = zoo_model(name, shape, classes, kwargs)
    Asset().check_model(model.net)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (24, *shape), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, classes, (24,), generator=g)
    ctx = DefenseContext(model=model, poisoned_train=Split(data, labels), poisoned_indices=torch.arange(0),
                         clean_subset=Split(data[:8], labels[:8]), trainer=SimpleNamespace(device="cpu", eval_batch_size=16),
                         num_classes=classes, generator=g, build_model=lambda: zoo_model(name, shape, classes, kwargs))
    result = Asset(batch_size=24, discriminator_steps=2).apply(ctx)
    assert result.sample_scores.shape == (24,) and result.flagged.dtype == torch.bool
    assert torch.isfinite(result.sample_scores).all() and math.isfinite(result.extras["threshold"])
