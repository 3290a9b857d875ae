"""DBD (Huang et al., ICLR 2022): the losses are the official ones, stage 1 never reads a label, stage 2
moves the classifier alone, the stage-3 split keeps the low-SCE samples labelled, and on a small
backdoored set the poisoned samples land in the unlabelled part far more than the clean ones."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backdoorbench.datasets.base import Split
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.dbd import (DBD, credible_split, gaussian_blur, interleave, simclr_loss, simclr_view,
                                        symmetric_cross_entropy)
from backdoorbench.errors import ConfigError, DataError
from backdoorbench.train import Trainer
from tests.tiny import make_model, one_thread  # noqa: F401  (autouse fixture)
from tests.tiny import ZOO, zoo_model

# ------------------------------------------------------------------- the official losses, transcribed


def official_simclr_loss(features, temperature):
    """A transcription of the official SimCLRLoss.forward (model/loss.py), on the CPU."""
    b, n, dim = features.size()
    mask = torch.eye(b, dtype=torch.float32)
    contrast_features = torch.cat(torch.unbind(features, dim=1), dim=0)
    anchor = features[:, 0]
    dot_product = torch.matmul(anchor, contrast_features.T) / temperature
    logits_max, _ = torch.max(dot_product, dim=1, keepdim=True)
    logits = dot_product - logits_max.detach()
    mask = mask.repeat(1, 2)
    logits_mask = torch.scatter(torch.ones_like(mask), 1, torch.arange(b).view(-1, 1), 0)
    mask = mask * logits_mask
    exp_logits = torch.exp(logits) * logits_mask
    log_prob = logits - torch.log(exp_logits.sum(1, keepdim=True))
    return -((mask * log_prob).sum(1) / mask.sum(1)).mean()


def official_sce(x, target, alpha, beta, num_classes):
    """The official SCELoss (CE + RCELoss) with reduction 'none'."""
    ce = F.cross_entropy(x, target, reduction="none")
    prob = torch.clamp(F.softmax(x, dim=-1), min=1e-7, max=1.0)
    one_hot = torch.clamp(F.one_hot(target, num_classes).float(), min=1e-4, max=1.0)
    return alpha * ce + beta * (-1 * torch.sum(prob * torch.log(one_hot), dim=-1))


def test_the_simclr_loss_is_the_official_one():
    for seed in range(3):
        features = F.normalize(torch.randn(12, 2, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), dim=2)
        assert simclr_loss(features, 0.5).item() == pytest.approx(official_simclr_loss(features, 0.5).item(), rel=1e-10)
    # only the first views anchor: swapping the two views of every sample changes the loss
    assert simclr_loss(features.flip(1), 0.5).item() != pytest.approx(simclr_loss(features, 0.5).item())


def test_the_sce_is_the_official_one_and_the_split_keeps_the_low_losses():
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(50, 7, generator=g) * 3, torch.randint(0, 7, (50,), generator=g)
    assert torch.allclose(symmetric_cross_entropy(logits, target, 0.1, 1.0), official_sce(logits, target, 0.1, 1.0, 7))
    losses = torch.rand(101, generator=g)
    for epsilon in (0.5, 0.2, 0.9):
        keep = credible_split(losses, epsilon)
        official = np.zeros(101)
        official[losses.numpy().argsort()[: int(101 * epsilon)]] = 1  # get_semi_idx
        assert torch.equal(keep, torch.tensor(official == 1))
        assert losses[keep].max() < losses[~keep].min()  # the labelled part is the low-loss part


def test_the_interleave_is_mixmatchs_and_undoes_itself():
    chunks = [torch.arange(10) + 100 * i for i in range(3)]
    mixed = interleave(chunks, 10)
    # offsets [0, 3, 6, 10]: chunk 0 takes slice 1 of chunk 1 and slice 2 of chunk 2
    assert mixed[0].tolist() == [0, 1, 2, 103, 104, 105, 206, 207, 208, 209]
    assert mixed[1].tolist() == [100, 101, 102, 3, 4, 5, 106, 107, 108, 109]
    assert all(torch.equal(a, b) for a, b in zip(interleave(mixed, 10), chunks))


def test_the_views_stay_images_and_the_blur_is_a_gaussian():
    g = torch.Generator().manual_seed(0)
    for x in (torch.rand(16, 3, 32, 32, generator=g), torch.rand(16, 1, 28, 28, generator=g)):
        view = simclr_view(x, g, True)
        assert view.shape == x.shape and view.min() >= 0 and view.max() <= 1
    dot = torch.zeros(2, 1, 21, 21)
    dot[:, :, 10, 10] = 1
    blurred = gaussian_blur(dot, torch.tensor([1.0, 2.0]))
    assert blurred.sum((1, 2, 3)).allclose(torch.ones(2))
    rows = torch.arange(21.0) - 10
    for i, sigma in enumerate((1.0, 2.0)):  # the spread along a row is the std
        profile = blurred[i, 0].sum(0)
        assert (profile * rows**2).sum().sqrt().item() == pytest.approx(sigma, rel=0.02)


# ------------------------------------------------------------- the stages, on a small backdoored set


def backdoored_set(n: int = 320, rate: float = 0.1, seed: int = 0):
    """16x16 one-channel images whose class (4) is their brightness; `rate` of them (never class 0)
    carry a white 3x3 corner and the label 0 (BadNets)."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.randint(0, 4, (n,), generator=g)
    x = (torch.rand(n, 1, 16, 16, generator=g) * 50 + 45 * truth.view(-1, 1, 1, 1).float() + 10).to(torch.uint8)
    others = torch.nonzero(truth != 0).flatten()
    poisoned = others[torch.randperm(len(others), generator=g)[: int(rate * n)]].sort().values
    x[poisoned, :, -3:, -3:] = 255
    labels = truth.clone()
    labels[poisoned] = 0
    return Split(x, labels), poisoned


