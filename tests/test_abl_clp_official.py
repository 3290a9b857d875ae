"""ABL's and CLP's official recipes: ABL's 4 ascent epochs and Cutout, CLP's registration pairing.

Small, seeded, CPU-only checks against what the authors' code does (bboylyg/ABL,
rkteddy/channel-Lipschitzness-based-pruning); docs/fidelity.md#abl and #clp cite the lines.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backdoorbench.datasets.base import Split
import backdoorbench.defenses.abl as abl_module
from backdoorbench.defenses.abl import AntiBackdoorLearning, cutout, cutout_step
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.clp import ChannelLipschitzPruning, conv_bn_pairs, registration_pairs
from backdoorbench.errors import ConfigError
from backdoorbench.models.base import ImageClassifier, Normalized
from backdoorbench.models.mnist_cnn import MnistCNN
from backdoorbench.models.preact_resnet import PreActResNet18
from backdoorbench.train import Trainer
from tests.tiny import one_thread  # noqa: F401  (autouse: one thread for these tiny nets)


def context(model: nn.Module, train: Split, num_classes: int = 10, build_model=None, augment: bool = True) -> DefenseContext:
    return DefenseContext(
        model=model, poisoned_train=train, poisoned_indices=torch.zeros(0, dtype=torch.long), clean_subset=train,
        trainer=Trainer(epochs=1, batch_size=32, device="cpu", progress=False, augment=augment), num_classes=num_classes,
        generator=torch.Generator().manual_seed(3), build_model=build_model)


def no_data(shape: tuple[int, ...]) -> Split:
    return Split(torch.zeros(0, *shape, dtype=torch.uint8), torch.zeros(0, dtype=torch.long))


# ---- ABL ------------------------------------------------------------------------------------------


def test_abl_ascends_four_epochs_by_default_as_the_official_loop():
    # backdoor_unlearning.py: `for epoch in range(0, 5)`, epoch 0 only tests: 4 ascent epochs.
    for budget in ("official", "cpu"):
        assert AntiBackdoorLearning(budget=budget).describe()["unlearn_epochs"] == 4
    assert AntiBackdoorLearning(unlearn_epochs=5).describe()["unlearn_epochs"] == 5  # the old count, by key


def test_cutout_makes_the_official_hole_clipped_at_the_border():
    x = torch.ones(400, 3, 8, 8)
    holes = (cutout(x, 3, torch.Generator().manual_seed(0)) == 0)
    assert torch.equal(holes, holes[:, :1].expand_as(holes))  # every channel alike
    sizes = holes[:, 0].flatten(1).sum(1)
    # length 3: rows/cols [c - 1, c + 1): 2x2 inside, 2x1 or 1x1 where the centre is on row/col 0.
    assert set(sizes.tolist()) == {1, 2, 4}
    for image in holes[:, 0]:
        rows, cols = torch.nonzero(image.any(1)).flatten(), torch.nonzero(image.any(0)).flatten()
        assert torch.equal(image, image[rows][:, cols].all() & image.any(1)[:, None] & image.any(0)[None])
        assert len(rows) == 2 or rows.tolist() == [0]
        assert len(cols) == 2 or cols.tolist() == [0]
    assert torch.equal(cutout(x, 0, torch.Generator().manual_seed(0)), x)


class Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3 * 8 * 8, 2)
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        self.seen.append(x.detach().clone())
        return self.linear(x.flatten(1))


def test_abl_trains_on_the_rest_with_cutout_and_unlearns_without_it():
    calls = []
    original = Trainer.fit

    def spy(self, model, split, **kwargs):
        before = len(model.seen)
        history = original(self, model, split, **kwargs)
        calls.append((kwargs["desc"], model.seen[before:]))
        return history

    images = torch.full((64, 3, 8, 8), 255, dtype=torch.uint8)  # all white: a hole is a zero
    train = Split(images, torch.arange(64) % 2)
    Trainer.fit = spy
    try:
        torch.manual_seed(0)
        result = AntiBackdoorLearning(isolation_epochs=1, finetune_epochs=1, isolation_ratio=0.25, batch_size=16).apply(
            context(nn.Identity(), train, num_classes=2, build_model=Recorder, augment=False))
    finally:
        Trainer.fit = original
    phases = dict(calls)
    assert list(phases) == ["abl isolation", "abl train", "abl unlearn"]
    # Zero pixels per image (no crop here, so a zero is a hole): one hole of 1-4 px in training on
    # the rest (48 images), none in isolation or unlearning.
    zeros = {name: torch.cat([(batch == 0).all(1).flatten(1).sum(1) for batch in seen]) for name, seen in phases.items()}
    assert len(zeros["abl train"]) == 48 and set(zeros["abl train"].tolist()) <= {1, 2, 4}
    assert zeros["abl isolation"].sum() == 0 and zeros["abl unlearn"].sum() == 0
    assert len(result.extras["unlearn_lr_per_epoch"]) == 4


def test_abl_isolates_in_the_stored_order_and_unlearns_with_the_training_optimizer():
    # The official isolation loader has shuffle=False (data_loader.py): one order every epoch, here a
    # seeded permutation (the stored split may be sorted by class); backdoor_unlearning.py makes one
    # SGD for training on the rest and for unlearning, so the ascent starts with the training's momentum.
    made, calls = [], []
    original_fit, original_sgd = Trainer.fit, abl_module.sgd

    def spy(self, model, split, **kwargs):
        before = len(model.seen)
        optimizer = self.optimizer([p for p in model.parameters() if p.requires_grad])
        momentum = [optimizer.state[p].get("momentum_buffer") for p in model.parameters()]
        momentum = [None if m is None else m.clone() for m in momentum]
        history = original_fit(self, model, split, **kwargs)
        calls.append((kwargs["desc"], model.seen[before:], momentum, history))
        return history

    def record_sgd(*args, **kwargs):
        made.append(original_sgd(*args, **kwargs))
        return made[-1]

    images = torch.arange(64, dtype=torch.uint8)[:, None, None, None].expand(64, 3, 8, 8).contiguous()
    train = Split(images, torch.arange(64) % 2)
    Trainer.fit, abl_module.sgd = spy, record_sgd
    try:
        for shuffle, share in ((False, True), (True, False)):
            calls.clear()
            torch.manual_seed(0)
            AntiBackdoorLearning(isolation_epochs=2, finetune_epochs=1, isolation_ratio=0.25, batch_size=16,
                                 cutout_length=0, isolation_shuffle=shuffle, share_optimizer=share).apply(
                context(nn.Identity(), train, num_classes=2, build_model=Recorder, augment=False))
            phases = {name: (seen, momentum, history) for name, seen, momentum, history in calls}
            order = (torch.cat([batch[:, 0, 0, 0] for batch in phases["abl isolation"][0]]) * 255).round().long()
            first, second = order[:64], order[64:]
            assert sorted(first.tolist()) == list(range(64)) and not torch.equal(first, torch.arange(64))
            assert torch.equal(first, second) is not shuffle  # one fixed order, not the stored (sorted) one
            momentum = phases["abl unlearn"][1]
            if share:  # the ascent starts from the training's momentum buffers, at its own lr
                assert len(made) == 1 and all(m is not None and m.abs().sum() > 0 for m in momentum)
                assert [row["lr"] for row in phases["abl unlearn"][2]] == [5e-4] * 4
                assert phases["abl train"][2][0]["lr"] == 0.1
            else:
                assert len(made) == 1 and all(m is None for m in momentum)
    finally:
        Trainer.fit, abl_module.sgd = original_fit, original_sgd


def test_abl_order_and_optimizer_switches_are_booleans():
    for key in ("isolation_shuffle", "share_optimizer"):
        with pytest.raises(ConfigError, match=f"defense.{key}='yes' is invalid; use true or false"):
            AntiBackdoorLearning(**{key: "yes"})


def test_cutout_step_is_cross_entropy_on_the_cut_batch():
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    x, y = torch.rand(5, 3, 4, 4), torch.tensor([0, 1, 0, 1, 1])
    loss, logits, scored = cutout_step(3, torch.Generator().manual_seed(1))(model, x, y)
    expected = model(cutout(x, 3, torch.Generator().manual_seed(1)))
    assert torch.allclose(logits, expected) and torch.equal(scored, y)
    assert torch.isclose(loss, nn.functional.cross_entropy(expected, y))


# ---- CLP ------------------------------------------------------------------------------------------


def preact() -> Normalized:
    torch.manual_seed(0)
    return Normalized(PreActResNet18(in_channels=3, num_classes=10), (0.5,) * 3, (0.25,) * 3)


def test_registration_pairs_each_bn_with_the_conv_registered_last_before_it():
    model = preact()
    pairs, unpaired = registration_pairs(model)
    names = {id(m): name for name, m in model.named_modules()}
    assert unpaired == 0 and len(pairs) == 16  # 16 BNs; the 3 shortcuts and the last conv2 unscored
    stage = "net.features.2"
    got = {p.bn_name: names[id(p.conv)] for p in pairs}
    assert got[f"{stage}.0.bn1"] == "net.features.1.1.conv2"
    assert got[f"{stage}.1.bn1"] == f"{stage}.0.conv2"  # not the projection shortcut, registered before conv1
    assert got[f"{stage}.0.bn2"] == f"{stage}.0.conv1"
    assert not any("shortcut" in names[id(p.conv)] for p in pairs)


def test_on_a_conv_bn_network_both_pairings_agree():
    torch.manual_seed(0)
    model = Normalized(MnistCNN(), (0.5,), (0.25,))
    registered, _ = registration_pairs(model)
    traced = conv_bn_pairs(model, (1, 28, 28))
    assert [(p.conv, p.bn) for p in registered] == [(p.conv, p.bn) for p in traced]
    with torch.no_grad():
        model.net.features[4].weight[9] *= 50.0
    results = [ChannelLipschitzPruning(pairing=p).apply(context(model, no_data((1, 28, 28)))) for p in ("registration", "traced")]
    assert results[0].extras["pruned_channels"] == results[1].extras["pruned_channels"] == [[], [9]]
    assert all(torch.equal(a, b) for a, b in zip(results[0].model.state_dict().values(),
                                                   results[1].model.state_dict().values()))


def test_clp_default_zeroes_the_bn_read_after_the_sum_as_the_official_code():
    model = preact()
    stage = model.net.features[1]
    with torch.no_grad():
        stage[0].conv2.weight[7] *= 50.0  # a backdoor-like channel of the sum's conv
    result = ChannelLipschitzPruning().apply(context(model, no_data((3, 32, 32))))
    repaired = result.model.net.features[1]
    assert result.extras["pairing"] == "registration" and result.extras["n_layers"] == 16
    assert repaired[1].bn1.weight[7] == 0 and repaired[1].bn1.bias[7] == 0  # the official surgery
    assert torch.equal(repaired[0].conv2.weight, stage[0].conv2.weight)  # the kernel is kept
    # The identity skip carries the pre-BN sum on: block 1's output moves one for one with channel 7
    # of its input, while its residual branch no longer reads that channel.
    z = torch.randn(2, 64, 8, 8)
    bumped = z.clone()
    bumped[:, 7] += 1.0
    with torch.no_grad():
        out, out_bumped = repaired[1](z), repaired[1](bumped)
    assert torch.allclose(out_bumped - bumped, out - z, atol=1e-5)
    assert torch.allclose(out_bumped[:, 7] - out[:, 7], torch.ones(2, 8, 8), atol=1e-5)


def test_clp_traced_pairing_keeps_the_old_rule():
    model = preact()
    with torch.no_grad():
        model.net.features[1][0].conv2.weight[7] *= 50.0
    result = ChannelLipschitzPruning(pairing="traced").apply(context(model, no_data((3, 32, 32))))
    assert result.extras["n_layers"] == 19 and result.extras["n_layers_through_sum"] == 10
    assert torch.count_nonzero(result.model.net.features[1][0].conv2.weight[7]) == 0
    with pytest.raises(ConfigError, match=r"defense.pairing='graph' is unknown; choose one of: registration, traced"):
        ChannelLipschitzPruning(pairing="graph")


class BnFirst(ImageClassifier):
    name = "bn_first"

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.BatchNorm2d(1), nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 6, 3),
                                      nn.BatchNorm2d(8), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(8, 2)


def test_registration_skips_a_bn_with_no_conv_before_it_or_another_width():
    pairs, unpaired = registration_pairs(BnFirst())
    assert [p.bn_name for p in pairs] == ["features.2"] and unpaired == 2
