"""SPECTRE (Hayase et al., ICML 2021): the QUE score against a hand computation, the robust covariance
against outliers, robust whitening + QUE finding a plant that the top singular vector misses, the
removal rule, a tiny BadNets victim end to end, and the zoo at scale."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from backdoorbench.attacks.badnets import BadNets
from backdoorbench.datasets.base import Split
from backdoorbench.defenses import spectral, spectre
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.spectre import Spectre
from backdoorbench.errors import ConfigError
from backdoorbench.metrics.detection import auroc
from backdoorbench.models.base import Normalized
from tests.test_defenses_detect import TinyNet, context, quadrant_data, tiny_trainer
from tests.tiny import ZOO, zoo_model


def planted_behind_a_larger_direction(n_clean: int = 500, n_poison: int = 50, dim: int = 32, seed: int = 0):
    """One class: clean N(0, I) stretched 3x along e0 (a benign direction of variance 9); the poison,
    a tenth of the class, shifted 6 along e1. The poison adds about 1 + 0.09 * 36 = 4.2 of variance
    along e1, less than e0's 9: the top singular vector is the benign direction."""
    g = np.random.default_rng(seed)
    clean = g.standard_normal((n_clean, dim))
    clean[:, 0] *= 3.0
    poison = g.standard_normal((n_poison, dim))
    poison[:, 1] += 6.0
    is_poison = torch.cat([torch.zeros(n_clean, dtype=torch.bool), torch.ones(n_poison, dtype=torch.bool)])
    return np.concatenate([clean, poison]), is_poison


# ---- the QUE score --------------------------------------------------------------------------------

def test_que_score_matches_a_hand_computation():
    # Four whitened points (+-s, 0), (0, +-t) with s^2 = 4.5, t^2 = 2.25: their unbiased covariance is
    # diag(2 s^2 / 3, 2 t^2 / 3) = diag(3, 1.5), ||C|| = 3, so (C - I) / (||C|| - 1) = diag(1, 0.25) and
    # M = diag(e^4, e^1) / (e^4 + e) at alpha 4; the scores are x' M x.
    s, t = math.sqrt(4.5), 1.5
    white = np.array([[s, 0], [-s, 0], [0, t], [0, -t]])
    weight = math.exp(4) + math.exp(1)
    expected = [4.5 * math.exp(4) / weight] * 2 + [2.25 * math.exp(1) / weight] * 2
    assert spectre.que_scores(white, alpha=4.0) == pytest.approx(expected, rel=1e-12)
    # alpha -> 0: M -> I / k, the score is the squared norm / k; alpha large: the top direction alone
    assert spectre.que_scores(white, alpha=1e-9) == pytest.approx([4.5 / 2] * 2 + [2.25 / 2] * 2, rel=1e-6)
    assert spectre.que_scores(white, alpha=60.0) == pytest.approx([4.5] * 2 + [0.0] * 2, abs=1e-9)
    # one dimension: M = 1 (the official), the score is x^2
    assert spectre.que_scores(np.array([[2.0], [-1.0]]), alpha=4.0) == pytest.approx([4.0, 1.0])


def test_que_matrix_is_the_official_matrix_exponential_normalised_to_unit_trace():
    from scipy.linalg import expm

    g = np.random.default_rng(1)
    a = g.standard_normal((6, 6))
    cov = a @ a.T / 6 + np.eye(6)
    official = expm(4.0 * (cov - np.eye(6)) / (np.linalg.norm(cov, 2) - 1))
    assert np.allclose(spectre.que_matrix(cov, 4.0), official / np.trace(official), atol=1e-12)


# ---- the robust covariance -----------------------------------------------------------------------