def context(train: Split, poisoned, seed: int = 0, **kwargs) -> DefenseContext:
    trainer = Trainer(epochs=1, batch_size=32, crop_padding=1, progress=False)
    return DefenseContext(model=None, poisoned_train=train, poisoned_indices=poisoned,
                          clean_subset=train.subset(torch.arange(0)), trainer=trainer, num_classes=4,
                          generator=torch.Generator().manual_seed(seed), build_model=lambda: make_model(0), **kwargs)


SMALL = dict(simclr_epochs=4, simclr_cosine_period=40, simclr_batch_size=64, warmup_epochs=5, warmup_batch_size=32,
             lr=0.03, semi_epochs=0)


class Stop(Exception):
    pass


def test_stage_1_never_reads_a_label_and_stage_2_moves_the_classifier_alone(monkeypatch):
    train, poisoned = backdoored_set()
    garbage = Split(train.images, torch.randint(0, 4, (len(train),), generator=torch.Generator().manual_seed(9)))
    seen = {}
    original_stage1, original_stage2 = DBD.self_supervised, DBD.linear_warmup

    def stage1(self, model, *args, **kwargs):
        out = original_stage1(self, model, *args, **kwargs)
        seen.setdefault("after_stage1", []).append(copy.deepcopy(model.state_dict()))
        if len(seen["after_stage1"]) == 2:
            raise Stop
        return out

    def stage2(self, model, *args, **kwargs):
        seen["before"] = {k: v.clone() for k, v in model.named_parameters()}
        out = original_stage2(self, model, *args, **kwargs)
        seen["after"] = {k: v.clone() for k, v in model.named_parameters()}
        return out

    monkeypatch.setattr(DBD, "self_supervised", stage1)
    monkeypatch.setattr(DBD, "linear_warmup", stage2)
    defense = DBD(**SMALL)
    result = defense.apply(context(train, poisoned))
    with pytest.raises(Stop):  # the same seed, the labels garbage: stage 1 ends with the same weights
        defense.apply(context(garbage, poisoned))
    first, second = seen["after_stage1"]
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    initial = make_model(0).state_dict()
    assert any(not torch.equal(first[k], initial[k]) for k in initial)  # stage 1 did train
    # stage 2: every backbone weight as stage 1 left it, the classifier moved
    classifier = {f"net.{name}" for name, _ in make_model(0).net.named_parameters() if name.startswith("classifier")}
    assert classifier and all(name in seen["before"] for name in classifier)
    for name, before in seen["before"].items():
        assert torch.equal(before, seen["after"][name]) != (name in classifier), name
    assert result.model is not None and result.extras["n_labelled"] == len(train) // 2


def test_the_poisoned_samples_fall_into_the_unlabelled_part():
    train, poisoned = backdoored_set()
    is_poisoned = torch.zeros(len(train), dtype=torch.bool)
    is_poisoned[poisoned] = True
    result = DBD(**SMALL).apply(context(train, poisoned, detection_only=True))
    assert result.model is None and result.flagged.sum() == len(train) - len(train) // 2
    flagged_poisoned = result.flagged[is_poisoned].float().mean().item()
    flagged_clean = result.flagged[~is_poisoned].float().mean().item()
    assert flagged_poisoned == 1.0 and flagged_clean < 0.5  # a random backbone's split: 0.59 and 0.49
    scores = result.sample_scores
    assert scores[is_poisoned].mean() > 4 * scores[~is_poisoned].mean()  # the SCE the split ranks by


