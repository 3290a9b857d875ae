"""SCAn (Tang et al., USENIX Security 2021): the global EM, the untangling and J against a transcription of
the official code (pysrc/SCAn.py), the defining property on features where one class is a mixture of two identities
sharing the variation (and its failure when the untangling ignores the shared covariance), a tiny
BadNets victim end to end, bad values, and the zoo at scale."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from backdoorbench.attacks.badnets import BadNets
from backdoorbench.datasets.base import Split
from backdoorbench.defenses import scan
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.scan import Scan
from backdoorbench.errors import ConfigError
from backdoorbench.metrics.detection import auroc
from backdoorbench.models.base import Normalized
from tests.test_defenses_detect import TinyNet, quadrant_data, tiny_trainer
from tests.tiny import ZOO, one_thread, zoo_model  # noqa: F401 (one_thread: autouse)


# ---- a transcription of the official code (pysrc/SCAn.py; calc_test also with the paper's G) ------

def official_global(reprs, labels, n_classes, eps, max_iters=100):
    n, m = reprs.shape
    x = reprs - reprs.mean(0)
    cnt = np.zeros(n_classes)
    mean_f = np.zeros((n_classes, m))
    for k in range(n_classes):
        cnt[k] = np.sum(labels == k)
        mean_f[k] = x[labels == k].mean(0)
    u, e = np.zeros((n, m)), np.zeros((n, m))
    for i in range(n):
        u[i] = mean_f[labels[i]]
        e[i] = x[i] - u[i]
    su, se = np.cov(u.T), np.cov(e.T)
    dist, iters = 1e5, 0
    while dist > eps and iters < max_iters:
        iters += 1
        last_su, last_se = su, se
        f = np.linalg.pinv(se)
        g_set = [-np.linalg.pinv(cnt[k] * su + se) @ (su @ f) for k in range(n_classes)]
        u_m = np.zeros((n_classes, m))
        for i in range(n):
            u_m[labels[i]] -= se @ g_set[labels[i]] @ x[i]
        u = np.array([u_m[labels[i]] for i in range(n)])
        e = x - u
        su, se = np.cov(u.T), np.cov(e.T)
        dist = np.linalg.norm(su - last_su) + np.linalg.norm(se - last_se)
    return su, se


def official_split(x, f, subg, eps=1e-5):
    n = len(x)
    subg = subg.copy()
    last = -np.ones(n)
    steps = 0
    while np.linalg.norm(subg - last) > eps and np.linalg.norm((1 - subg) - last) > eps and steps < 100:
        steps += 1
        last = subg.copy()
        idx1, idx2 = subg >= 0.5, subg < 0.5
        if idx1.sum() == 0 or idx2.sum() == 0:
            break
        u1, u2 = x[idx1].mean(0), x[idx2].mean(0)
        bias = u1 @ f @ u1 - u2 @ f @ u2
        for i in range(n):
            subg[i] = 1 if bias - 2 * (x[i] @ f @ (u1 - u2)) < 0 else 0
    return subg, u1, u2


def official_test(x, su, se, f, subg, u1, u2, official_code=False):
    n = len(x)
    g = -np.linalg.pinv(n * su + se)
    if not official_code:  # the paper's G (`G = G*SuF`, as the official EM), which calc_test drops
        g = g @ su @ f
    mu = np.zeros(x.shape[1])
    for i in range(n):
        mu -= se @ g @ x[i]
    n1 = np.sum(subg >= 0.5)
    sc = n1 * (mu @ f @ mu - u1 @ f @ u1) + (n - n1) * (mu @ f @ mu - u2 @ f @ u2)
    for i in range(n):
        sc -= 2 * x[i] @ f @ (mu - (u1 if subg[i] >= 0.5 else u2))
    return sc / n


def mixture_features(seed: int = 0, shift: float = 6.0, classes: int = 8, per_class: int = 150, poison: int = 30):
    """Gaussian classes in 10 dimensions sharing one anisotropic variation (one axis 10x the others);
    class 2 also holds `poison` samples of a second identity, `shift` along a low-variance axis."""
    rng = np.random.default_rng(seed)
    d = 10
    scales = np.ones(d)
    scales[0] = 10.0
    rot = np.linalg.qr(rng.normal(size=(d, d)))[0]

    def variation(m):
        return (rng.normal(size=(m, d)) * scales) @ rot.T

    means = rng.normal(size=(classes, d)) * 3
    train = [variation(per_class) + means[c] for c in range(classes)] + [variation(poison) + means[2] + shift * rot[:, 3]]
    labels = np.concatenate([np.repeat(np.arange(classes), per_class), np.full(poison, 2)])
    is_poison = np.arange(len(labels)) >= classes * per_class
    clean = np.concatenate([variation(40) + means[c] for c in range(classes)])
    return np.concatenate(train), labels, is_poison, clean, np.repeat(np.arange(classes), 40)


def test_global_em_matches_the_official_loop():
    train, labels, _, clean, clean_labels = mixture_features(classes=4, per_class=10)
    model = scan.fit_global(clean, clean_labels, tol=1e-5)
    su, se = official_global(clean, clean_labels, 4, 1e-5)
    assert model.basis.shape == (10, 10)  # full rank: the basis only rotates
    assert np.allclose(model.basis @ model.su @ model.basis.T, su, atol=1e-8)
    assert np.allclose(model.basis @ model.se @ model.basis.T, se, atol=1e-8)


@pytest.mark.parametrize("identity", scan.IDENTITIES)
def test_untangling_and_j_match_the_official_code(identity):
    train, labels, _, clean, clean_labels = mixture_features(classes=4, per_class=30, poison=8)
    model = scan.fit_global(clean, clean_labels)
    su, se = model.basis @ model.su @ model.basis.T, model.basis @ model.se @ model.basis.T
    f = np.linalg.pinv(se)
    x = train - train.mean(0)
    members = x[labels == 2]
    start = np.random.default_rng(1).random(len(members))
    subg, u1, u2 = official_split(members, f, start)
    expected = official_test(members, su, se, f, subg, u1, u2, official_code=identity == "official_code")
    whiten = scan.whitener(model.se)
    projected = model.project(train)[labels == 2]
    first, v1, v2 = scan.untangle(whiten(projected), start)
    assert (first == (subg >= 0.5)).all()
    mu = scan.identities(projected.sum(0, keepdims=True), [len(projected)], model.su, model.se, identity)
    assert scan.j_statistic(whiten(projected), whiten(mu)[0], first, v1, v2) == pytest.approx(expected, rel=1e-8)


def test_the_anomaly_index_is_the_official():
    j = np.array([1.0, 2.0, 4.0, 50.0])
    a = j / j.max()  # the official divides by max(J) first: the index is the same
    expected = np.abs(a - np.median(a)) / (np.median(np.abs(a - np.median(a))) * 1.4826)
    assert scan.anomaly_index(j) == pytest.approx(expected)


# ---- the defining property: a class that is a mixture of two identities stands out ---------------

def test_the_mixed_class_stands_out_and_its_second_identity_is_flagged():
    train, labels, is_poison, clean, clean_labels = mixture_features()
    scores, flagged, stats = scan.detect(train, labels, clean, clean_labels, 8, torch.Generator().manual_seed(0))
    index = stats["anomaly_index"]
    assert index["2"] > math.exp(2) and max(v for c, v in index.items() if c != "2") < math.exp(2)
    assert stats["suspected_classes"] == [2]
    truth = torch.from_numpy(is_poison)
    assert bool(flagged[truth].all()) and not flagged[~truth].any()
    assert auroc(scores, truth) > 0.99


def test_untangling_without_the_shared_variation_misses_the_mixed_class(monkeypatch):
    # A wrong SCAn: Euclidean two-means and J (S_e ignored). Every class then splits along the variation's
    # large axis, and the second identity, along a small one, no longer stands out.
    train, labels, is_poison, clean, clean_labels = mixture_features()
    monkeypatch.setattr(scan, "whitener", lambda se: lambda v: np.atleast_2d(v))
    scores, _, stats = scan.detect(train, labels, clean, clean_labels, 8, torch.Generator().manual_seed(0))
    assert stats["anomaly_index"]["2"] < math.exp(2) and stats["suspected_classes"] == []
    assert auroc(scores, torch.from_numpy(is_poison)) < 0.8


def test_a_single_identity_flags_nothing():
    train, labels, is_poison, clean, clean_labels = mixture_features(poison=0)
    _, flagged, stats = scan.detect(train, labels, clean, clean_labels, 8, torch.Generator().manual_seed(0))
    assert stats["suspected_classes"] == [] and not flagged.any()


# ---- end to end on a tiny BadNets victim -----------------------------------------------------------

@pytest.fixture(scope="module")
def badnets_victim():
    torch.manual_seed(0)
    train = quadrant_data(600, seed=0, num_classes=4)
    attack = BadNets(num_classes=4, image_shape=(1, 8, 8), patch_size=3, poison_rate=0.05)
    poisoned = attack.poison_dataset(train, torch.Generator().manual_seed(0))
    model = Normalized(TinyNet(4), (0.3,), (0.3,))
    tiny_trainer(6).fit(model, poisoned.split, generator=torch.Generator().manual_seed(0))
    is_poison = torch.zeros(len(train), dtype=torch.bool)
    is_poison[poisoned.indices] = True
    return model, poisoned, is_poison


def test_scan_flags_the_badnets_samples_of_the_target(badnets_victim):
    model, poisoned, is_poison = badnets_victim
    clean = poisoned.split.subset(torch.nonzero(~is_poison).flatten()[::4])
    ctx = DefenseContext(model=model, poisoned_train=poisoned.split, poisoned_indices=poisoned.indices,
                         clean_subset=clean, trainer=SimpleNamespace(device="cpu", eval_batch_size=64), num_classes=4,
                         generator=torch.Generator().manual_seed(4))
    result = Scan().apply(ctx)
    assert result.extras["suspected_classes"] == [0], result.extras
    assert auroc(result.sample_scores, is_poison) > 0.95
    tpr = float(result.flagged[is_poison].float().mean())
    fpr = float(result.flagged[~is_poison].float().mean())
    assert tpr > 0.9 and fpr < 0.05, (tpr, fpr)


def test_scan_config_errors():
    for kwargs, fragment in ((dict(threshold=0), "defense.threshold=0 is invalid"),
                             (dict(identity="mean"), "defense.identity='mean' is unknown"),
                             (dict(em_tol=0), "defense.em_tol=0 is invalid"),
                             (dict(max_iters=0), "defense.max_iters=0 is invalid"),
                             (dict(clean_fraction=0), "defense.clean_fraction=0 is out of range")):
        with pytest.raises(ConfigError, match=fragment):
            Scan(**kwargs)
    with pytest.raises(ConfigError, match="no .features"):
        Scan().check_model(SimpleNamespace())


# ---- the scale rehearsal: the zoo at 10, 43 and 200 classes, 28, 32 and 64 px ---------------------


@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_scan_runs_on_the_zoo(name, shape, classes, kwargs):
    model = zoo_model(name, shape, classes, kwargs)
    Scan().check_model(model.net)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (60, *shape), dtype=torch.uint8, generator=g)
    labels = torch.cat([torch.arange(6).repeat(5), torch.randint(0, classes, (30,), generator=g)])
    ctx = DefenseContext(model=model, poisoned_train=Split(data, labels), poisoned_indices=torch.arange(0),
                         clean_subset=Split(data[:30], labels[:30]), trainer=SimpleNamespace(device="cpu", eval_batch_size=16),
                         num_classes=classes, generator=g)
    result = Scan().apply(ctx)
    assert result.sample_scores.shape == (60,) and result.flagged.dtype == torch.bool
    assert torch.isfinite(result.sample_scores).all()
    assert 0 < result.extras["variation_rank"] <= 24  # 30 clean samples in 6 classes: 24 within-class directions