def test_the_robust_covariance_is_not_moved_by_outliers_as_the_sample_covariance_is():
    g = np.random.default_rng(2)
    x = np.concatenate([g.standard_normal((500, 5)), g.standard_normal((50, 5)) + np.array([10.0, 0, 0, 0, 0])])
    x = x - x.mean(0)  # the official filter runs on PCA output, centred on the (contaminated) mean
    kept = spectre.robust_selection(x, 50 / 550, 0.1, limit=100)
    assert kept[:500].sum() >= 490 and kept[500:].sum() <= 5  # the outliers go, the inliers stay
    robust = np.linalg.eigvalsh(np.cov(x[kept], rowvar=False))
    sample = np.linalg.eigvalsh(np.cov(x, rowvar=False))
    # near the inliers' identity: the filter stops once the fourth moment passes its test, a few of the
    # 50 left (here 4, each ~10 away, add ~0.8 along their direction)
    assert robust.max() < 2 and robust.min() > 0.7
    assert sample.max() > 8  # 1 + (50 / 550)(500 / 550) 10^2 ~ 9.3 along the outliers' direction
    # the removals respect the limit (at most 2 eps in the official call)
    assert (~spectre.robust_selection(x, 50 / 550, 0.1, limit=20)).sum() <= 20


def test_k_lowest_keeps_ties_and_the_dimension_sweep_is_the_official():
    assert spectre.k_lowest(np.array([3.0, 1.0, 2.0, 2.0]), 2).tolist() == [False, True, True, True]
    assert not spectre.k_lowest(np.array([1.0, 2.0]), 0).any()
    assert spectre.dimension_sweep(100) == [1, 4, 9, 16, 25, 36, 49, 64, 81, 100]  # round.(range(1, 10, length=10).^2)
    assert spectre.dimension_sweep(64)[-1] == 64 and spectre.dimension_sweep(64)[0] == 1


# ---- the defining property: robust whitening + QUE where the top singular vector fails -------------

def test_robust_whitening_and_que_rank_a_plant_that_the_top_singular_vector_misses():
    x, is_poison = planted_behind_a_larger_direction()
    centered = x - x.mean(0)
    top = np.linalg.svd(centered, full_matrices=False)[2][0]
    assert abs(top[0]) > 0.95  # spectral signatures' direction is the benign stretch ...
    assert auroc(spectral.spectral_scores(torch.from_numpy(x)), is_poison) < 0.6  # ... and misses the plant
    result = spectre.auto_quantum_filter(x, eps=50)
    assert auroc(torch.from_numpy(result.scores), is_poison) > 0.98
    assert result.removed.sum() == 75 and result.removed[is_poison.numpy()].sum() >= 45  # round(1.5 * 50); 90% of the plant
    # k = 1 (no whitening, one direction) is spectral signatures again: the sweep must pick a larger k
    k1, _ = spectre.quantum_filter(x, 50, 1, 4.0, 0.1, 1.5)
    assert auroc(torch.from_numpy(k1), is_poison) < 0.6 and result.k > 1
    # whitening by the sample covariance instead of the robust one lets the plant shape the whitening
    reduced = spectre.pca(x, result.k)
    naive = spectre.que_scores(reduced @ spectre.inverse_sqrt(np.cov(reduced, rowvar=False)), 4.0)
    assert auroc(torch.from_numpy(naive), is_poison) < auroc(torch.from_numpy(result.scores), is_poison) - 0.02


def test_the_class_with_the_largest_que_value_loses_round_1p5_eps_and_no_other_does():
    x0, poison0 = planted_behind_a_larger_direction(360, 40, seed=0)
    others = [planted_behind_a_larger_direction(400, 0, seed=s)[0] for s in (3, 4)]
    features = torch.from_numpy(np.concatenate([x0, *others])).float()
    labels = torch.arange(3).repeat_interleave(400)
    is_poison = torch.cat([poison0, torch.zeros(800, dtype=torch.bool)])
    # eps = round(40 / 1200 * 1200) = 40 in each class (under a third of 400): round(1.5 * 40) = 60 removed
    scores, flagged, stats = spectre.detect(features, labels, expected_poison_rate=40 / 1200)
    assert stats["suspected_target"] == 0 and stats["que"]["0"] > max(stats["que"]["1"], stats["que"]["2"])
    assert int(flagged[:400].sum()) == 60 and not flagged[400:].any()
    assert bool(flagged[is_poison].all())  # every planted sample is among the 60
    assert auroc(scores, is_poison) > 0.98
    _, every, _ = spectre.detect(features, labels, expected_poison_rate=40 / 1200, removal="every_class")
    assert [int(every[labels == c].sum()) for c in range(3)] == [60, 60, 60]  # BackdoorBench's port


