"""Old records upgraded on load (records.upgrade), and the `report` block a run writes (run_facts):
on the committed records the upgrade judges as the code does, and a fresh run's record is what
the upgrade would make of it."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import pytest
from hydra.utils import get_class

from backdoorbench import protocols
from backdoorbench.config import NON_RESULT_KEYS, protocol_name
from backdoorbench.records import (
    SCHEMA_VERSION,
    RecordError,
    RunRecord,
    frozen_facts,
    latest_repeats,
    load_record,
    upgrade,
    validate_record,
)
from backdoorbench.run_facts import JUDGED_FROM_CONFIG, current_facts
from tests.test_records import make_record

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "results" / "runs"


@functools.lru_cache(maxsize=1)
def committed() -> list[tuple[RunRecord, Path]]:
    paths = sorted(COMMITTED.rglob("*.json"))
    return [(load_record(path), path) for path in paths]


def _key(value) -> str:
    return json.dumps(value, sort_keys=True)


@functools.cache
def todays_attack_at_defaults(attack: str, name: str, protocol: str, paper: str | None = None) -> bool:
    return protocols.attack_at_defaults(json.loads(attack), name, json.loads(protocol), paper)


@functools.cache
def todays_defense_at_defaults(defense: str, name: str) -> bool | None:
    return protocols.at_defaults(json.loads(defense), name) if protocols.SENSITIVITY.get(name) else None


@functools.cache
def todays_exclusion(defense_target: str, attack: str, attack_target: str) -> str | None:
    """leaderboard.exclusion's judgement from the classes, of a record made before the pipeline asked."""
    try:
        defense_cls, attack_cls = get_class(defense_target), get_class(attack_target)
    except (ImportError, AttributeError, ValueError):  # a class that no longer exists: nothing to judge it by
        return None
    reason = defense_cls.excludes(attack, attack_cls)
    return None if reason is None else reason + JUDGED_FROM_CONFIG


def todays_report(record: RunRecord) -> dict:
    """What today's code (protocols.*, the classes' `excludes`, the leaderboard's peer key) says of a record."""
    config, defense, attack = record.config, record.defense["name"], record.attack["name"]
    if record.defense.get("applicable") is False:
        excluded = record.defense["not_applicable"]
    elif "applicable" in record.defense or defense == "none":
        excluded = None
    else:
        excluded = todays_exclusion(config["defense"]["_target_"], attack, config["attack"]["_target_"])
    target, mode = record.attack.get("target"), record.attack["target_mode"]
    mode += f"({target})" if target is not None and mode == "all2one" else ""
    # a detection-only run (eval.detection_only) is a row of the detection board only
    table = ("attacks" if defense == "none" else
             "detections" if (config.get("eval") or {}).get("detection_only") else "defenses")
    return {
        "applicable": excluded is None, "not_applicable": excluded,
        "defense_at_defaults": todays_defense_at_defaults(_key(config.get("defense")), defense),
        "attack_at_defaults": todays_attack_at_defaults(_key(config.get("attack")), attack,
                                                        _key(config.get("protocol")),
                                                        protocols.paper_preset(record.overrides)),
        "canonical_key": "|".join([table, record.dataset["name"],
                                   protocol_name(config), record.model["name"], attack, mode, defense]),
    }


@pytest.mark.slow
def test_committed_records_upgrade_to_the_judgement_of_todays_code():
    """Every committed record (1152 at the freeze): the frozen upgrade gives the at-defaults,
    applicability and canonical grouping the code of the freeze gives. A later commit that moves
    a default or a threat model fails here on purpose: the old records keep the frozen judgement,
    and the change is to be looked at (and this oracle then pinned to the freeze)."""
    records = committed()
    assert len(records) >= 1152 and {r.schema_version for r, _ in records} == {SCHEMA_VERSION}
    mismatched = []
    for record, path in records:
        today = comparable(record, todays_report(record))
        if {key: record.report[key] for key in today} != today:
            mismatched.append(path.name)
    assert not mismatched, f"{len(mismatched)} records judged otherwise, e.g. {mismatched[:3]}"
    assert sum(not r.report["applicable"] for r, _ in records) > 0  # the frozen pairs were used
    # the canonical row of each cell (most seeds, attack then defense at defaults, newest), from the
    # report alone and from today's code: the same groups
    def canonical(judged):
        groups: dict[str, list[RunRecord]] = {}
        for record, _ in latest_repeats(records):
            groups.setdefault(record.group_id, []).append(record)
        best: dict[str, tuple] = {}
        for group_id, members in groups.items():
            facts = judged(members[0])
            rank = (len(members), facts["attack_at_defaults"], bool(facts["defense_at_defaults"]),
                    max(m.created_at for m in members), group_id)
            best[facts["canonical_key"]] = max(best.get(facts["canonical_key"], rank), rank)
        return {key: rank[-1] for key, rank in best.items()}

    assert canonical(lambda r: r.report) == canonical(pinned_report)


