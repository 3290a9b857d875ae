"""AGPD (Yuan et al., ICLR 2025): the activation gradients against per-sample autograd, the layer rule,
the dispersion, anomaly index, filtering rounds and JS window against transcriptions of the official
functions, the two GCD observations and the detection on a tiny BadNets victim, and the zoo at scale."""

from __future__ import annotations

import heapq
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses import agpd
from backdoorbench.defenses.agpd import AGPD
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.errors import ConfigError
from backdoorbench.metrics.detection import auroc
from backdoorbench.models.base import ImageClassifier
from tests.tiny import ZOO, one_thread, tiny_badnets_victim, zoo_model  # noqa: F401  (one_thread: autouse)


# ---- the activation gradient and the layers -------------------------------------------------------

class Residual(ImageClassifier):
    """A conv whose output a residual sum then changes in place, as a PreAct block's `out += shortcut`."""
    name = "residual"

    def __init__(self, num_classes: int = 3, **_):
        super().__init__()
        self.a, self.b = nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4, num_classes)

    def forward(self, x):
        h = torch.relu(self.a(x))
        out = self.b(h)
        out += h
        return self.head(torch.tanh(out).mean((2, 3)))


def test_activation_gradients_are_each_samples_own_label_logit_gradient():
    torch.manual_seed(0)
    model = Residual().eval()
    images = torch.randint(0, 256, (5, 1, 6, 6), dtype=torch.uint8)
    labels = torch.tensor([0, 2, 1, 1, 0])
    got = agpd.activation_gradients(model, [model.a, model.b], images, labels, "cpu", batch_size=3)
    for i in range(5):  # one sample at a time, by hand: d logit_y / d conv output, averaged over positions
        x = to_float(images[i:i + 1])
        h = torch.relu(model.a(x))
        h.retain_grad()
        pre = model.b(h)
        pre.retain_grad()
        logits = model.head(torch.tanh(pre + h).mean((2, 3)))
        logits[0, labels[i]].backward()
        a_out = model.a(x)  # the gradient at a's output is the one at h through the relu
        expected_a = (h.grad * (a_out > 0)).mean((2, 3))[0]
        assert np.allclose(got[0][i], expected_a.detach().numpy(), atol=1e-6)
        assert np.allclose(got[1][i], pre.grad.mean((2, 3))[0].numpy(), atol=1e-6)


def test_candidate_layers_are_the_official_lists_on_its_models():
    layers = {name: [n for n, _ in agpd.candidate_layers(zoo_model(name, shape, classes, kwargs))]
              for name, shape, classes, kwargs in ZOO}
    assert len(layers["preact_resnet18"]) == 16 and len(layers["resnet18"]) == 16  # the block convs: no stem, no shortcut
    assert not any("shortcut" in n for n in layers["preact_resnet18"] + layers["resnet18"])
    assert layers["preact_resnet18"][0].endswith("1.0.conv1") and layers["preact_resnet18"][-1].endswith("4.1.conv2")
    assert len(layers["vgg16_bn"]) == 13 and layers["vgg16_bn"][0] == "net.features.0"  # every conv, the first too
    assert layers["mnist_cnn"] == ["net.features.0", "net.features.4"]
    with pytest.raises(ConfigError, match="no nn.Conv2d wider than 1x1"):
        AGPD().check_model(nn.Sequential(nn.Flatten(), nn.Linear(4, 2)))


# ---- the statistics against transcriptions of the official functions ------------------------------

def official_similarity(a, b):  # `compute_distance(.., 'cosin')`: 1 - scipy's cosine distance
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def official_unsimilar(grads, ref):  # `get_unsimilar_sample_idx(grads, ref, [], 1)`
    sims = [official_similarity(g, ref) for g in grads]
    low = heapq.nsmallest(1, sims)
    return [i for i, s in enumerate(sims) if s in low]


def official_gap(grads, ref):  # `compute_change(...) / np.sqrt(len(class))`
    seed = official_unsimilar(grads, ref)
    mean = grads[seed].mean(0)
    diff = [official_similarity(g, ref) - official_similarity(g, mean) for i, g in enumerate(grads) if i not in seed]
    return np.linalg.norm(diff) / np.sqrt(len(grads))


def official_mad(gaps):
    median = np.median(gaps)
    j = np.abs(gaps - median) / 1.4826 / (np.median(np.abs(gaps - median)) + 1e-6)
    j[(gaps - median) < 0] = 0
    return j


