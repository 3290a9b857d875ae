"""Threat models: which defense meets which attack, and that no defense peeks at the attacker's secrets."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

import backdoorbench
from backdoorbench import registry
from backdoorbench.attacks.base import TrainingAttack
from backdoorbench.pipeline import run, summary_table

CONF = Path(backdoorbench.__file__).parent / "conf"
DEFENSES = sorted(registry.classes("defense", builtin_only=True))
ATTACKS = [name for name in registry.builtin_names("attack") if name != "none"]
TRAINING_CONTROLLED = {name for name in ATTACKS if registry.method_class("attack", name).kind == "training_controlled"}
# Defenses that work only on the stored training split, as each class declares it: ABL trains its own
# model with the plain trainer; the pre-training detectors inspect that split and hand the kept part
# back for retraining.
SPLIT_ONLY = {name for name in DEFENSES if not registry.method_class("defense", name).meets_training_controlled_attacks}
# Training-controlled attacks that hand over the poisoned set they trained on (BackdoorBench's bd_train):
# a split-only defense meets them through it (tests/test_exported_poison.py).
EXPORTING = {name for name in TRAINING_CONTROLLED if registry.method_class("attack", name).exports_poisoned_set}


def build(group: str, name: str, **kwargs):
    node = OmegaConf.load(CONF / group / f"{name}.yaml")
    return instantiate(node, **kwargs)


@pytest.fixture(scope="module")
def attacks():
    return {name: build("attack", name, num_classes=10, image_shape=(1, 28, 28)) for name in ATTACKS}


def test_the_zoo_is_what_this_table_covers(attacks):
    assert {name for name, a in attacks.items() if isinstance(a, TrainingAttack)} == TRAINING_CONTROLLED
    # today's declarations, so that one flipping by mistake is seen
    assert TRAINING_CONTROLLED == {"wanet", "input_aware", "lira", "wb", "blind"}
    # EP reads a batch of the training set; SPECTRE, Beatrix, CD, SCAn, AGPD and ASSET score the training samples;
    # D-BR and D-ST split the training samples by their sensitivity to transformations; NAB runs LGA on them; DBD
    # trains its own model on the poisoned training split in three stages
    assert SPLIT_ONLY == {"abl", "spectral", "activation_clustering", "ep", "spectre", "beatrix", "cd", "scan", "agpd",
                          "asset", "d_br", "d_st", "nab", "dbd"}
    assert EXPORTING == {"wanet", "input_aware"}  # LIRA, WB and Blind save no bd_train in BackdoorBench


@pytest.mark.parametrize("defense_name", DEFENSES)
def test_every_defense_says_which_attacks_its_threat_model_excludes(defense_name, attacks):
    defense = build("defense", defense_name)
    for attack_name, attack in attacks.items():
        reason = defense.not_applicable(attack)
        excluded = defense_name in SPLIT_ONLY and attack_name in TRAINING_CONTROLLED - EXPORTING
        assert (reason is not None) == excluded, (defense_name, attack_name, reason)
        if excluded:
            assert attack.name in reason and defense.name in reason and "never meets" in reason


def test_an_excluded_pair_is_recorded_as_not_applicable_before_the_defense_runs(tmp_path, compose_cfg, monkeypatch):
    from backdoorbench.attacks.lira import LIRA
    from backdoorbench.defenses.abl import AntiBackdoorLearning

    def never(self, ctx):
        raise AssertionError("the defense ran although its threat model excludes the attack")

    monkeypatch.setattr(AntiBackdoorLearning, "apply", never)
    # LIRA exports no poisoned set (BackdoorBench: bd_train=None); its victim's training is not what is tested
    monkeypatch.setattr(LIRA, "train_victim", lambda self, *args, **kwargs: None)
    record, path = run(compose_cfg("attack=lira", "defense=abl", "trainer.epochs=0", "trainer.progress=false",
                                   "eval.stealth_images=0", f"results_dir={tmp_path}"))
    assert record.defense["applicable"] is False and "never meets" in record.defense["not_applicable"]
    assert record.metrics["defended"] is None and record.metrics["der"] is None
    assert "defense" not in record.timings_s  # nothing was spent on it
    assert path.exists() and "not applicable" in summary_table(record, path)


# ---- no defense reads the true poisoned indices or the attacker's trigger -------------------------

FAST = {  # each defense's config, shrunk to a few steps on a 20 px toy
    "abl": dict(budget="cpu", isolation_epochs=1, finetune_epochs=1, unlearn_epochs=1),
    "activation_clustering": dict(reduction="pca"),  # ICA is slow; the reduction is not what is tested here
    "cd": dict(steps=2),
    "d_st": dict(sd_epochs=1, sd_finetune_epochs=1, contrastive_epochs=1, warmup_epochs=0, classifier_epochs=1),
    "dbd": dict(budget="cpu", simclr_epochs=1, warmup_epochs=1, semi_epochs=1, train_iterations=2, semi_batch_size=16),
    "sau": dict(epochs=1),
    "anp": dict(iterations=5),
    "fine_pruning": dict(epochs=1),
    "fine_tuning": dict(epochs=1),
    "i_bau": dict(rounds=1, perturbation_steps=2, unlearn_steps=2),
    "nad": dict(teacher_epochs=1, epochs=1),
    "neural_cleanse": dict(epochs=2, unlearn_epochs=1, batch_size=64),
    "strip": dict(num_superimpose=4),
}
SIDE = 20


@pytest.fixture(scope="module")
def victim():
    from backdoorbench.attacks.badnets import BadNets
    from backdoorbench.datasets.base import Split
    from backdoorbench.models.base import Normalized
    from backdoorbench.models.mnist_cnn import MnistCNN
    from backdoorbench.train import Trainer

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(300) % 10
    images = (torch.rand(300, 1, SIDE, SIDE, generator=g) * 80).to(torch.uint8)
    for c in range(10):  # class c: a bright bar in row 2c, so the toy is learnable
        images[labels == c, :, 2 * c : 2 * c + 2, :] = 220
    attack = BadNets(num_classes=10, image_shape=(1, SIDE, SIDE), patch_size=3, target=0, poison_rate=0.1)
    decoy = BadNets(num_classes=10, image_shape=(1, SIDE, SIDE), patch_size=5, target=7, poison_rate=0.2)
    poisoned = attack.poison_dataset(Split(images, labels), torch.Generator().manual_seed(1))
    trainer = Trainer(epochs=1, batch_size=64, device="cpu", progress=False, channels_last=False)

    def build(**kwargs):
        return Normalized(MnistCNN(image_size=SIDE, hidden=32, **kwargs), (0.3,), (0.3,))

    torch.manual_seed(0)
    model = build()
    trainer.fit(model, poisoned.split, generator=torch.Generator().manual_seed(2))
    return SimpleNamespace(attack=attack, decoy=decoy, poisoned=poisoned, trainer=trainer, build=build, model=model)


def context(victim, defense, *, poisoned_indices, attacker):
    """The pipeline's context: the clean subset is drawn by the pipeline from the truth (holding
    clean data is the defender's threat model); `poisoned_indices` and the attacker that trains
    a retrained model are what the defense must never depend on."""
    from backdoorbench.defenses.base import DefenseContext, clean_subset_indices

    split = victim.poisoned.split
    subset = clean_subset_indices(len(split), victim.poisoned.indices, defense.clean_fraction,
                                  torch.Generator().manual_seed(3)) if defense.clean_fraction > 0 \
        else torch.zeros(0, dtype=torch.long)

    def train_victim(net, wrap_step=None, train=None):
        attacker.train_victim(victim.trainer, net, split if train is None else train, torch.Generator().manual_seed(5),
                              wrap_step=wrap_step)

    return DefenseContext(model=copy.deepcopy(victim.model), poisoned_train=split, poisoned_indices=poisoned_indices,
                          clean_subset=split.subset(subset), trainer=victim.trainer, num_classes=10,
                          generator=torch.Generator().manual_seed(4), build_model=victim.build,
                          train_victim=train_victim)


def outputs(defense, ctx, probe):
    torch.manual_seed(11)
    result = defense.apply(ctx)
    out = {"extras": json.dumps(result.extras, sort_keys=True, default=str)}
    if result.model is not None:
        out["model"] = {k: v.clone() for k, v in result.model.state_dict().items()}
    for key in ("sample_scores", "flagged"):
        if getattr(result, key) is not None:
            out[key] = getattr(result, key).clone()
    if defense.stage == "input":
        out["threshold"] = defense.threshold
        out["input_scores"] = defense.score_inputs(ctx.model.eval(), probe)
    return out


@pytest.mark.parametrize("defense_name", DEFENSES)
def test_no_defense_reads_the_poisoned_indices_or_the_attackers_trigger(defense_name, victim):
    count = len(victim.poisoned.indices)
    truth = victim.poisoned.indices
    others = torch.nonzero(~torch.isin(torch.arange(len(victim.poisoned.split)), truth)).flatten()
    scrambled = others[torch.randperm(len(others), generator=torch.Generator().manual_seed(6))[:count]].sort().values
    probe = torch.rand(6, 1, SIDE, SIDE, generator=torch.Generator().manual_seed(7))
    runs = []
    for indices, attacker in ((truth, victim.attack), (scrambled, victim.decoy)):
        defense = build("defense", defense_name, **FAST.get(defense_name, {}))
        runs.append(outputs(defense, context(victim, defense, poisoned_indices=indices, attacker=attacker), probe))
    honest, decoyed = runs
    assert honest.keys() == decoyed.keys()
    assert honest["extras"] == decoyed["extras"]
    for key in honest.keys() - {"extras", "model"}:
        assert torch.equal(torch.as_tensor(honest[key]), torch.as_tensor(decoyed[key])), key
    if "model" in honest:
        assert all(torch.equal(honest["model"][k], decoyed["model"][k]) for k in honest["model"]), "model differs"
