"""Fine-tuning's learning-rate schedule follows BackdoorBench's: `CosineAnnealingLR` with T_max 100
whatever the fine-tuning's epochs, so a short fine-tuning keeps lr near 0.01 to its end
(docs/fidelity.md#fine-tuning); `cosine_period: null` runs the cosine over the epochs, as before."""

from __future__ import annotations

import math

import pytest
import torch
from hydra.utils import instantiate

from backdoorbench.datasets.base import Split
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.fine_tuning import FineTuning
from backdoorbench.errors import ConfigError
from backdoorbench.train import Trainer
from tests.tiny import make_model, one_thread  # noqa: F401  (autouse fixture)


def fine_tune(defense: FineTuning, trainer: Trainer) -> list[float]:
    """The lr of each epoch of `defense`'s fine-tuning of a tiny net on 16 seeded images."""
    gen = torch.Generator().manual_seed(0)
    split = Split(torch.randint(0, 256, (16, 1, 16, 16), generator=gen, dtype=torch.uint8),
                  torch.randint(0, 4, (16,), generator=gen))
    seen: list[list[float]] = []
    original = Trainer.fit

    def spy(self, *args, **kwargs):
        history = original(self, *args, **kwargs)
        seen.append([row["lr"] for row in history])
        return history

    ctx = DefenseContext(model=make_model(), poisoned_train=split, poisoned_indices=torch.zeros(0, dtype=torch.long),
                         clean_subset=split, trainer=trainer, num_classes=4, generator=torch.Generator().manual_seed(1))
    Trainer.fit = spy
    try:
        defense.apply(ctx)
    finally:
        Trainer.fit = original
    assert len(seen) == 1
    return seen[0]


def trainer() -> Trainer:
    return Trainer(epochs=7, batch_size=8, schedule="cosine", progress=False)


def test_a_short_fine_tuning_runs_backdoorbenchs_cosine_over_100_epochs() -> None:
    run_trainer = trainer()
    lrs = fine_tune(FineTuning(epochs=3), run_trainer)
    assert lrs == pytest.approx([0.01 * 0.5 * (1 + math.cos(math.pi * e / 100)) for e in range(3)])
    assert lrs[-1] > 0.0099  # the old schedule (over the 3 epochs) ended at 0.0025
    assert (run_trainer.epochs, run_trainer.schedule_period) == (7, None)  # the run's trainer is untouched


def test_cosine_period_null_runs_the_cosine_over_the_fine_tunings_epochs() -> None:
    lrs = fine_tune(FineTuning(epochs=3, cosine_period=None), trainer())
    assert lrs == pytest.approx([0.01, 0.0075, 0.0025])
    assert FineTuning().describe()["cosine_period"] == 100


def test_a_bad_cosine_period_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^defense.cosine_period=0 .*integer >= 1"):
        FineTuning(cosine_period=0)


@pytest.mark.parametrize("defense", ["fine_tuning", "fine_pruning"])
def test_tiny_imagenet_fine_tunes_200_epochs_under_backdoorbench_as_its_tiny_yaml(defense, compose_cfg):
    # BackdoorBench's config/defense/{ft,fp}/tiny.yaml: 200 epochs; every other dataset's config.yaml: 100.
    def epochs(*overrides):
        cfg = compose_cfg(f"defense={defense}", *overrides)
        instance = instantiate(cfg.defense)
        return cfg.defense.epochs, instance.epochs

    assert epochs("protocol=backdoorbench", "dataset=tiny_imagenet") == (200, 200)
    assert epochs("protocol=backdoorbench", "dataset=tiny_imagenet", "defense.budget=cpu") == (None, 10)
    assert epochs("protocol=backdoorbench", "dataset=cifar10") == (None, 100)
    assert epochs("protocol=backdoorbench", "dataset=tiny_imagenet", "defense.epochs=7") == (7, 7)
    assert epochs() == (None, 100)