@functools.cache
def defaults_changed_since_the_freeze() -> frozenset[str]:
    """The defenses whose yaml defaults (or swept keys) differ from those frozen for old records: for
    them an old record's `defense_at_defaults` is the judgement of its own day (the freeze's point:
    a new default does not move which old row is canonical), which today's yaml no longer gives."""
    frozen, now = frozen_facts(), current_facts()
    return frozenset(name for name, defaults in now["defense_defaults"].items()
                     if frozen["defense_defaults"].get(name) != defaults
                     or frozen["sensitivity"].get(name) != now["sensitivity"].get(name))


@functools.cache
def threat_model_changed_since_the_freeze() -> frozenset[str]:
    """The excluded pairs of the freeze that today's classes no longer exclude (the data-level
    defenses meet WaNet and Input-aware through the set those export), or exclude in other words:
    an old record of one keeps the verdict and the reason of its day."""
    frozen, now = frozen_facts()["not_applicable"], current_facts()["not_applicable"]
    return frozenset(pair for pair, reason in frozen.items() if now.get(pair) != reason)


def comparable(record: RunRecord, today: dict) -> dict:
    """Today's judgement of `record`, less what was judged by a default or a threat model changed
    since the freeze (the record keeps the judgement of its day there, on purpose)."""
    drop = set()
    if record.defense["name"] in defaults_changed_since_the_freeze():
        drop.add("defense_at_defaults")
    config = record.config
    pair = f"{(config.get('defense') or {}).get('_target_', '')}|{record.attack['name']}|" \
           f"{(config.get('attack') or {}).get('_target_', '')}"
    if "applicable" not in record.defense and pair in threat_model_changed_since_the_freeze():
        drop |= {"applicable", "not_applicable"}
    return {key: value for key, value in today.items() if key not in drop}


def pinned_report(record: RunRecord) -> dict:
    """todays_report, with the record's own judgement where `comparable` leaves today's out."""
    today = todays_report(record)
    kept = comparable(record, today)
    return {key: kept.get(key, record.report[key]) for key in today}


def test_a_sample_of_committed_records_upgrades_to_todays_judgement():
    """The quick suite's share of the test above: every 24th committed record, all versions and kinds."""
    paths = sorted(COMMITTED.rglob("*.json"))[::24]
    versions = set()
    for path in paths:
        versions.add(json.loads(path.read_text())["schema_version"])
        record = load_record(path)
        today = comparable(record, todays_report(record))
        assert {key: record.report[key] for key in today} == today, path.name
    assert versions == {1, 2, SCHEMA_VERSION}  # the two an upgrade rewrites, and today's


def test_the_frozen_judgement_reads_no_class_and_no_yaml():
    """A version-2 ABL record against WaNet, made before the pipeline asked the defense: n/a, with the
    frozen reason, even where today's classes would say otherwise (here: the frozen table altered)."""
    record = make_record(attack={"name": "wanet", "target_mode": "all2one", "target": 0, "poison_rate": 0.1,
                                 "n_poisoned": 0, "poisoned_indices_sha256": "0" * 64},
                         defense={"name": "abl"},
                         config={"attack": {"_target_": "backdoorbench.attacks.wanet.WaNet", "target_mode": "all2one"},
                                 "defense": {"_target_": "backdoorbench.defenses.abl.AntiBackdoorLearning"}})
    old = {k: v for k, v in record.to_dict().items() if k != "report"} | {"schema_version": 2}
    report = upgrade(old)["report"]
    assert not report["applicable"] and "wanet controls the victim's training" in report["not_applicable"]
    assert report["not_applicable"].endswith(JUDGED_FROM_CONFIG)
    pair = "backdoorbench.defenses.abl.AntiBackdoorLearning|wanet|backdoorbench.attacks.wanet.WaNet"
    assert frozen_facts()["not_applicable"][pair] == report["not_applicable"]
    # a record that asked keeps its own answer, whatever the table says
    asked = {**old, "defense": {"name": "abl", "applicable": True}}
    assert upgrade(asked)["report"]["applicable"] is True


