"""Beatrix (Ma et al., NDSS 2023), dataset mode: the order-p Gram feature and the deviation against hand
computations and a transcription of the official `Feature_Correlations`, the official 5-fold threshold,
the anomaly index, a tiny BadNets victim end to end, and the zoo at scale."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backdoorbench.datasets.base import Split
from backdoorbench.defenses import beatrix
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.beatrix import Beatrix
from backdoorbench.errors import ConfigError
from backdoorbench.metrics.detection import auroc
from backdoorbench.models.base import Normalized
from tests.tiny import ZOO, tiny_badnets_victim


# ---- the Gram feature and the deviation ---------------------------------------------------------

def test_the_order_p_gram_feature_matches_a_hand_computation():
    # one sample, 2 channels of 2 positions: F = [[1, -2], [-3, 1]]
    maps = torch.tensor([[1.0, -2.0], [-3.0, 1.0]]).reshape(1, 2, 1, 2)
    # p = 1: F F' = [[5, -5], [-5, 10]]; upper triangle with the diagonal, row by row
    assert beatrix.gram_features(maps, 1).tolist() == [[5.0, -5.0, 10.0]]
    # p = 2: F^2 = [[1, 4], [9, 1]], its Gram [[17, 13], [13, 82]], square roots
    assert beatrix.gram_features(maps, 2)[0].tolist() == pytest.approx([17 ** 0.5, 13 ** 0.5, 82 ** 0.5])
    # p = 3: F^3 = [[1, -8], [-27, 1]], Gram [[65, -35], [-35, 730]]: the root keeps the sign
    assert beatrix.gram_features(maps, 3)[0].tolist() == pytest.approx([65 ** (1 / 3), -(35 ** (1 / 3)), 730 ** (1 / 3)])


def test_the_deviation_matches_a_hand_computation():
    # One channel at one position: G_p = ((a^p)^2)^(1/p) = a^2 at every order (the p-th root puts every
    # order on the first's scale). Clean a = 1..5: 1, 4, 9, 16, 25, median 9, MAD median(8, 5, 0, 7, 16)
    # = 7, bounds 9 -/+ 70 = [-61, 79]. a = 10 gives 100, (100 - 79) / 79 above, at each of 2 orders.
    clean = torch.arange(1.0, 6.0).reshape(5, 1, 1, 1)
    stats = beatrix.GramStatistics(clean, (1, 2), 10.0)
    a = torch.tensor([10.0]).reshape(1, 1, 1, 1)
    expected = 2 * (100 - 79) / (79 + 1e-6) / (1 * 1 / 2) / 2  # summed over orders, / (C^2 / 2) / the number of orders
    assert stats.deviations(a).item() == pytest.approx(expected, rel=1e-9)
    below = torch.tensor([0.0]).reshape(1, 1, 1, 1)  # 0 is inside [-61, 79]
    assert stats.deviations(below).item() == 0.0
    # two positions (1, 2) tell the orders apart: 1 + 4 = 5, sqrt(1 + 16), (1 + 64)^(1/3)
    pair = torch.tensor([1.0, 2.0]).reshape(1, 1, 1, 2)
    assert [beatrix.gram_features(pair, p).item() for p in (1, 2, 3)] == pytest.approx([5, 17 ** 0.5, 65 ** (1 / 3)])


class OfficialFeatureCorrelations:
    """A transcription of the official `Feature_Correlations` (mode `mad`): G_p over the whole C x C
    matrix with its lower triangle zeroed, torch medians, bounds median -/+ 10 MAD, `get_deviations_`."""

    def __init__(self, powers):
        self.power = powers

    def g_p(self, ob, p):
        temp = ob.detach() ** p
        temp = temp.reshape(temp.shape[0], temp.shape[1], -1)
        temp = torch.matmul(temp, temp.transpose(dim0=2, dim1=1)).triu()
        temp = temp.sign() * torch.abs(temp) ** (1 / p)
        temp = temp.reshape(temp.shape[0], -1)
        self.num_feature = temp.shape[-1] / 2
        return temp

    def train(self, data):
        self.mins, self.maxs = [], []
        for p in self.power:
            g = self.g_p(data, p)
            median = g.median(dim=0, keepdim=True)[0]
            mad = torch.abs(g - median).median(dim=0, keepdim=True)[0]
            self.mins.append(median - mad * 10)
            self.maxs.append(median + mad * 10)

    def deviations(self, data):
        dev = 0
        for i, p in enumerate(self.power):
            g = self.g_p(data, p)
            dev += (F.relu(self.mins[i] - g) / torch.abs(self.mins[i] + 10 ** -6)).sum(dim=1, keepdim=True)
            dev += (F.relu(g - self.maxs[i]) / torch.abs(self.maxs[i] + 10 ** -6)).sum(dim=1, keepdim=True)
        return dev.numpy() / self.num_feature / len(self.power)

    def threshold(self, clean):  # the official `threshold_determine`, its 95th percentile
        held = []
        for i in range(5):
            mask = np.ones(len(clean))
            mask[i * int(len(clean) // 5):(i + 1) * int(len(clean) // 5)] = 0
            self.train(clean[np.where(mask == 1)])
            held.append(self.deviations(clean[np.where(mask == 0)]))
        ranked = np.sort(np.concatenate(held, 0), 0)
        return ranked[int(len(ranked) * 0.95)][0]


def test_deviations_and_threshold_equal_the_official_code_on_random_maps():
    g = torch.Generator().manual_seed(0)
    clean = torch.randn(32, 6, 3, 3, generator=g, dtype=torch.float64)  # 32: the last 2 are never held out
    test = torch.randn(10, 6, 3, 3, generator=g, dtype=torch.float64) * 1.5
    orders = tuple(range(1, 9))
    official = OfficialFeatureCorrelations(list(orders))
    official.train(clean)
    ours = beatrix.GramStatistics(clean, orders, 10.0)
    assert np.allclose(ours.deviations(test).numpy(), official.deviations(test)[:, 0], rtol=1e-9)
    assert beatrix.fold_threshold(clean, orders, 10.0, 95.0) == pytest.approx(official.threshold(clean), rel=1e-9)


def test_the_anomaly_index_is_the_official_with_numpys_median():
    assert beatrix.anomaly_index([1.0, 2.0, 3.0, 4.0, 100.0]) == pytest.approx(
        [d / 1.4826 / (1 + 1e-6) for d in (2, 1, 0, 1, 97)])
    j = np.array([1.0, 2.0, 4.0, 50.0])
    median = np.median(j)
    expected = np.abs(j - median) / 1.4826 / (np.median(np.abs(j - median)) + 1e-6)
    assert beatrix.anomaly_index(j.tolist()) == pytest.approx(expected.tolist())


# ---- the defining property on a tiny BadNets victim ----------------------------------------------

@pytest.fixture(scope="module")
def badnets_victim():
    return tiny_badnets_victim(400, 2, 60)  # the defender's clean samples: 30 of each class


def context(model, poisoned, clean) -> DefenseContext:
    return DefenseContext(model=model, poisoned_train=poisoned.split, poisoned_indices=poisoned.indices,
                          clean_subset=clean, trainer=SimpleNamespace(device="cpu", eval_batch_size=64), num_classes=2,
                          generator=torch.Generator().manual_seed(4))


def test_poisoned_samples_deviate_more_than_clean_ones_and_are_flagged(badnets_victim):
    model, poisoned, is_poison, clean = badnets_victim
    result = Beatrix().apply(context(model, poisoned, clean))
    assert result.extras["layer"] == "features.3" and result.extras["uncalibrated_classes"] == []
    target = poisoned.split.labels == 0
    assert auroc(result.sample_scores[target], is_poison[target]) > 0.95  # 1.0 here
    assert auroc(result.sample_scores, is_poison) > 0.95
    tpr = float(result.flagged[is_poison].float().mean())
    fpr = float(result.flagged[~is_poison].float().mean())
    assert tpr > 0.9 and fpr < 0.1, (tpr, fpr)  # 1.0 and 0.04 here
    assert bool(((result.sample_scores > 0) == result.flagged).all())  # the score is the margin over the threshold
    assert result.extras["suspected_classes"] in ([], [0])  # two classes: the anomaly index has little to compare


def test_higher_orders_tell_apart_maps_the_first_order_cannot():
    # (1, 1) and (sqrt 2, 0) on one channel: the same G_1 = 2, but G_4 = 2^(1/4) against 16^(1/4) = 2:
    # the power weighs a peaked activation more. BackdoorBench's port drops the power (its "G_p" is
    # G_1^(1/p)), so its eight orders see these two maps alike.
    spread, peaked = torch.tensor([1.0, 1.0]).reshape(1, 1, 1, 2), torch.tensor([2 ** 0.5, 0.0]).reshape(1, 1, 1, 2)
    assert beatrix.gram_features(spread, 1).item() == pytest.approx(beatrix.gram_features(peaked, 1).item())
    assert beatrix.gram_features(spread, 4).item() == pytest.approx(2 ** 0.25)
    assert beatrix.gram_features(peaked, 4).item() == pytest.approx(2.0)


def test_a_class_with_too_few_clean_samples_is_left_uncalibrated(badnets_victim):
    model, poisoned, is_poison, clean = badnets_victim
    few = clean.subset(torch.nonzero(clean.labels == 1).flatten())  # no clean sample of class 0
    result = Beatrix().apply(context(model, poisoned, few))
    assert result.extras["uncalibrated_classes"] == [0]
    predicted_zero = result.sample_scores == 0
    assert not result.flagged[predicted_zero].any()


def test_beatrix_config_errors():
    for kwargs, fragment in ((dict(orders=[0, 2]), "defense.orders=[0, 2] is invalid"), (dict(orders=[]), "orders=[] is invalid"),
                             (dict(percentile=101), "defense.percentile=101 is out of range"),
                             (dict(clean_per_class=3), "defense.clean_per_class=3 is invalid"),
                             (dict(mad_scale=0), "defense.mad_scale=0 is invalid"), (dict(layer="x"), "layer='x' is unknown"),
                             (dict(clean_fraction=0), "defense.clean_fraction=0 is out of range")):
        with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
            Beatrix(**kwargs)
    with pytest.raises(ConfigError, match="no nn.Conv2d"):
        Beatrix().check_model(SimpleNamespace(features=nn.Sequential(nn.Flatten(), nn.Linear(4, 2)), name="mlp"))


# ---- the scale rehearsal: the zoo at 10, 43 and 200 classes, 28, 32 and 64 px ---------------------


@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_beatrix_runs_on_the_zoo(name, shape, classes, kwargs):
    from pathlib import Path

    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    import backdoorbench

    node = OmegaConf.load(Path(backdoorbench.__file__).parent / "conf" / "model" / f"{name}.yaml")
    torch.manual_seed(0)
    net = instantiate(node, in_channels=shape[0], num_classes=classes, image_size=shape[1], **kwargs)
    Beatrix().check_model(net)
    model = Normalized(net, (0.5,) * shape[0], (0.25,) * shape[0]).eval()
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (40, *shape), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, classes, (40,), generator=g)
    ctx = DefenseContext(model=model, poisoned_train=Split(data, labels), poisoned_indices=torch.arange(0),
                         clean_subset=Split(data[:20], labels[:20]), trainer=SimpleNamespace(device="cpu", eval_batch_size=16),
                         num_classes=classes, generator=g)
    result = Beatrix(orders=(1, 8)).apply(ctx)  # two orders: shapes are what is rehearsed
    assert result.sample_scores.shape == (40,) and result.flagged.dtype == torch.bool
    assert torch.isfinite(result.sample_scores).all()
    assert len(result.extras["anomaly_index"]) == classes
    # an untrained network sends most images to one class: that one is calibrated and scored
    assert len(result.extras["uncalibrated_classes"]) < classes