def test_the_semi_supervised_stage_trains_the_whole_model_from_the_split(monkeypatch):
    train, poisoned = backdoored_set()
    splits = []
    original = DBD.mixmatch_epoch

    def spy(self, model, split, keep, *args):
        splits.append((keep.clone(), args[-2]))
        return original(self, model, split, keep, *args)

    monkeypatch.setattr(DBD, "mixmatch_epoch", spy)
    defense = DBD(**{**SMALL, "semi_epochs": 2, "train_iterations": 3, "semi_batch_size": 16})
    result = defense.apply(context(train, poisoned))
    assert [epoch for _, epoch in splits] == [5, 6]  # counted from the warm-up's start, as the ramp-up reads it
    assert torch.equal(splits[0][0], ~result.flagged)  # the first split is the detection
    assert all(int(keep.sum()) == len(train) // 2 for keep, _ in splits)  # a fresh split every epoch, epsilon each
    assert set(result.extras) >= {"simclr_loss", "warmup_loss", "semi_loss", "semi_loss_x", "semi_loss_u"}


# ----------------------------------------------------------------------------- the zoo, bad values


@pytest.mark.parametrize(("name", "shape", "classes", "kwargs"), ZOO, ids=[z[0] for z in ZOO])
def test_the_zoo(name, shape, classes, kwargs):
    g = torch.Generator().manual_seed(0)
    data = Split(torch.randint(0, 256, (16, *shape), dtype=torch.uint8, generator=g), torch.randint(0, classes, (16,), generator=g))
    trainer = Trainer(epochs=1, batch_size=8, crop_padding=2, progress=False)
    build = lambda: zoo_model(name, shape, classes, kwargs).train()  # noqa: E731
    ctx = DefenseContext(model=build().eval(), poisoned_train=data, poisoned_indices=torch.arange(0),
                         clean_subset=data.subset(torch.arange(0)), trainer=trainer, num_classes=classes, generator=g,
                         build_model=build)
    defense = DBD(simclr_epochs=1, simclr_batch_size=16, warmup_epochs=1, warmup_batch_size=8, semi_epochs=1,
                  train_iterations=1, semi_batch_size=4)
    defense.check_model(ctx.model)
    result = defense.apply(ctx)
    with torch.no_grad():
        out = result.model.eval()(data.images[:2].float() / 255)
    assert out.shape == (2, classes) and torch.isfinite(out).all()
    assert result.flagged.sum() == 8 and result.sample_scores.shape == (16,)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: DBD(budget="gpu"), r"^defense.budget='gpu' is unknown for dbd; choose one of: official, cpu"),
    (lambda: DBD(epsilon=1), r"^defense.epsilon=1 is out of range; use a number in \(0, 1\)"),
    (lambda: DBD(temperature=0), r"^defense.temperature=0 is invalid"),
    (lambda: DBD(sce_alpha=0, sce_beta=0), r"^defense.sce_alpha=0 and defense.sce_beta=0 leave no loss"),
    (lambda: DBD(train_iterations=0), r"^defense.train_iterations=0 is invalid"),
])
def test_bad_values_are_one_config_error(make, message):
    with pytest.raises(ConfigError, match=message) as info:
        make()
    assert "\n" not in str(info.value)


def test_a_batch_larger_than_a_part_and_a_model_without_features_are_one_line():
    train, poisoned = backdoored_set(n=40)
    with pytest.raises(DataError, match=r"^defense.semi_batch_size=64 exceeds the 20 labelled training samples") as info:
        DBD(**{**SMALL, "simclr_epochs": 1, "warmup_epochs": 1, "semi_epochs": 1}).apply(context(train, poisoned))
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=r"defense=dbd reads penultimate features: model 'Linear' has no .features") as info:
        DBD().check_model(nn.Linear(2, 2))
    assert "\n" not in str(info.value)


def test_the_configs_are_the_official_values_and_the_budgets(compose_cfg):
    d = compose_cfg("defense=dbd").defense
    assert (d.budget, d.temperature, d.simclr_lr, d.sce_alpha, d.sce_beta, d.lr, d.epsilon) == \
        ("official", 0.5, 0.4, 0.1, 1.0, 0.002, 0.5)
    assert (d.semi_batch_size, d.sharpen_temperature, d.mixup_alpha, d.lambda_u) == (64, 0.5, 0.75, 15.0)
    official = DBD()
    assert (official.simclr_epochs, official.simclr_cosine_period, official.warmup_epochs, official.semi_epochs,
            official.train_iterations, official.rampup_epochs) == (100, 1000, 10, 190, 1024, 190)
    cpu = DBD(budget="cpu")
    assert (cpu.simclr_epochs, cpu.semi_epochs, cpu.train_iterations, cpu.rampup_epochs) == (10, 8, 32, 8)
    assert cpu.simclr_lr_factor(10) == pytest.approx(official.simclr_lr_factor(100))  # the same tenth of the cosine
    # the backdoorbench protocol: BackdoorBench's 100 semi epochs at budget=official, the cpu budget's own otherwise
    assert compose_cfg("defense=dbd", "dataset=cifar10").defense.semi_epochs == 100
    assert compose_cfg("defense=dbd", "dataset=cifar10", "defense.budget=cpu").defense.semi_epochs is None
    assert compose_cfg("defense=dbd").defense.semi_epochs is None  # mnist5k, quick: the budget's
    assert not DBD.meets_training_controlled_attacks and DBD.stage == "in_train" and DBD.is_detector()


def test_the_ledger_names_the_official_sources():
    text = (Path(__file__).parents[1] / "docs" / "ledger" / "dbd.yaml").read_text()
    assert "SCLBD/DBD@d372ef45e5ef2b59036958a8043046f8ea0ef380:" in text
