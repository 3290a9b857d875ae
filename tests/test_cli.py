"""The Hydra app end to end: a tiny real run, sweeps, --cfg, the leaderboard on its output."""

import json
from pathlib import Path

import pytest

from backdoorbench.records import SCHEMA_VERSION, load_record
from tests.conftest import run_cli


def records_under(results_dir: Path) -> list[Path]:
    return sorted((results_dir / "runs").rglob("*.json")) if (results_dir / "runs").exists() else []


def test_one_epoch_run_writes_a_valid_record(tmp_path):
    proc = run_cli("trainer.epochs=1", "defense=fine_tuning", "defense.epochs=1", f"results_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    [path] = records_under(tmp_path)
    assert f"record: {path}" in proc.stdout
    record = load_record(path)
    assert record.dataset["name"] == "mnist5k" and record.dataset["n_train"] == 4000 and record.dataset["n_test"] == 1000
    assert record.attack["name"] == "badnets" and record.attack["n_poisoned"] == 400
    assert record.defense["name"] == "fine_tuning" and record.defense["clean_subset_size"] == 200
    assert record.metrics["defended"] is not None and 0 <= record.metrics["der"] <= 1
    assert record.config["trainer"]["epochs"] == 1 and record.overrides[0] == "trainer.epochs=1"
    assert record.env["torch"] and "git_commit" in record.env
    assert record.stealth["n"] == 1000 and record.stealth["linf"]["mean"] == 1.0  # the checkerboard has 0 and 1 pixels
    assert record.stealth["ssim"]["mean"] < 1 and record.stealth["psnr"]["mean"] > 10
    assert {"data", "poison", "train", "eval_attacked", "defense", "total"} <= record.timings_s.keys()
    epochs_csv = path.with_suffix(".epochs.csv").read_text().splitlines()
    assert epochs_csv[0].startswith("stage,epoch,loss") and len(epochs_csv) == 3  # victim + fine-tune epoch
    assert "CA" in proc.stdout and "ASR" in proc.stdout


@pytest.mark.slow  # 14 s: four runs through Hydra's multirun; the quick suite keeps to 10 min
def test_multirun_sweeps_attacks_and_seeds(tmp_path):
    proc = run_cli("--multirun", "attack=badnets,blended", "seed=0,1", "trainer.epochs=0", f"results_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    records = [load_record(p) for p in records_under(tmp_path)]
    assert sorted((r.attack["name"], r.seed) for r in records) == [("badnets", 0), ("badnets", 1), ("blended", 0), ("blended", 1)]
    assert len({r.run_id for r in records}) == 4 and len({r.group_id for r in records}) == 2
    assert (tmp_path / "hydra" / "multirun").is_dir()  # Hydra's own outputs follow results_dir


def test_cfg_job_prints_the_resolved_config(tmp_path):
    proc = run_cli("--cfg", "job", "attack=blended", "attack.target_mode=all2all", f"results_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert "Blended" in proc.stdout and "target_mode: all2all" in proc.stdout
    assert not records_under(tmp_path)


# Bad input (unknown names, wrong types, values out of range, bad files, NaN loss, a results folder
# that can't be written): the catalogue in tests/test_hostile.py.


def test_leaderboard_module_runs_on_app_output(tmp_path):
    assert run_cli("trainer.epochs=0", f"results_dir={tmp_path}").returncode == 0
    proc = run_cli(f"results_dir={tmp_path}", module="backdoorbench.leaderboard")
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "leaderboard" / "leaderboard.md").read_text()
    assert "## mnist5k" in text and "| mnist_cnn | badnets | all2one(0) | 0 ep | – | 1 |" in text
    assert (tmp_path / "leaderboard" / "leaderboard.html").is_file() and (tmp_path / "leaderboard" / "attacks.csv").is_file()
    assert json.loads(records_under(tmp_path)[0].read_text())["schema_version"] == SCHEMA_VERSION