def test_a_fresh_runs_record_is_what_the_upgrade_would_make_of_it(tiny_results):
    """Each tiny run's record, written as version 2 (no report), upgrades to itself: the same
    report (protocol, applicability, defaults, canonical key, setting) and an unchanged config."""
    runs, _ = tiny_results
    for name, (record, path) in runs.items():
        written = json.loads(path.read_text())
        assert written["report"] == record.report
        if record.defense["name"] in defaults_changed_since_the_freeze():
            continue  # the freeze judges by the defaults of its day (see defaults_changed_since_the_freeze)
        old = {k: v for k, v in written.items() if k != "report"} | {"schema_version": 2}
        assert upgrade(old) == written, name
    assert any(record.defense["name"] not in defaults_changed_since_the_freeze() for record, _ in runs.values())
    reports = {name: record.report for name, (record, _) in runs.items()}
    assert reports["rate_0.05"]["setting"] == {"attack": {"poison_rate": 0.05}, "defense": {}}
    assert not reports["rate_0.05"]["attack_at_defaults"] and reports["rate_0.1"]["attack_at_defaults"]
    assert reports["fine_pruning"]["defense_at_defaults"] and reports["fine_pruning"]["clean_budget"]
    assert reports["fine_pruning"]["setting"]["defense"] == {"epochs": 0, "max_prune_ratio": 0.5}
    assert reports["rate_0.1"]["canonical_key"] == "attacks|mnist5k|quick|mnist_cnn|badnets|all2one(0)|none"
    assert reports["rate_0.1"]["defense_at_defaults"] is None and reports["rate_0.1"]["sensitivity_keys"] == []


def _flat_keys(node, prefix=""):
    if isinstance(node, dict):
        return {k for key, value in node.items() for k in _flat_keys(value, f"{prefix}{key}.")}
    return {prefix[:-1]}


def test_committed_records_have_the_trainer_and_eval_keys_of_a_fresh_run(tiny_results):
    """No upgraded record lacks a key a fresh run's config has (nor keeps the retired `amp`), so no
    table tells old and new records apart by schema ("config without amp (another schema)")."""
    def result_keys(config):  # trainer and eval keys that change a result (the optimizer's own aside)
        return {k for k in _flat_keys(config) if k.split(".")[0] in ("trainer", "eval")
                and not k.startswith("trainer.optimizer.")
                and not any(k == n or k.startswith(n + ".") for n in NON_RESULT_KEYS)}

    wanted = result_keys(tiny_results[0]["rate_0.1"][0].config)
    for path in sorted(COMMITTED.rglob("*.json"))[::16]:
        record = load_record(path)
        keys = result_keys(record.config)
        assert wanted <= keys and "trainer.amp" not in keys, (path.name, sorted(wanted - keys))
        assert record.env["precision"] == "fp32"  # the CPU computed in fp32, amp or not


@pytest.mark.parametrize("amp,device,precision,computed", [
    (True, "cpu", "auto", "fp32"), (True, "cuda:0", "bf16", "bf16"), (False, "cuda", "fp32", "fp32")])
def test_the_retired_amp_becomes_the_precision_it_ran_in(amp, device, precision, computed):
    old = make_record(env={"device": device}, config={
        "trainer": {"epochs": 10, "amp": amp}, "eval": {"pgd": {"enabled": False, "eps": 0.3}}}).to_dict()
    old = {k: v for k, v in old.items() if k not in ("report", "repeat", "artifacts")} | {"schema_version": 2}
    before = copy.deepcopy(old)
    new = upgrade(old)
    assert old == before  # in memory: what was read is left as it was
    assert new["config"]["trainer"] == {"epochs": 10, "precision": precision, "rotation": 0.0, "rotation_p": 0.5,
                                        "schedule_period": None, "plateau_patience": 10}
    assert new["env"]["precision"] == computed
    assert new["config"]["eval"]["pgd"] == {"enabled": False, "eps": 0.3, "rel_step_size": None, "random_start": True,
                                            "losses": ["ce"], "transfer_from": None}
    assert new["config"]["eval"]["reactivation"]["enabled"] is False
    assert new["repeat"] == 1 and new["artifacts"] is None and new["schema_version"] == SCHEMA_VERSION


