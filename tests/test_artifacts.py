"""Artifacts beside the record: atomic .npz round trip, numbers only, and what each run stores."""

import json
import zipfile

import numpy as np
import pytest
import torch

from backdoorbench.artifacts import load_artifacts, save_artifacts, write_beside_record
from backdoorbench.errors import DataError
from backdoorbench.metrics.detection import auroc
from backdoorbench.records import RecordError, artifacts_path, load_record, validate_record
from tests.test_records import make_record


def test_round_trip_is_atomic_and_numeric(tmp_path):
    path = save_artifacts(tmp_path / "r.npz", {"t": torch.arange(6).view(2, 3).half(), "n": np.float64(0.5), "l": [1, 2]})
    data = load_artifacts(path)
    assert data["t"].dtype == np.float32 and data["t"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert data["n"].shape == () and float(data["n"]) == 0.5 and data["l"].tolist() == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.npz"]  # no temp file left behind
    with pytest.raises(TypeError, match="'s' must be numeric"):
        save_artifacts(tmp_path / "s.npz", {"s": np.array(["text"], dtype=object)})
    assert not (tmp_path / "s.npz").exists()


def test_loading_refuses_pickles_and_names_a_corrupt_file(tmp_path):
    evil = tmp_path / "evil.npz"
    np.savez(evil, x=np.array([{"a": 1}], dtype=object))  # an object array needs pickle to load
    with pytest.raises(DataError, match="evil.npz"):
        load_artifacts(evil)
    broken = tmp_path / "broken.npz"
    broken.write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(DataError, match="broken.npz"):
        load_artifacts(broken)
    with pytest.raises(DataError, match="missing.npz"):
        load_artifacts(tmp_path / "missing.npz")


def test_artifacts_never_replace_another_runs_file(tmp_path):
    # The pipeline picks a name no run has used; a file found there anyway belongs to another run.
    record = tmp_path / "abc.json"
    assert write_beside_record(record, {"x": [1.0]}) == "abc.npz"
    before = (tmp_path / "abc.npz").read_bytes()
    with pytest.raises(FileExistsError):
        write_beside_record(record, {"x": [2.0]})
    assert write_beside_record(record, {}) is None  # nothing to save: nothing written or removed
    assert (tmp_path / "abc.npz").read_bytes() == before


def test_record_field_is_optional_and_a_plain_file_name():
    data = make_record().to_dict()
    assert data["artifacts"] is None
    del data["artifacts"]  # records written before the field existed stay valid
    validate_record(data)
    for bad in ("../x.npz", "sub/x.npz", "x.json", 3):
        with pytest.raises(RecordError, match="artifacts"):
            validate_record({**data, "artifacts": bad})


def test_runs_store_examples_gradcam_and_defense_data(tiny_results):
    runs, _ = tiny_results
    record, path = runs["fine_pruning"]
    assert record.artifacts == f"{record.run_id}.npz" and json.loads(path.read_text())["artifacts"] == record.artifacts
    data = load_artifacts(artifacts_path(load_record(path), path))
    assert data["examples_clean"].shape == data["examples_poisoned"].shape == (8, 1, 28, 28)
    # BadNets stamps a 3x3 patch: poisoned and clean examples differ in at most those 9 pixels each
    changed = (data["examples_poisoned"] != data["examples_clean"]).reshape(8, -1).sum(1)
    assert (changed <= 9).all() and changed.sum() > 0
    assert data["gradcam_clean"].shape == data["gradcam_poisoned"].shape == (8, 28, 28)
    assert data["gradcam_clean"].min() >= 0 and data["gradcam_poisoned"].max() <= 1
    fraction, ca, asr = data["fp_pruned_fraction"], data["fp_clean_acc"], data["fp_asr"]
    assert fraction[0] == 0 and np.all(np.diff(fraction) > 0) and fraction[-1] == pytest.approx(0.5, abs=1 / 64)
    assert len(ca) == len(asr) == len(fraction) >= 11
    # the unpruned point is the attacked model itself, measured on the same test set
    assert ca[0] == pytest.approx(record.metrics["attacked"]["clean_acc"])
    assert asr[0] == pytest.approx(record.metrics["attacked"]["asr"])
    assert float(data["fp_chosen_fraction"]) == pytest.approx(record.defense["extras"]["pruned_fraction"])

    record, path = runs["strip"]
    data = load_artifacts(artifacts_path(record, path))
    clean, poisoned = data["strip_entropy_clean"], data["strip_entropy_poisoned"]
    assert len(clean) == record.dataset["n_test"] and len(poisoned) == 900  # the test images not of class 0
    assert float(data["strip_entropy_threshold"]) == pytest.approx(record.defense["extras"]["entropy_threshold_bits"])
    scores = torch.cat([-torch.from_numpy(clean), -torch.from_numpy(poisoned)])
    is_poisoned = torch.cat([torch.zeros(len(clean), dtype=torch.bool), torch.ones(len(poisoned), dtype=torch.bool)])
    assert auroc(scores, is_poisoned) == pytest.approx(record.metrics["detection"]["auroc"])
    # the names every input detector's run saves: the same scores (higher = more suspicious), the truth,
    # the verdict at the threshold
    assert data["detection_scores"].tolist() == pytest.approx(scores.tolist())
    assert data["detection_truth"].dtype == np.bool_ and data["detection_truth"].tolist() == is_poisoned.tolist()
    assert float(data["detection_threshold"]) == pytest.approx(-float(data["strip_entropy_threshold"]))
    flagged = data["detection_flagged"]
    assert flagged.tolist() == (data["detection_scores"] > float(data["detection_threshold"])).tolist()
    assert flagged[~data["detection_truth"]].mean() == pytest.approx(record.metrics["detection"]["fpr"])
    assert 0 <= record.metrics["detection"]["f1"] <= 1

    record, path = runs["neural_cleanse"]
    data = load_artifacts(artifacts_path(record, path))
    assert data["nc_anomaly_index"].shape == data["nc_mask_l1"].shape == (10,)
    assert data["nc_anomaly_index"].tolist() == pytest.approx(record.defense["extras"]["anomaly_index"], rel=1e-6)
    assert float(data["nc_anomaly_threshold"]) == 2.0

    record, path = runs["rate_0.1"]
    assert set(load_artifacts(artifacts_path(record, path))) == {"examples_clean", "examples_poisoned",
                                                                 "gradcam_clean", "gradcam_poisoned"}
    assert zipfile.is_zipfile(artifacts_path(record, path))