def test_eps_is_the_expected_count_at_most_a_third_of_the_class():
    labels = torch.tensor([0] * 90 + [1] * 9 + [2] * 1)
    assert spectre.class_eps(labels, 0.2) == {0: 20, 1: 3, 2: 1}  # 0.2 * 100 = 20; round(0.33 * 9) = 3; at least 1


# ---- end to end on a tiny BadNets victim -----------------------------------------------------------

@pytest.fixture(scope="module")
def badnets_victim():
    torch.manual_seed(0)
    train = quadrant_data(400, seed=0, num_classes=2)
    attack = BadNets(num_classes=2, image_shape=(1, 8, 8), patch_size=3, poison_rate=0.1)
    poisoned = attack.poison_dataset(train, torch.Generator().manual_seed(0))
    model = Normalized(TinyNet(2), (0.3,), (0.3,))
    tiny_trainer(6).fit(model, poisoned.split, generator=torch.Generator().manual_seed(0))
    is_poison = torch.zeros(len(train), dtype=torch.bool)
    is_poison[poisoned.indices] = True
    return model, poisoned, is_poison


def test_spectre_ranks_and_removes_the_badnets_samples_of_the_target(badnets_victim):
    model, poisoned, is_poison = badnets_victim
    result = Spectre(expected_poison_rate=0.1).apply(context(model, poisoned, poisoned.split.subset(torch.arange(0)),
                                                            num_classes=2))
    target = poisoned.split.labels == 0
    assert result.extras["suspected_target"] == 0
    assert auroc(result.sample_scores[target], is_poison[target]) > 0.8
    assert auroc(result.sample_scores, is_poison) > 0.8
    assert int(result.flagged.sum()) == 60 and not result.flagged[~target].any()  # round(1.5 * 40), the target only
    assert float(result.flagged[is_poison].float().mean()) > 0.6


def test_spectre_config_errors():
    for kwargs, fragment in ((dict(alpha=0), "defense.alpha=0 is invalid"), (dict(removal="all"), "removal='all' is unknown"),
                             (dict(expected_poison_rate=1), "expected_poison_rate=1 is out of range"),
                             (dict(dims=0), "defense.dims=0 is invalid"), (dict(layer="conv"), "layer='conv' is unknown")):
        with pytest.raises(ConfigError, match=fragment):
            Spectre(**kwargs)


# ---- the scale rehearsal: the zoo at 10, 43 and 200 classes, 28, 32 and 64 px ---------------------


@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_spectre_runs_on_the_zoo(name, shape, classes, kwargs):
    model = zoo_model(name, shape, classes, kwargs)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (40, *shape), dtype=torch.uint8, generator=g)
    labels = torch.cat([torch.zeros(30, dtype=torch.long), torch.randint(0, classes, (10,), generator=g)])
    ctx = DefenseContext(model=model, poisoned_train=Split(data, labels), poisoned_indices=torch.arange(0),
                         clean_subset=Split(data[:0], labels[:0]), trainer=SimpleNamespace(device="cpu", eval_batch_size=16),
                         num_classes=classes, generator=g)
    Spectre().check_model(model.net)
    result = Spectre().apply(ctx)
    assert result.sample_scores.shape == (40,) and result.flagged.dtype == torch.bool
    assert torch.isfinite(result.sample_scores).all() and result.extras["suspected_target"] == 0
    assert int(result.flagged.sum()) == round(1.5 * round(0.1 * 40))  # eps = 0.1 N, under a third of class 0
