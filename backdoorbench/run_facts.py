"""What reporting needs to know of a run, decided when the run is made and written into its record
(`report`), so that reporting reads records only: never a method class, never today's yaml. The
run answers from its own config, the defense's own verdict on the attack (the pipeline asked it)
and the method defaults of its commit (`protocols`); `current_facts` is the same knowledge as
data, frozen once for the records made before the record carried it (records.frozen_facts)."""

from __future__ import annotations

from importlib import resources
from typing import Any

from hydra.utils import get_class

from backdoorbench import protocols
from backdoorbench.config import protocol_name
from backdoorbench.records import RecordError, RunRecord, canonical_key, own_setting, resolve_defaults

# How a frozen judgement from the classes is marked, as the leaderboard marked it: the record did not ask.
JUDGED_FROM_CONFIG = " (judged from the record's config: the record predates the check)"


def run_report(record: RunRecord) -> dict[str, Any]:
    """The `report` block of a record the pipeline has just built (records.REPORT_KEYS)."""
    config = record.config
    attack, defense = record.attack["name"], record.defense["name"]
    if defense != "none" and not isinstance(record.defense.get("applicable"), bool):
        raise RecordError(f"record {record.run_id}: defense {defense} does not say whether it applied "
                          "(defense.applicable must be true or false)")
    applicable = defense == "none" or record.defense["applicable"]
    if not applicable and not record.defense.get("not_applicable"):
        raise RecordError(f"record {record.run_id}: defense {defense} did not apply and gives no reason "
                          "(defense.not_applicable)")
    keys = list(protocols.SENSITIVITY.get(defense, ())) if defense != "none" else []
    paper = protocols.paper_preset(record.overrides)  # a preset's attack values are its defaults
    attack_defaults = resolve_defaults(protocols.attack_defaults(attack, paper), config.get("protocol"))
    return {
        "protocol": protocol_name(config),
        "applicable": applicable,
        "not_applicable": None if applicable else str(record.defense["not_applicable"]),
        "defense_at_defaults": protocols.at_defaults(config.get("defense"), defense) if keys else None,
        "attack_at_defaults": protocols.attack_at_defaults(config.get("attack"), attack, config.get("protocol"), paper),
        "sensitivity_keys": keys,
        "clean_budget": defense in protocols.CLEAN_BUDGET_DEFENSES,
        "canonical_key": canonical_key(record.to_dict()),
        "setting": {"attack": own_setting(config.get("attack"), attack_defaults),
                    "defense": own_setting(config.get("defense"), protocols.defense_defaults(defense))},
    }


def _names(group: str) -> list[str]:
    """The options of `conf/<group>/` (their yaml file names)."""
    folder = resources.files("backdoorbench.conf").joinpath(group)
    return sorted(entry.name[:-5] for entry in folder.iterdir() if entry.name.endswith(".yaml")
                  and not entry.name.startswith("_"))


def current_facts() -> dict[str, Any]:
    """The methods as this commit knows them (records.frozen_facts's layout): the raw defaults of
    every attack and defense yaml, the sensitivity keys, the clean-budget defenses, and for every
    (defense, attack) pair whose threat models exclude each other the reason, keyed
    `<defense _target_>|<attack name>|<attack _target_>`."""
    attacks = {name: protocols.attack_defaults(name) for name in _names("attack")}
    defenses = {name: defaults for name in _names("defense") if (defaults := protocols.defense_defaults(name))
                and "_target_" in defaults}
    excluded = {}
    for defaults in defenses.values():
        defense_cls = get_class(defaults["_target_"])
        for attack in attacks.values():
            attack_cls = get_class(attack["_target_"])
            reason = defense_cls.excludes(attack_cls.name, attack_cls)
            if reason is not None:
                excluded[f"{defaults['_target_']}|{attack_cls.name}|{attack['_target_']}"] = reason + JUDGED_FROM_CONFIG
    return {
        "attack_defaults": attacks,
        "defense_defaults": defenses,
        "sensitivity": {name: list(keys) for name, keys in protocols.SENSITIVITY.items()},
        "clean_budget": list(protocols.CLEAN_BUDGET_DEFENSES),
        "not_applicable": dict(sorted(excluded.items())),
    }
