"""The poisoned training set a training-controlled attack hands over after training (BackdoorBench's
`bd_train` of WaNet and Input-aware), and the split-only defenses (ABL, AC, spectral) that read it."""

from __future__ import annotations

import pytest
import torch

from backdoorbench.attacks.base import TrainingAttack
from backdoorbench.attacks.input_aware import InputAware
from backdoorbench.attacks.wanet import WaNet
from backdoorbench.datasets.base import Split, to_float, to_uint8
from backdoorbench.defenses.base import DefenseResult
from backdoorbench.pipeline import run
from tests.tiny import COMMON, SHAPE, one_thread  # noqa: F401  (autouse fixture)

N, BATCH = 300, 64  # 4 full batches of 64 and one of 44


@pytest.fixture(scope="module")
def train() -> Split:
    g = torch.Generator().manual_seed(0)
    return Split((torch.rand(N, *SHAPE, generator=g) * 255).to(torch.uint8), torch.arange(N) % 4)


def per_batch(rate: float) -> int:
    """BackdoorBench's floored count per batch, summed over the batches of the export."""
    return 4 * int(BATCH * rate) + int((N - 4 * BATCH) * rate)


def untouched(exported, train: Split) -> None:
    rest = torch.ones(N, dtype=torch.bool)
    rest[exported.indices] = rest[exported.cover] = False
    assert torch.equal(exported.split.images[rest], train.images[rest])
    assert torch.equal(exported.split.labels[rest], train.labels[rest])
    assert not set(exported.indices.tolist()) & set(exported.cover.tolist())


@pytest.mark.parametrize("mode", ["all2one", "all2all"])
def test_wanet_exports_warped_relabelled_samples_and_noise_mode_samples_with_their_labels(train, mode):
    attack = WaNet(**{**COMMON, "target_mode": mode}, poison_rate=0.1, cross_ratio=2.0)
    exported = attack.export_poisoned_set(train, torch.Generator().manual_seed(1), BATCH)
    assert len(exported.indices) == per_batch(0.1) == 28
    # noise mode: int(num_bd * cross_ratio) per batch, as BackdoorBench's attack/wanet.py export
    assert len(exported.cover) == 4 * int(int(BATCH * 0.1) * 2.0) + int(int(44 * 0.1) * 2.0) == 56
    poisoned, cover = exported.indices, exported.cover
    # the trigger samples: the fixed warp, the target rule's label
    assert torch.equal(exported.split.images[poisoned], to_uint8(attack.apply_trigger(to_float(train.images[poisoned]))))
    assert torch.equal(exported.split.labels[poisoned], attack.target_rule(train.labels[poisoned]))
    # the noise-mode samples: warped (not the trigger's warp), labels kept
    assert torch.equal(exported.split.labels[cover], train.labels[cover])
    assert not torch.equal(exported.split.images[cover], train.images[cover])
    assert not torch.equal(exported.split.images[cover],
                           to_uint8(attack.apply_trigger(to_float(train.images[cover]))))
    untouched(exported, train)


def test_input_aware_exports_own_trigger_samples_and_cross_samples_with_their_labels(train):
    attack = InputAware(**COMMON, poison_rate=0.1, cross_rate=0.1, mask_epochs=0, channels=4)
    exported = attack.export_poisoned_set(train, torch.Generator().manual_seed(1), BATCH)
    assert len(exported.indices) == len(exported.cover) == per_batch(0.1)  # num_cross = num_bd at rho_c = rho_b
    poisoned, cover = exported.indices, exported.cover
    own = to_uint8(attack.apply_trigger(to_float(train.images[poisoned])))
    assert (exported.split.images[poisoned].int() - own.int()).abs().max() <= 1  # batched vs one pass of the net
    assert torch.equal(exported.split.labels[poisoned], torch.zeros(len(poisoned), dtype=torch.int64))
    assert torch.equal(exported.split.labels[cover], train.labels[cover])
    assert not torch.equal(exported.split.images[cover], train.images[cover])
    untouched(exported, train)


@pytest.mark.parametrize("make", [
    lambda: WaNet(**COMMON, poison_rate=0.1),
    lambda: InputAware(**COMMON, poison_rate=0.1, mask_epochs=0, channels=4),
], ids=["wanet", "input_aware"])
def test_the_export_is_deterministic_per_seed(train, make):
    attack = make()
    first, again, other = (attack.export_poisoned_set(train, torch.Generator().manual_seed(seed), BATCH)
                           for seed in (1, 1, 2))
    assert torch.equal(first.indices, again.indices) and torch.equal(first.split.images, again.split.images)
    assert not torch.equal(first.indices, other.indices)


