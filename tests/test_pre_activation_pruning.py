"""EP and BNP (Zheng, Tang, Li, Liu, NeurIPS 2022): the scores come from the BatchNorm inputs
(pre-activations), EP's entropy and BNP's KL are the official formulas, and each prunes the channel
that the poison shaped, and only when the poison is there to shape it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from backdoorbench.datasets.base import Split
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.bnp import BatchNormPruning
from backdoorbench.defenses.ep import EntropyPruning
from backdoorbench.defenses.pre_activation import gaussian_kl, histogram_entropy
from backdoorbench.errors import ConfigError, DataError
from tests.tiny import ZOO, zoo_model

CHANNELS = 16


def official_entropy(x: torch.Tensor, step: float) -> torch.Tensor:
    """A transcription of the official `batch_entropy_2` loop (RJ-T/NIPS2022_EP_BNP, defense.py:48-62)."""
    bars = int((x.max() - x.min()) / step)
    entropy = torch.zeros(x.shape[0], dtype=x.dtype)
    for n in range(bars):
        num = ((x > x.min() + n * step) & (x < x.min() + (n + 1) * step)).sum(-1)
        p = num / x.shape[-1]
        logp = -p * p.log()
        entropy += torch.where(torch.isnan(logp), torch.zeros_like(logp), logp)
    return entropy


def test_histogram_entropy_is_the_official_loop():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=g, dtype=torch.float64)
    x[2] = torch.cat([torch.full((150,), -1.0), torch.full((150,), 1.0)]) + 1e-3 * torch.randn(300, generator=g, dtype=torch.float64)
    x = (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)
    for step in (0.01, 0.1, 0.5):
        assert torch.allclose(histogram_entropy(x, step), official_entropy(x, step), atol=1e-9)
    assert histogram_entropy(x, 0.01)[2] < 0.5 * histogram_entropy(x, 0.01)[[0, 1, 3, 4, 5]].min()  # two modes


def test_gaussian_kl_is_the_kl_between_the_two_normals():
    g = torch.Generator().manual_seed(1)
    mu1, mu2 = torch.randn(5, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)
    var1, var2 = torch.rand(5, generator=g, dtype=torch.float64) + 0.1, torch.rand(5, generator=g, dtype=torch.float64) + 0.1
    expected = torch.distributions.kl_divergence(torch.distributions.Normal(mu1, var1.sqrt()),
                                                 torch.distributions.Normal(mu2, var2.sqrt()))
    assert torch.allclose(gaussian_kl(mu1, var1, mu2, var2), expected)


class Net(nn.Module):
    """conv -> BN -> ReLU -> pool -> linear on 2-plane images. Conv channel 0 sums 3x3 windows of the
    second plane, where the trigger is (a backdoor neuron); the others are random filters of the first."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.conv = nn.Conv2d(2, CHANNELS, 3, bias=False)
        self.bn = nn.BatchNorm2d(CHANNELS)
        self.head = nn.Linear(CHANNELS, 2)
        with torch.no_grad():
            self.conv.weight.zero_()
            self.conv.weight[1:, 0] = 0.3 * torch.randn(CHANNELS - 1, 3, 3, generator=g)
            self.conv.weight[0, 1] = 1.0 + 0.1 * torch.randn(3, 3, generator=g)  # (unequal: no ties on uint8 sums)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def images(n: int, poisoned: int, seed: int) -> torch.Tensor:
    """Dim noise images (uint8, 2 planes), the first `poisoned` with a white 3x3 corner on the second
    plane (the trigger)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(n, 2, 12, 12, generator=g) * 60).to(torch.uint8)
    x[:poisoned, 1, -3:, -3:] = 255
    return x


def context(model, train: torch.Tensor, clean: torch.Tensor | None = None) -> DefenseContext:
    labels = torch.zeros(len(train), dtype=torch.long)
    clean = train[:0] if clean is None else clean
    return DefenseContext(model=model, poisoned_train=Split(train, labels), poisoned_indices=torch.arange(0),
                          clean_subset=Split(clean, torch.zeros(len(clean), dtype=torch.long)),
                          trainer=SimpleNamespace(device="cpu"), num_classes=2, generator=torch.Generator().manual_seed(0))


def fit_running_stats(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """The BN's running statistics as training on `x` leaves them (a cumulative average)."""
    model.bn.momentum = None
    model.train()
    with torch.no_grad():
        for batch in x.float().div(255).split(64):
            model(batch)
    model.eval()
    return model