def test_one_step_per_version_and_an_unknown_version_is_refused_in_one_line(tmp_path):
    data = make_record().to_dict()
    v1 = {k: v for k, v in data.items() if k not in ("victim", "reactivation", "defense_cost", "benign", "report",
                                                      "repeat", "artifacts")} | {"schema_version": 1}
    assert upgrade(v1) == data  # 1 -> 2 -> 3 gives what the run writes today
    assert upgrade(data) is data  # a current record is only validated
    for version in (0, 4, "3", None):
        path = tmp_path / f"v{version}.json"
        path.write_text(json.dumps({**data, "schema_version": version}))
        with pytest.raises(RecordError) as caught:
            load_record(path)
        assert str(caught.value) == (f"{path}: schema_version is {version!r}; this backdoorbench reads "
                                     "versions 1, 2, 3")
    with pytest.raises(RecordError, match="missing fields: config"):  # validated at its own version first
        upgrade({k: v for k, v in v1.items() if k != "config"})
    validate_record(upgrade(v1))


def test_the_frozen_facts_cover_the_methods_of_the_committed_records():
    """The file benchmarks/freeze_record_facts.py made has the layout of `current_facts`, says where
    it came from, and knows every method the committed records name (a method added later has no
    record older than version 3, so the file never needs it)."""
    frozen = frozen_facts()
    assert set(frozen) == set(current_facts()) | {"frozen"}
    assert frozen["frozen"]["command"] == "python -m benchmarks.freeze_record_facts" and frozen["frozen"]["commit"]
    sample = [json.loads(p.read_text()) for p in sorted(COMMITTED.rglob("*.json"))[::24]]
    names = {r["attack"]["name"] for r in sample if r.get("schema_version", 1) < 3}  # the records the facts upgrade
    assert names <= set(frozen["attack_defaults"]) and len(names) > 5
    assert set(frozen["sensitivity"]) | set(frozen["clean_budget"]) <= set(frozen["defense_defaults"])
    assert all(reason.endswith(JUDGED_FROM_CONFIG) for reason in frozen["not_applicable"].values())


def test_the_freeze_refuses_to_replace_the_frozen_file(tmp_path, capsys):
    from benchmarks.freeze_record_facts import main

    out = tmp_path / "facts.json"
    assert main(["--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert {k: v for k, v in written.items() if k != "frozen"} == current_facts()
    out.write_text("{}")
    assert main(["--out", str(out)]) == 2 and out.read_text() == "{}"
    assert "frozen once" in capsys.readouterr().err


def test_an_older_records_victim_trainer_is_the_schemas_unset_block():
    """Records made before `victim_trainer` get it unset (the victim trained with `trainer`), the
    block a run writes today when no protocol file sets it."""
    from dataclasses import asdict

    from backdoorbench.config import VictimTrainerSchema
    from backdoorbench.records import _VICTIM_TRAINER_UNSET

    assert _VICTIM_TRAINER_UNSET == asdict(VictimTrainerSchema())


def test_an_old_records_lpips_weights_becomes_eval_lpips():
    """c79dc24 renamed `eval.lpips_weights` (a path, or null for torch hub's cache) to `eval.lpips`."""
    path = COMMITTED / "mnist5k" / "badnets_all2one" / "cba5b0bb92c69280.json"
    raw = json.loads(path.read_text())
    assert "lpips_weights" in raw["config"]["eval"] and "lpips" not in raw["config"]["eval"]
    upgraded = load_record(path).config["eval"]
    assert "lpips_weights" not in upgraded
    assert upgraded["lpips"] == (raw["config"]["eval"]["lpips_weights"] or "auto")
    with_path = copy.deepcopy(raw)
    with_path["config"]["eval"]["lpips_weights"] = "/weights/alex.pth"
    assert upgrade(with_path)["config"]["eval"]["lpips"] == "/weights/alex.pth"
