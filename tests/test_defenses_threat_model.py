"""Threat models: which defense meets which attack, and that no defense peeks at the attacker's secrets."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

import backdoorbench
from backdoorbench.attacks.base import TrainingAttack
from backdoorbench.pipeline import run, summary_table

CONF = Path(backdoorbench.__file__).parent / "conf"
DEFENSES = sorted(p.stem for p in (CONF / "defense").glob("*.yaml") if p.stem != "none")
ATTACKS = sorted(p.stem for p in (CONF / "attack").glob("*.yaml") if p.stem != "none")
TRAINING_CONTROLLED = {"wanet", "input_aware", "lira", "wb"}
# Defenses that work only on the stored training split: ABL trains its own model with the plain
# trainer; the pre-training detectors inspect that split and hand the kept part back for retraining.
SPLIT_ONLY = {"abl", "spectral", "activation_clustering"}


def build(group: str, name: str, **kwargs):
    node = OmegaConf.load(CONF / group / f"{name}.yaml")
    return instantiate(node, **kwargs)


@pytest.fixture(scope="module")
def attacks():
    return {name: build("attack", name, num_classes=10, image_shape=(1, 28, 28)) for name in ATTACKS}


def test_the_zoo_is_what_this_table_covers(attacks):
    assert len(DEFENSES) == 12
    assert {name for name, a in attacks.items() if isinstance(a, TrainingAttack)} == TRAINING_CONTROLLED


@pytest.mark.parametrize("defense_name", DEFENSES)
def test_every_defense_says_which_attacks_its_threat_model_excludes(defense_name, attacks):
    defense = build("defense", defense_name)
    for attack_name, attack in attacks.items():
        reason = defense.not_applicable(attack)
        excluded = defense_name in SPLIT_ONLY and attack_name in TRAINING_CONTROLLED
        assert (reason is not None) == excluded, (defense_name, attack_name, reason)
        if excluded:
            assert attack.name in reason and defense.name in reason and "never meets" in reason


def test_an_excluded_pair_is_recorded_as_not_applicable_before_the_defense_runs(tmp_path, compose_cfg, monkeypatch):
    from backdoorbench.defenses.abl import AntiBackdoorLearning

    def never(self, ctx):
        raise AssertionError("the defense ran although its threat model excludes the attack")

    monkeypatch.setattr(AntiBackdoorLearning, "apply", never)
    record, path = run(compose_cfg("attack=wanet", "defense=abl", "trainer.epochs=0", "trainer.progress=false",
                                   "eval.stealth_images=0", f"results_dir={tmp_path}"))
    assert record.defense["applicable"] is False and "never meets" in record.defense["not_applicable"]
    assert record.metrics["defended"] is None and record.metrics["der"] is None
    assert "defense" not in record.timings_s  # nothing was spent on it
    assert path.exists() and "not applicable" in summary_table(record, path)