def official_filter(grads, ref, tau):
    """The official loop (`stage1_new` until it takes nothing), its iterations and JS values."""
    from scipy.spatial.distance import jensenshannon

    def rates_of(taken):
        mean = grads[taken].mean(0)
        idx = [i for i in range(len(grads)) if i not in taken]
        rates = [(1 - official_similarity(grads[i], mean))
                 / ((1 - official_similarity(grads[i], mean)) + (1 - official_similarity(grads[i], ref))) for i in idx]
        return idx, rates

    taken = list(official_unsimilar(grads, ref))
    iterations, js = [list(taken)], []
    _, before = rates_of(taken)
    bins = np.linspace(0, 1, 100)
    while len(taken) < len(grads):
        idx, rates = rates_of(taken)
        span = max(rates) - min(rates)
        if span:
            take = [i for r, i in zip(rates, idx) if (r - min(rates)) / span <= tau]
        else:  # all alike: all of them when above tau, else those at most tau
            take = idx if min(rates) > tau else [i for r, i in zip(rates, idx) if r <= tau]
        after = [r for i, r in zip(idx, rates) if i not in take]
        iterations.append(take)
        taken += take
        if not before or not after:
            js.append(1)
        else:
            js.append(jensenshannon(np.histogram(before, bins=bins, density=True)[0],
                                    np.histogram(after, bins=bins, density=True)[0]))
        before = after
    return iterations, js


def official_window(js, size=10):
    scores = []
    for s in range(len(js) - size + 1):
        w = js[s:s + size]
        avg = sum(w) / size
        scores.append(avg + 5 * (sum((x - avg) ** 2 for x in w) / size) ** 0.5)
    return int(np.argsort(scores)[0])


def two_clusters(seed: int, n_clean: int = 60, n_poison: int = 25, dim: int = 12):
    """Gradients of one class: a clean cloud around the reference, a poisoned one in another direction."""
    rng = np.random.default_rng(seed)
    ref = rng.normal(size=dim)
    away = rng.normal(size=dim)
    clean = ref + 0.6 * rng.normal(size=(n_clean, dim))
    poison = away + 0.3 * rng.normal(size=(n_poison, dim))
    return np.concatenate([clean, poison]), ref, np.r_[np.zeros(n_clean, bool), np.ones(n_poison, bool)]


def test_dispersion_anomaly_index_filtering_and_window_equal_the_official_functions():
    grads, ref, is_poison = two_clusters(0)
    assert agpd.dispersion(grads, ref) == pytest.approx(official_gap(grads, ref), rel=1e-12)
    gaps = np.array([0.1, 0.12, 0.09, 0.5, 0.11, 0.3])
    assert agpd.anomaly_index(gaps) == pytest.approx(official_mad(gaps))
    for tau in (0.05, 0.2):
        ours = agpd.absorb(grads, ref, tau)
        iterations, js = official_filter(grads, ref, tau)
        assert ours.rounds.max() == len(iterations) - 1
        for r, members in enumerate(iterations):
            assert sorted(np.flatnonzero(ours.rounds == r).tolist()) == sorted(members)
        assert ours.js == pytest.approx(js, abs=1e-12)
    rng = np.random.default_rng(1)
    for _ in range(5):
        js = rng.random(int(rng.integers(10, 30))).tolist()
        assert agpd.window_start(js, 10) == official_window(js)
    assert agpd.window_start([0.5, 0.1, 0.1], 10) == 0  # fewer than 10: the official stops; ours one window


def test_the_filtering_takes_the_planted_cluster_first_and_stops_after_it():
    grads, ref, is_poison = two_clusters(2, n_clean=150, n_poison=60)
    taken = agpd.absorb(grads, ref, 0.05)
    start = agpd.window_start(taken.js, 10)
    assert is_poison[taken.rounds == 0].all()  # the basic sample: a poisoned one
    assert taken.rounds[is_poison].max() < taken.rounds[~is_poison].min()  # all the poison before any clean
    flagged = taken.rounds < start
    assert flagged[is_poison].mean() > 0.9 and flagged[~is_poison].mean() < 0.1


def test_choose_targets_is_the_official_rule():
    gaps = np.array([[0.1, 0.1, 0.1, 0.1], [0.1, 0.12, 0.11, 0.9]])
    indices = np.stack([official_mad(g) for g in gaps])
    assert agpd.choose_targets(gaps, indices, math.exp(2), 0.3) == (1, [3])
    flat = np.array([[0.35, 0.1, 0.4, 0.2], [0.31, 0.1, 0.1, 0.2], [0.1, 0.1, 0.1, 0.2]])
    low = np.zeros_like(flat)  # no layer reaches e^2: the 4th-2nd last layers (here 0 and 1) by gap > 0.3
    assert agpd.choose_targets(flat, low, math.exp(2), 0.3) == (0, [0, 2])
    assert agpd.choose_targets(flat * 0.1, low, math.exp(2), 0.3) == (None, [])  # a clean model


# ---- the defining property on a tiny BadNets victim -----------------------------------------------

@pytest.fixture(scope="module")
def badnets_victim():
    return tiny_badnets_victim(800, 4, 80)  # the defender's clean samples: 20 of each class


