"""Fine-pruning's stopping rule and Neural Cleanse's epoch and MAD norm, as their official code has them.

Fine-pruning (BackdoorBench `defense/fp.py`): 1% of the channels a step (`once_prune_ratio`), kept
while accuracy stays within 10% of the unpruned one, relative (`acc_ratio`). Neural Cleanse
(`bolunwang/backdoor`): an epoch is NB_SAMPLE // BATCH_SIZE = 1000 // 32 = 31 batches of a
generator that reshuffles the data at each pass, and the MAD reads the L1 norm of the saved best
mask. CPU, seeded, hand-made models where the answer is known.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses import fine_pruning
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.fine_pruning import FinePruning
from backdoorbench.defenses.neural_cleanse import NeuralCleanse, ShuffledStream
from backdoorbench.errors import ConfigError
from backdoorbench.models.base import ImageClassifier, Normalized
from backdoorbench.train import Trainer
from tests.tiny import one_thread  # noqa: F401  (autouse: one thread for these tiny nets)


def context(model: nn.Module, clean: Split, num_classes: int) -> DefenseContext:
    return DefenseContext(model=model, poisoned_train=clean, poisoned_indices=torch.zeros(0, dtype=torch.long),
                          clean_subset=clean, trainer=Trainer(epochs=1, batch_size=64, device="cpu", progress=False),
                          num_classes=num_classes, generator=torch.Generator().manual_seed(0))


# ---- fine-pruning ---------------------------------------------------------------------------------


class GradedChannels(ImageClassifier):
    """A 1x1 conv of `channels` channels with weights 1, 2, ..., so clean data ranks them in order."""

    name = "graded_channels"

    def __init__(self, channels: int) -> None:
        super().__init__()
        conv = nn.Conv2d(1, channels, 1, bias=False)
        with torch.no_grad():
            conv.weight.copy_(torch.arange(1.0, channels + 1).view(-1, 1, 1, 1))
        self.features = nn.Sequential(conv, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(channels, 2)


def masked_count(model: nn.Module) -> int:
    return next(int((m.channel_mask == 0).sum()) for m in model.modules() if hasattr(m, "channel_mask"))


@pytest.fixture
def scripted_accuracy(monkeypatch):
    """Clean-subset accuracy as a function of the number of masked channels: 0.5 up to 10, 0.455
    (9% relative, 4.5 points below) up to 20, then 0.44 (12% relative)."""

    def accuracy(trainer, model, split) -> float:
        k = masked_count(model)
        return 0.5 if k <= 10 else 0.455 if k <= 20 else 0.44

    monkeypatch.setattr(fine_pruning, "subset_accuracy", accuracy)


def prune(defense: FinePruning, channels: int = 200) -> dict:
    images = torch.randint(1, 255, (8, 1, 2, 2), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    clean = Split(images, torch.zeros(8, dtype=torch.long))
    return defense.apply(context(Normalized(GradedChannels(channels), (0.0,), (1.0,)), clean, 2)).extras


def test_fine_pruning_steps_one_percent_of_the_channels_as_backdoorbench():
    # BackdoorBench: range(0, n, ceil(n * once_prune_ratio)), 6 channels a step on a 512-channel ResNet stage.
    assert FinePruning().prune_counts(512)[:3] == [6, 12, 18]
    assert FinePruning().prune_counts(64)[:3] == [1, 2, 3]  # mnist_cnn: 1% of 64 rounds up to one
    assert FinePruning(prune_step=0).prune_counts(512)[:3] == [1, 2, 3]
    assert FinePruning(max_prune_ratio=0.5).prune_counts(512)[-1] == 252


def test_fine_pruning_default_keeps_a_ten_percent_relative_drop(scripted_accuracy):
    extras = prune(FinePruning(epochs=0))
    # 9% relative is within BackdoorBench's 10%; 12% is not. The old rule (4 points absolute) stopped at 10.
    assert extras["n_pruned"] == 20 and extras["pruned_channels"] == list(range(20))
    assert [fraction for fraction, _ in extras["prune_curve"][:4]] == [0.0, 0.01, 0.02, 0.03]
    assert extras["subset_acc_pruned"] == 0.455


def test_fine_pruning_absolute_one_channel_option_keeps_the_old_rule(scripted_accuracy):
    extras = prune(FinePruning(epochs=0, max_acc_drop=0.04, acc_drop_mode="absolute", prune_step=0))
    assert extras["n_pruned"] == 10 and extras["prune_curve"][1][0] == 0.005
    assert prune(FinePruning(epochs=0, max_acc_drop=0.05, acc_drop_mode="absolute"))["n_pruned"] == 20


def test_fine_pruning_relative_rule_is_two_sided_as_backdoorbench():
    # |acc - base| / base < acc_ratio: a 10% rise stops the pruning too.
    defense = FinePruning()
    assert defense.within_tolerance(0.5, 0.46) and not defense.within_tolerance(0.5, 0.44)
    assert defense.within_tolerance(0.5, 0.54) and not defense.within_tolerance(0.5, 0.56)
    assert not defense.within_tolerance(0.0, 0.0)


@pytest.mark.parametrize("make, message", [
    (lambda: FinePruning(acc_drop_mode="points"), "defense.acc_drop_mode='points' is unknown; choose one of: relative, absolute"),
    (lambda: FinePruning(prune_step=1.5), "prune_step"),
    (lambda: NeuralCleanse(epoch_samples=0), "epoch_samples"),
    (lambda: NeuralCleanse(mad_l1="mean"), "defense.mad_l1='mean' is unknown; choose one of: best_mask, epoch_mean"),
])
def test_bad_values_of_the_new_keys_are_one_line_errors(make, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


# ---- Neural Cleanse -------------------------------------------------------------------------------


class AlwaysZero(ImageClassifier):
    """Predicts class 0 for any input: every trigger to class 0 succeeds, so only the L1 cost moves the mask."""

    name = "always_zero"

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 1, 1), nn.Flatten())
        self.classifier = nn.Linear(16, 2)
        with torch.no_grad():
            self.classifier.weight.mul_(1e-3)
            self.classifier.bias.copy_(torch.tensor([20.0, 0.0]))


class CountingModel(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.batches = inner, []

    def forward(self, x):
        self.batches.append(len(x))
        return self.inner(x)


def images(count: int) -> torch.Tensor:
    return to_float(torch.randint(0, 256, (count, 1, 4, 4), generator=torch.Generator().manual_seed(1)).to(torch.uint8))


def test_shuffled_stream_deals_every_image_once_a_pass_and_a_short_last_batch():
    stream = ShuffledStream(5, 2, torch.Generator().manual_seed(0))
    batches = [stream.next().tolist() for _ in range(6)]
    assert [len(b) for b in batches] == [2, 2, 1, 2, 2, 1]
    assert sorted(sum(batches[:3], [])) == sorted(sum(batches[3:], [])) == list(range(5))


@pytest.mark.parametrize("epoch_samples, batches", [(1000, ([32, 32, 32, 4] * 8)[:31]), (None, [32, 32, 32, 4])])
def test_neural_cleanse_epoch_is_the_official_31_batches_of_32(epoch_samples, batches):
    model = CountingModel(Normalized(AlwaysZero(), (0.0,), (1.0,))).eval()
    defense = NeuralCleanse(epochs=1, epoch_samples=epoch_samples, parallel_classes=1)
    # Official: 1000 // 32 = 31 steps however large the data, from a stream that reshuffles the 100
    # images at each pass (its last batch short, as Keras deals them); null: one pass over them.
    (trigger,) = defense.reverse_engineer(model, images(100), [0], torch.Generator().manual_seed(0))
    assert model.batches == batches
    assert trigger.success == 1.0


def test_neural_cleanse_mad_reads_the_saved_masks_norm():
    model = Normalized(AlwaysZero(), (0.0,), (1.0,)).eval()
    defense = NeuralCleanse(epochs=3, reset_cost_to_zero=False, init_cost=1.0, parallel_classes=1)
    (trigger,) = defense.reverse_engineer(model, images(64), [0], torch.Generator().manual_seed(0))
    # The L1 cost shrinks the mask through the epoch: its epoch mean is larger than the saved mask's norm.
    assert trigger.l1 == pytest.approx(float(trigger.mask.sum()), rel=1e-6)
    assert trigger.epoch_l1 > trigger.l1 * 1.05


@pytest.mark.parametrize("mad_l1", ["best_mask", "epoch_mean"])
def test_neural_cleanse_records_both_norms_and_the_mad_reads_the_chosen_one(mad_l1):
    clean = Split(torch.randint(0, 256, (40, 1, 4, 4), generator=torch.Generator().manual_seed(2)).to(torch.uint8),
                  torch.zeros(40, dtype=torch.long))
    defense = NeuralCleanse(epochs=2, epoch_samples=64, unlearn_epochs=0, reset_cost_to_zero=False, init_cost=1.0,
                            mad_l1=mad_l1)
    extras = defense.apply(context(Normalized(AlwaysZero(), (0.0,), (1.0,)), clean, 2)).extras
    saved = float(sum(map(sum, extras["smallest_norm_mask"])))  # the smallest-norm class's saved mask
    smallest = extras["smallest_norm_class"]
    if mad_l1 == "best_mask":
        assert extras["mask_l1"][smallest] == pytest.approx(saved, abs=0.01)
        assert extras["mask_l1_epoch_mean"][smallest] > saved + 0.1
    else:
        assert extras["mask_l1"] == extras["mask_l1_epoch_mean"]
        assert extras["mask_l1"][smallest] > saved + 0.1
