"""`eval.detection_only`: a detector scores and flags, nothing is retrained; the record says so, has no
defended CA/ASR (null, with the reason) and keeps the detection and its per-sample arrays. Off (the
default), the key leaves every run id as it was."""

from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from backdoorbench.artifacts import load_artifacts
from backdoorbench.records import RecordError, artifacts_path, load_record, validate_record
from backdoorbench.run_keys import DETECTION_FLAGGED, DETECTION_SCORES, DETECTION_TRUTH, run_config_hash
from tests.test_records import make_record

TINY = ("trainer.epochs=0", "eval.stealth_images=0", "eval.lpips=off", "logger=none", "trainer.progress=false")


def test_the_switch_off_leaves_the_run_id_as_it_was_and_on_makes_another_run(compose_cfg):
    config = OmegaConf.to_container(compose_cfg("defense=spectral"), resolve=True)
    assert config["eval"]["detection_only"] is False
    before = {**config, "eval": {k: v for k, v in config["eval"].items() if k != "detection_only"}}
    assert run_config_hash(config) == run_config_hash(before)  # a record made before the key keeps its id
    on = OmegaConf.to_container(compose_cfg("defense=spectral", "eval.detection_only=true"), resolve=True)
    assert run_config_hash(on) != run_config_hash(config)
    assert run_config_hash(on, ("seed",)) != run_config_hash(config, ("seed",))  # another row, too


def test_a_detection_only_run_records_the_detection_and_no_defended_model(compose_cfg, tmp_path):
    from backdoorbench.pipeline import run, summary_table

    full, full_path = run(compose_cfg(*TINY, "defense=spectral", f"results_dir={tmp_path}"))
    record, path = run(compose_cfg(*TINY, "defense=spectral", "eval.detection_only=true", f"results_dir={tmp_path}"))
    assert load_record(path) == record
    assert record.defense["detection_only"] is True and "detection_only" not in full.defense
    assert record.metrics["defended"] is None and record.metrics["der"] is None
    assert "detection only (eval.detection_only=true)" in record.metrics["defended_reason"]
    assert "defended_reason" not in full.metrics and full.metrics["defended"] is not None
    # the same detection as the full run's, F1 beside the rates; only the full run retrained
    assert record.metrics["detection"] == full.metrics["detection"] and "f1" in record.metrics["detection"]
    assert "n_kept" in full.defense["extras"] and "n_kept" not in record.defense["extras"]
    assert record.report["canonical_key"].startswith("detections|") and full.report["canonical_key"].startswith("defenses|")
    assert record.run_id != full.run_id and record.group_id != full.group_id
    arrays = load_artifacts(artifacts_path(record, path))
    n = record.dataset["n_train"]
    assert arrays[DETECTION_SCORES].shape == arrays[DETECTION_TRUTH].shape == arrays[DETECTION_FLAGGED].shape == (n,)
    assert arrays[DETECTION_TRUTH].dtype == np.bool_ and int(arrays[DETECTION_TRUTH].sum()) == record.attack["n_poisoned"]
    assert int(arrays[DETECTION_FLAGGED].sum()) == record.metrics["detection"]["n_flagged"]
    full_arrays = load_artifacts(artifacts_path(full, full_path))
    assert np.array_equal(full_arrays[DETECTION_SCORES], arrays[DETECTION_SCORES])
    summary = summary_table(record, path)
    assert "detection (spectral): TPR " in summary and "no defended model" in summary and "DER" not in summary


def test_a_clean_victim_gives_the_benign_share_without_a_ca_drop(compose_cfg, tmp_path):
    from backdoorbench.pipeline import run

    record, _ = run(compose_cfg(*TINY, "attack=none", "defense=spectral", "eval.detection_only=true",
                                f"results_dir={tmp_path}"))
    benign = record.benign
    assert benign["false_positive"] == record.metrics["detection"]["n_flagged"] / record.dataset["n_train"]
    assert "ca_drop" not in benign and record.metrics["detection"]["tpr"] is None  # nothing to find


def test_the_record_schema_keeps_the_reason_with_a_null_defended_only():
    data = make_record(metrics={"attacked": {"clean_acc": 0.9, "asr": 1.0, "ra": 0.0}, "defended": None, "der": None,
                                "defended_reason": "detection only"}).to_dict()
    validate_record(data)
    for bad in ("", 3):
        with pytest.raises(RecordError, match="metrics.defended_reason must be a non-empty string"):
            validate_record({**data, "metrics": {**data["metrics"], "defended_reason": bad}})
    repaired = make_record().to_dict()
    with pytest.raises(RecordError, match="only where metrics.defended is null"):
        validate_record({**repaired, "metrics": {**repaired["metrics"], "defended_reason": "detection only"}})