def context(model, poisoned, clean) -> DefenseContext:
    return DefenseContext(model=model, poisoned_train=poisoned.split, poisoned_indices=poisoned.indices,
                          clean_subset=clean, trainer=SimpleNamespace(device="cpu", eval_batch_size=128), num_classes=4,
                          generator=torch.Generator().manual_seed(4))


def test_the_target_class_gcd_disperses_and_separates_and_its_poison_is_flagged(badnets_victim):
    model, poisoned, is_poison, clean = badnets_victim
    result = AGPD().apply(context(model, poisoned, clean))
    extras = result.extras
    # observation 1: the target class's GCD is far more dispersed than the clean classes' (anomaly index > e^2)
    assert extras["targets"] == [0] and not extras["clean_model"]
    index = extras["anomaly_index"]
    assert index["0"] > math.exp(2) and max(index[c] for c in ("1", "2", "3")) < 1.0, index
    # observation 2: in the target class, the poisoned gradients lie near the basic sample (a poisoned one) and
    # the clean ones near the clean reference: cos(g, g_b) - cos(g, ref) tells them apart
    layers = agpd.candidate_layers(model)
    layer = next(m for n, m in layers if n == extras["layer"])
    refs, _ = agpd.clean_references(model, [layer], clean, 4, 10, torch.Generator().manual_seed(4), "cpu", 128)
    target = torch.nonzero(poisoned.split.labels == 0).flatten()
    g = agpd.activation_gradients(model, [layer], poisoned.split.images[target], poisoned.split.labels[target], "cpu", 128)[0]
    g = g.astype(np.float64)
    seed = agpd.basic_sample(g, refs[0][0])
    assert is_poison[target[seed]].all()
    side = agpd.cosine(g, g[seed].mean(0)) - agpd.cosine(g, refs[0][0])
    assert auroc(torch.from_numpy(side), is_poison[target]) > 0.97
    # the verdict: the rounds before the settled window are the poison
    tpr = float(result.flagged[is_poison].float().mean())
    fpr = float(result.flagged[~is_poison].float().mean())
    assert tpr > 0.9 and fpr < 0.1, (tpr, fpr)  # 1.0 and 0.04 here
    assert auroc(result.sample_scores, is_poison) > 0.97  # 0.999 here
    assert bool(((result.sample_scores > 0) == result.flagged).all())  # the score's sign is the verdict
    assert result.sample_scores[poisoned.split.labels != 0].max() < result.sample_scores[target].min()


def test_a_class_without_a_clean_reference_is_never_a_target(badnets_victim):
    model, poisoned, is_poison, clean = badnets_victim
    few = clean.subset(torch.nonzero(clean.labels != 0).flatten())
    result = AGPD().apply(context(model, poisoned, few))
    assert result.extras["unreferenced_classes"] == [0] and 0 not in result.extras["targets"]
    assert not result.flagged[poisoned.split.labels == 0].any()


def test_agpd_config_errors():
    for kwargs, fragment in ((dict(tau=1), "defense.tau=1 is out of range"), (dict(tau=-0.1), "defense.tau=-0.1 is out of range"),
                             (dict(clean_per_class=0), "defense.clean_per_class=0 is invalid"),
                             (dict(anomaly_threshold=0), "defense.anomaly_threshold=0 is invalid"),
                             (dict(fallback_gap=0), "defense.fallback_gap=0 is invalid"),
                             (dict(window=0), "defense.window=0 is invalid"),
                             (dict(clean_fraction=0), "defense.clean_fraction=0 is out of range")):
        with pytest.raises(ConfigError, match=fragment):
            AGPD(**kwargs)


# ---- the scale rehearsal: the zoo at 10, 43 and 200 classes, 28, 32 and 64 px ---------------------

@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_agpd_runs_on_the_zoo(name, shape, classes, kwargs):
    model = zoo_model(name, shape, classes, kwargs)
    AGPD().check_model(model)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (40, *shape), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, classes, (40,), generator=g)
    with torch.no_grad():  # the clean samples labelled as the untrained model predicts, so every class it names has a reference
        predicted = model(to_float(data[:20])).argmax(1)
    ctx = DefenseContext(model=model, poisoned_train=Split(data, labels), poisoned_indices=torch.arange(0),
                         clean_subset=Split(data[:20], predicted), trainer=SimpleNamespace(device="cpu", eval_batch_size=16),
                         num_classes=classes, generator=g)
    result = AGPD().apply(ctx)
    assert result.sample_scores.shape == (40,) and result.flagged.dtype == torch.bool
    assert torch.isfinite(result.sample_scores).all()
    assert result.artifacts["agpd_anomaly_index"].shape == (len(agpd.candidate_layers(model)), classes)