def test_lira_and_wb_export_nothing():
    from backdoorbench import registry

    for name in ("lira", "wb"):
        cls = registry.method_class("attack", name)
        assert issubclass(cls, TrainingAttack) and not cls.exports_poisoned_set


def test_the_old_code_ran_no_split_only_defense_against_wanet_and_the_new_does():
    """ABL, AC and spectral now meet WaNet and Input-aware (the exported set); LIRA and WB stay n/a."""
    from backdoorbench import registry

    for defense in ("abl", "activation_clustering", "spectral"):
        cls = registry.method_class("defense", defense)
        for attack in ("wanet", "input_aware"):
            assert cls.excludes(attack, registry.method_class("attack", attack)) is None, (defense, attack)
        for attack in ("lira", "wb"):
            assert "exporting no poisoned set" in cls.excludes(attack, registry.method_class("attack", attack))


def _quick(compose_cfg, tmp_path, *extra):
    return compose_cfg("trainer.epochs=0", "trainer.progress=false", "eval.stealth_images=0", "eval.pgd.enabled=false",
                       f"results_dir={tmp_path}", f"cache_dir={tmp_path / 'cache'}", *extra)


def test_a_split_only_defense_against_wanet_reads_the_exported_set_and_retrains_plainly(tmp_path, compose_cfg,
                                                                                         monkeypatch):
    """One run misses the victim cache, the next hits it: both hand the defense the same exported set."""
    from backdoorbench.defenses.activation_clustering import ActivationClustering

    seen = []

    def spy(self, ctx):
        fits = []
        fit = ctx.trainer.fit
        monkeypatch.setattr(ctx.trainer, "fit", lambda *args, **kwargs: fits.append(kwargs))
        ctx.train_victim(ctx.build_model())
        monkeypatch.setattr(ctx.trainer, "fit", fit)
        seen.append((ctx, fits[0]))
        flagged = torch.zeros(len(ctx.poisoned_train), dtype=torch.bool)
        flagged[ctx.poisoned_indices[::2]] = True  # a scorer's check only: a real defense never reads them
        return DefenseResult(sample_scores=flagged.float(), flagged=flagged)

    monkeypatch.setattr(ActivationClustering, "apply", spy)
    record, _ = run(_quick(compose_cfg, tmp_path, "attack=wanet", "defense=activation_clustering"))
    (ctx, retrain), = seen
    assert record.report["applicable"] is True and record.defense["applicable"] is True
    # 4,000 mnist5k training images in batches of 128: 31 x int(12.8) + int(3.2)
    assert len(ctx.poisoned_indices) == record.defense["exported_set"]["n_poisoned"] == 31 * 12 + 3
    assert record.defense["exported_set"]["n_cover"] == 31 * 24 + 6
    assert (ctx.poisoned_train.labels[ctx.poisoned_indices] == 0).all()
    assert record.attack["n_poisoned"] == 0  # the victim itself was trained the attacker's way, on the clean split
    # the detection is scored against the exported set's trigger samples
    assert record.metrics["detection"]["fpr"] == 0 and record.metrics["detection"]["tpr"] == 188 / 375
    # the defender retrains on the data it holds with the plain trainer, not the attacker's step
    assert "poison" not in retrain and retrain.get("companion") is None
    again, _ = run(_quick(compose_cfg, tmp_path, "attack=wanet", "defense=activation_clustering"))
    cached = seen[1][0]
    assert (record.victim["cache"], again.victim["cache"]) == ("miss", "hit")
    assert torch.equal(cached.poisoned_train.images, ctx.poisoned_train.images)
    assert torch.equal(cached.poisoned_indices, ctx.poisoned_indices)
    assert again.defense["exported_set"] == record.defense["exported_set"]


def test_a_learned_trigger_restored_from_its_saved_state_exports_the_same_set(train):
    """What the victim cache keeps of Input-aware (its generators' state) is all the export needs."""
    trained = InputAware(**COMMON, poison_rate=0.1, mask_epochs=0, channels=4, seed=3)
    with torch.no_grad():  # stands in for training: weights no fresh generator has
        for param in trained.pattern_generator.parameters():
            param.add_(0.05 * torch.randn_like(param))
    restored = InputAware(**COMMON, poison_rate=0.1, mask_epochs=0, channels=4, seed=0)
    fresh = restored.export_poisoned_set(train, torch.Generator().manual_seed(1), BATCH)
    restored.load_state_dict(trained.state_dict())
    first, again = (a.export_poisoned_set(train, torch.Generator().manual_seed(1), BATCH) for a in (trained, restored))
    assert torch.equal(first.split.images, again.split.images) and torch.equal(first.indices, again.indices)
    assert not torch.equal(first.split.images, fresh.split.images)
