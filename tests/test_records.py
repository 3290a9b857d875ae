"""Record schema, validation and the atomic round trip."""

import copy
import json

import pytest

from backdoorbench.records import (
    SCHEMA_VERSION,
    RecordError,
    RunRecord,
    frozen_facts,
    frozen_report,
    load_record,
    save_record,
    validate_record,
)


def make_record(**changes) -> RunRecord:
    """A valid record of the current schema; `changes` replace its fields. Its `report`, unless given,
    is the upgrade's for them (what a run of today's methods writes: tests/test_record_upgrade.py),
    which reads no class: many tests make many records."""
    data = dict(
        run_id="abc123",
        group_id="g1",
        created_at="2026-12-01T00:00:00+00:00",
        dataset={"name": "mnist5k", "num_classes": 10},
        model={"name": "mnist_cnn"},
        attack={"name": "badnets", "target_mode": "all2one", "target": 0, "poison_rate": 0.1,
                "n_poisoned": 400, "poisoned_indices_sha256": "0" * 64},
        defense={"name": "fine_tuning"},
        seed=0,
        metrics={"attacked": {"clean_acc": 0.98, "asr": 1.0, "ra": 0.0},
                 "defended": {"clean_acc": 0.97, "asr": 0.1, "ra": 0.85}, "der": 0.945},
        stealth={"psnr": {"mean": 21.9, "std": 1.0}, "lpips": None, "lpips_reason": "weights absent"},
        timings_s={"train": 12.5, "total": 15.0},
        env={"torch": "x", "git_commit": None},
        config={"seed": 0},
    )
    data.update(changes)
    record = RunRecord(**data)
    if record.report is None:
        record.report = frozen_report(record.to_dict(), frozen_facts())
    return record


def test_round_trip(tmp_path):
    record = make_record()
    path = save_record(record, tmp_path / "runs" / "r.json")
    loaded = load_record(path)
    assert loaded == record
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert isinstance(data["metrics"]["attacked"]["clean_acc"], float)
    assert list(tmp_path.joinpath("runs").iterdir()) == [path]  # no temp file left behind


def _broken(mutate):
    data = make_record().to_dict()
    mutate(data)
    return data


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: d.update(schema_version=0), "schema_version"),
        (lambda d: d.pop("seed"), "missing fields: seed"),
        (lambda d: d.update(seed="0"), "seed must be an integer"),
        (lambda d: d["metrics"]["attacked"].update(asr="1.0"), "metrics.attacked.asr"),
        (lambda d: d["metrics"]["attacked"].update(clean_acc=1.5), "metrics.attacked.clean_acc"),
        (lambda d: d["metrics"].update(der=None), "both be present or both null"),
        (lambda d: d["attack"].pop("poison_rate"), "attack.poison_rate"),
        (lambda d: d["timings_s"].update(train=-1), "timings_s.train"),
        (lambda d: d["dataset"].pop("name"), "dataset.name must be a string"),
        (lambda d: d.update(report=None), "report must be an object with protocol, applicable"),
        (lambda d: d["report"].pop("canonical_key"), "report lacks canonical_key"),
        (lambda d: d["report"].update(applicable="yes"), "report.applicable must be bool, got 'yes'"),
        (lambda d: d["report"].update(defense_at_defaults=1), "report.defense_at_defaults must be bool or null"),
        (lambda d: d["report"].update(applicable=False), "report.not_applicable must be the reason"),
        (lambda d: d["report"].update(sensitivity_keys=[1]), "report.sensitivity_keys must be a list of strings"),
        (lambda d: d["report"].update(canonical_key="defenses|mnist5k"), r"report.canonical_key must be <table>\|"),
        (lambda d: d["report"].update(setting={"attack": {}}), "report.setting must be an object with the objects"),
    ],
)
def test_validation_names_the_broken_field(mutate, message):
    with pytest.raises(RecordError, match=message):
        validate_record(_broken(mutate))


def test_current_records_carry_the_protocol_fields_and_the_report_and_version_1_records_stay_readable(tmp_path):
    assert SCHEMA_VERSION == 3
    data = make_record().to_dict()
    for key in ("reactivation", "defense_cost", "benign", "victim", "report"):
        assert key in data and (data[key] is None) == (key != "report")  # written, null when the run had none
        with pytest.raises(RecordError, match=f"missing fields: {key}"):
            validate_record({k: v for k, v in data.items() if k != key})
    # a record written before version 2: schema 1, without the fields added within it
    old = {k: v for k, v in data.items()
           if k not in ("victim", "artifacts", "repeat", "reactivation", "defense_cost", "benign", "report")}
    old["schema_version"] = 1
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = load_record(path)  # upgraded on load
    assert loaded.schema_version == SCHEMA_VERSION and loaded.reactivation is None and loaded.benign is None
    assert loaded.repeat == 1 and loaded.report == data["report"]
    for version in (0, 4, True, "2"):
        with pytest.raises(RecordError, match=r"^schema_version is .*; this backdoorbench reads versions 1, 2, 3$"):
            validate_record({**data, "schema_version": version})


def test_save_refuses_an_invalid_record_and_writes_nothing(tmp_path):
    record = make_record(metrics={"attacked": {"clean_acc": float("nan"), "asr": 1.0, "ra": 0.0}, "defended": None, "der": None})
    with pytest.raises(RecordError):
        save_record(record, tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()


def test_load_reports_corrupt_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(RecordError, match="bad.json"):
        load_record(path)


def test_record_without_defense_has_null_defended_metrics(tmp_path):
    record = make_record(defense={"name": "none"}, metrics={"attacked": {"clean_acc": 0.9, "asr": 0.9, "ra": 0.1},
                                                           "defended": None, "der": None})
    assert load_record(save_record(record, tmp_path / "r.json")).metrics["defended"] is None


def test_to_dict_is_a_deep_copy():
    record = make_record()
    data = record.to_dict()
    data["metrics"]["attacked"]["asr"] = 0.0
    assert record.metrics["attacked"]["asr"] == 1.0
    assert copy.deepcopy(data) == data