def test_ep_prunes_the_channel_whose_pre_activation_is_a_mixture_and_only_with_the_poison_present():
    poisoned_set = images(400, 40, seed=3)  # 10% carry the trigger
    model = fit_running_stats(Net(), poisoned_set)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    defense = EntropyPruning(u=3.0, batch_size=400)
    result = defense.apply(context(model, poisoned_set))
    assert result.extras["pruned_channels"] == [[0]] and result.extras["n_images"] == 400
    bn = result.model.bn
    assert bn.weight[0] == 0 and bn.bias[0] == before["bn.bias"][0]  # the official surgery: the weight only
    assert torch.equal(bn.weight[1:], before["bn.weight"][1:]) and torch.equal(result.model.conv.weight, before["conv.weight"])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the victim is left as it was
    assert result.artifacts["scores_0"].argmin() == 0
    clean_set = images(400, 0, seed=3)  # the same model and images without the trigger: nothing to expose
    assert EntropyPruning(u=3.0, batch_size=400).apply(context(model, clean_set)).extras["n_pruned"] == 0


def test_bnp_prunes_the_channel_whose_running_statistics_the_poison_moved():
    clean = images(100, 0, seed=5)
    poisoned_model = fit_running_stats(Net(), images(400, 40, seed=4))
    result = BatchNormPruning(u=3.0).apply(context(poisoned_model, images(400, 40, seed=4), clean=clean))
    assert result.extras["pruned_channels"] == [[0]] and result.model.bn.weight[0] == 0
    assert result.model.bn.bias[0] == poisoned_model.bn.bias[0]
    # trained without the poison, the same neuron's running statistics agree with the clean batch:
    # its KL is two orders of magnitude smaller (what is left is the sampling noise of two small sets)
    clean_model = fit_running_stats(Net(), images(400, 0, seed=4))
    kl_clean = BatchNormPruning(u=3.0).apply(context(clean_model, images(400, 0, seed=4), clean=clean)).artifacts["scores_0"]
    assert result.artifacts["scores_0"][0] > 100 * kl_clean[0]


def test_bnp_reads_only_the_clean_batch_and_ep_only_the_training_set():
    """BNP's clean statistics come from ctx.clean_subset, EP's features from ctx.poisoned_train."""
    model = fit_running_stats(Net(), images(400, 40, seed=4))
    poisoned, clean = images(400, 40, seed=4), images(30, 0, seed=6)
    ctx = context(model, poisoned, clean=clean)
    bnp, ep = BatchNormPruning(u=3.0).images(ctx), EntropyPruning(batch_size=50).images(ctx)
    assert len(bnp) == 30 and len(ep) == 50
    assert {tuple(x.flatten().tolist()) for x in bnp} == {tuple(x.flatten().tolist()) for x in clean}
    assert all(any(torch.equal(x, y) for y in poisoned) for x in ep)
    assert BatchNormPruning(u=3.0).apply(ctx).extras["n_images"] == 30


def test_ep_reads_the_poisoned_set_and_holds_no_clean_data(compose_cfg):
    cfg = compose_cfg("defense=ep")
    assert cfg.defense.clean_fraction == 0.0 and not EntropyPruning.needs_clean_data
    assert EntropyPruning.excludes("lira", __import__("backdoorbench.attacks.lira", fromlist=["LIRA"]).LIRA)
    assert compose_cfg("defense=bnp").defense.clean_fraction == 0.01
    assert compose_cfg("defense=bnp", "dataset=tiny_imagenet").defense.u == 3.0  # the authors' on every dataset


