"""NAD's distilled layers and lr schedule, and ANP's perturbation step, as their official code has them.

NAD (bboylyg/NAD): the betas weigh the outputs of the model's last three residual groups, the lr
after epoch 2 is a fixed 0.01 (`adjust_learning_rate`), and the lr is the one its victims train
at; BackdoorBench's layers are one stage deeper (its `children()[:-k]` slices), an option.
ANP (csdongxian/ANP_backdoor): one signed step of size eps from a uniform start in [-eps, eps],
with no clip after it, so the perturbation reaches 2 eps. CPU, seeded, small models.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backdoorbench.datasets.base import Split
from backdoorbench.defenses.anp import AdversarialNeuronPruning, NoisyBatchNorm2d
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.nad import NeuralAttentionDistillation, attention_loss
from backdoorbench.errors import ConfigError
from backdoorbench.models.base import ImageClassifier, Normalized
from backdoorbench.models.mnist_cnn import MnistCNN
from backdoorbench.models.preact_resnet import PreActResNet18
from backdoorbench.train import Trainer
from tests.tiny import one_thread  # noqa: F401  (autouse: one thread for these tiny nets)


# ---- NAD: layers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rule, names, betas", [
    # the official three residual groups of a 4-stage ResNet: layer2, layer3, layer4 (read at
    # features.5, the identity `feature_act` after layer4: the same tensor)
    ("official", ["features.2", "features.3", "features.5"], [500.0, 1000.0, 1000.0]),
    # BackdoorBench: beta_1 on layer3, beta_2 on layer4, beta_3 on the pooled 1x1 map (dropped)
    ("backdoorbench", ["features.3", "features.5"], [500.0, 1000.0]),
])
def test_nad_layers_of_preact_resnet18(rule, names, betas):
    defense = NeuralAttentionDistillation(layer_rule=rule)
    assert defense.layer_names(PreActResNet18(in_channels=3, num_classes=10), torch.rand(2, 3, 32, 32)) == (names, betas)


@pytest.mark.parametrize("rule, betas", [("official", [1000.0, 1000.0]), ("backdoorbench", [500.0, 1000.0])])
def test_nad_layers_of_mnist_cnn(rule, betas):
    # mnist_cnn has two conv stages (its two max-pools): the official rule keeps the deepest two betas
    names, used = NeuralAttentionDistillation(layer_rule=rule).layer_names(MnistCNN(), torch.rand(2, 1, 28, 28))
    assert names == ["features.3", "features.7"] and used == betas


def test_attention_of_a_pooled_map_carries_no_loss():
    # why BackdoorBench's deepest beta is dropped: a 1x1 map's normalized attention is 1 for any input
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(4, 512, 1, 1, generator=g), torch.randn(4, 512, 1, 1, generator=g) * 7
    assert float(attention_loss(student, teacher, 2.0)) == pytest.approx(0.0, abs=1e-12)


def test_nad_layer_rule_is_checked():
    with pytest.raises(ConfigError, match="defense.layer_rule='bb' is unknown; choose one of: official, backdoorbench"):
        NeuralAttentionDistillation(layer_rule="bb")


# ---- NAD: lr --------------------------------------------------------------------------------------


def lrs(defense: NeuralAttentionDistillation, epochs: int) -> list[float]:
    schedule = defense.official_trainer(Trainer(epochs=1, device="cpu", progress=False), epochs).schedule
    return [defense.lr * schedule(e / epochs) for e in range(epochs)]


def test_nad_lr_drops_to_a_fixed_0_01_as_the_official_code():
    # the official adjust_learning_rate: lr for epochs 0-1, then 0.01 whatever lr was
    assert lrs(NeuralAttentionDistillation(lr=0.1), 5) == pytest.approx([0.1, 0.1, 0.01, 0.01, 0.01])
    assert lrs(NeuralAttentionDistillation(lr=0.05), 4) == pytest.approx([0.05, 0.05, 0.01, 0.01])
    # the default: 0.01, the lr our victims train at (BackdoorBench's NAD lr): 0.01 throughout
    assert lrs(NeuralAttentionDistillation(), 20) == pytest.approx([0.01] * 20)


class BatchNormCNN(ImageClassifier):
    """mnist_cnn's layout, small: two conv + batch-norm + max-pool blocks, a hidden layer, a head (14x14 input)."""

    name = "batch_norm_cnn"

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 9, 128), nn.ReLU())
        self.classifier = nn.Linear(128, 10)