@pytest.mark.parametrize(("make", "message"), [
    (lambda: EntropyPruning(u=-1), r"defense.u=-1 is invalid; use a number >= 0"),
    (lambda: EntropyPruning(step=0), r"defense.step=0 is invalid; use a number > 0"),
    (lambda: BatchNormPruning(batch_size=1), r"defense.batch_size=1 is invalid; use an integer >= 2"),
    (lambda: BatchNormPruning(clean_fraction=0), r"defense.clean_fraction=0 is out of range"),
])
def test_bad_values_are_one_config_error(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_a_model_without_batch_norm_and_an_empty_clean_set_are_one_line_each():
    plain = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(), nn.LazyLinear(2))
    with pytest.raises(ConfigError, match="BatchNorm2d"):
        EntropyPruning().apply(context(plain, images(10, 1, seed=0)))
    with pytest.raises(DataError, match=r"defense bnp got 1 clean image\(s\).*defense.clean_fraction"):
        BatchNormPruning().apply(context(Net(), images(10, 1, seed=0), clean=images(1, 0, seed=0)))


def test_a_constant_channel_is_left_unscored():
    model = fit_running_stats(Net(), images(200, 20, seed=7))
    with torch.no_grad():
        model.conv.weight[5] = 0.0  # its pre-activation is 0 everywhere: standardising it is 0/0
    result = EntropyPruning(u=3.0, batch_size=200).apply(context(model, images(200, 20, seed=7)))
    assert result.extras["n_unscored"] == 1 and 5 not in result.extras["pruned_channels"][0]
    assert math.isnan(float(result.artifacts["scores_0"][5]))


# The scale rehearsal: every model of the zoo with batch norm, at 10, 43 and 200 classes and 28, 32 and
# 64 px: both defenses score every BatchNorm2d from one batch and leave a model that still classifies.


@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_both_defenses_score_every_batch_norm_of_the_zoo(name, shape, classes, kwargs):
    model = zoo_model(name, shape, classes, kwargs)
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (24, *shape), dtype=torch.uint8, generator=g)
    ctx = DefenseContext(model=model, poisoned_train=Split(data, torch.zeros(24, dtype=torch.long)),
                         poisoned_indices=torch.arange(0), clean_subset=Split(data[:12], torch.zeros(12, dtype=torch.long)),
                         trainer=SimpleNamespace(device="cpu"), num_classes=classes, generator=g)
    for defense in (EntropyPruning(), BatchNormPruning()):
        result = defense.apply(ctx)
        assert result.extras["n_layers"] == n_bn > 0 and len(result.artifacts) == n_bn
        with torch.no_grad():
            assert result.model(data[:2].float() / 255).shape == (2, classes)


def test_a_model_without_batch_norm_is_refused_by_the_preflight_before_data_loads(compose_cfg, monkeypatch):
    from backdoorbench import validation
    from backdoorbench.models.mnist_cnn import MnistCNN

    def no_data(*args, **kwargs):
        raise AssertionError("the data was loaded")

    monkeypatch.setattr("backdoorbench.datasets.mnist5k.load_mnist5k", no_data)
    validation.validate_config(compose_cfg("defense=ep"))  # mnist_cnn has two BatchNorm2d
    plain = MnistCNN.__init__
    monkeypatch.setattr(MnistCNN, "__init__", lambda self, **kw: plain(self, **kw, norm_layer=lambda c: nn.Identity()))
    for name in ("ep", "bnp"):
        with pytest.raises(ConfigError, match=r"BatchNorm2d .*model 'mnist_cnn' has none; choose one with batch norm"):
            validation.validate_config(compose_cfg(f"defense={name}"))