def test_nad_default_lr_keeps_a_batch_norm_victim_trained_at_0_01(mnist5k):
    """The official lr 0.1 is the lr its victims train at; a batch-norm victim trained at 0.01
    diverges in NAD's first epochs at 0.1 and holds at the default (the teacher phase here)."""
    torch.manual_seed(0)

    def split(data: Split, indices: torch.Tensor) -> Split:  # 14x14 digits
        return Split(F.avg_pool2d(data.images[indices].float(), 2).round().to(torch.uint8), data.labels[indices])

    order = torch.randperm(len(mnist5k.train), generator=torch.Generator().manual_seed(100))
    train, clean = split(mnist5k.train, order[:1500]), split(mnist5k.train, order[3000:3200])
    test = split(mnist5k.test, torch.randperm(len(mnist5k.test), generator=torch.Generator().manual_seed(101))[:500])
    trainer = Trainer(epochs=4, batch_size=64, device="cpu", progress=False, crop_padding=1, channels_last=False,
                      optimizer=partial(torch.optim.SGD, lr=0.01, momentum=0.9, weight_decay=5e-4))
    victim = Normalized(BatchNormCNN(), mnist5k.mean, mnist5k.std)
    trainer.fit(victim, train, generator=torch.Generator().manual_seed(1))

    def accuracy(model: nn.Module) -> float:
        return float((trainer.predict(model, test.images) == test.labels).float().mean())

    def teacher_accuracy(lr: float) -> float:
        defense = NeuralAttentionDistillation(lr=lr)
        teacher = Normalized(BatchNormCNN(), mnist5k.mean, mnist5k.std)
        teacher.load_state_dict(victim.state_dict())
        defense.official_trainer(trainer, 3).fit(teacher, clean, generator=torch.Generator().manual_seed(2),
                                                 epochs=3, lr=defense.lr)
        return accuracy(teacher)

    before, default, official = accuracy(victim), teacher_accuracy(NeuralAttentionDistillation().lr), teacher_accuracy(0.1)
    assert before > 0.85, before
    assert default > 0.7 and official < default - 0.3, (before, default, official)


# ---- ANP: the perturbation step -------------------------------------------------------------------


class Small(ImageClassifier):
    name = "small"

    def __init__(self, norm_layer=nn.BatchNorm2d) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), norm_layer(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1), norm_layer(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(8, 3)
        with torch.no_grad():  # nonzero BN shifts, so the shift's perturbation has a gradient too
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.weight.uniform_(0.5, 1.5), m.bias.uniform_(-0.5, 0.5)


def anp_noise_after_one_step(**kwargs) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(start, end, eps): ANP's perturbation of every BN neuron before and after its one step."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    clean = Split(torch.randint(0, 256, (32, 1, 8, 8), generator=g, dtype=torch.uint8), torch.randint(0, 3, (32,), generator=g))
    build = lambda **kw: Small(**kw)  # noqa: E731
    ctx = DefenseContext(model=build(), poisoned_train=clean, poisoned_indices=torch.zeros(0, dtype=torch.long),
                         clean_subset=clean, trainer=Trainer(epochs=1, device="cpu", progress=False, augment=False),
                         num_classes=3, generator=torch.Generator().manual_seed(1), build_model=build)
    defense = AdversarialNeuronPruning(iterations=1, batch_size=16, **kwargs)
    noisy = defense.perturbable_copy(ctx)
    starts, ends = [], []
    original_reset = NoisyBatchNorm2d.reset_noise

    def reset(module, eps, generator):
        original_reset(module, eps, generator)
        starts.append(torch.cat([module.neuron_noise.detach().clone(), module.neuron_noise_bias.detach().clone()]))

    NoisyBatchNorm2d.reset_noise = reset
    try:
        defense.optimize_masks(ctx, noisy)
    finally:
        NoisyBatchNorm2d.reset_noise = original_reset
    for m in noisy.modules():
        if isinstance(m, NoisyBatchNorm2d):
            ends.append(torch.cat([m.neuron_noise.detach(), m.neuron_noise_bias.detach()]))
    return torch.cat(starts), torch.cat(ends), defense.eps


def test_anp_takes_the_official_signed_step_of_eps_without_a_clip():
    start, end, eps = anp_noise_after_one_step()
    assert start.abs().max() <= eps  # the uniform start in [-eps, eps]
    step = end - start
    moved = step != 0
    assert moved.float().mean() > 0.9  # every neuron with a gradient moves by exactly eps
    assert torch.allclose(step[moved].abs(), torch.full_like(step[moved], eps), atol=1e-6)
    assert end.abs().max() > eps and end.abs().max() <= 2 * eps + 1e-6  # the noise spans [-2 eps, 2 eps]


def test_anp_clip_noise_keeps_the_papers_box():
    _, end, eps = anp_noise_after_one_step(clip_noise=True)
    assert end.abs().max() <= eps + 1e-7


def test_anp_clip_noise_is_checked():
    with pytest.raises(ConfigError, match="defense.clip_noise='yes' is invalid; use true or false"):
        AdversarialNeuronPruning(clip_noise="yes")
