"""Run loggers: the CSV beside the record, and Weights & Biases in offline mode, read back from disk."""

from __future__ import annotations

import csv
import json
import struct
from pathlib import Path

import pytest
import torch
import wandb
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from PIL import Image

import backdoorbench.config  # noqa: F401  (registers the schemas)
from backdoorbench import fileio
from backdoorbench.errors import ConfigError
from backdoorbench.loggers import CsvLogger, WandbLogger

ROWS = [
    {"stage": "victim", "epoch": 1, "loss": 2.302585092994046, "train_acc": 0.1, "lr": 0.01, "time_s": 1.5},
    {"stage": "victim", "epoch": 2, "loss": 0.6931471805599453, "train_acc": 0.75, "lr": 0.005, "time_s": 3.0},
    {"stage": "fine-tune", "epoch": 1, "loss": 0.25, "train_acc": 0.9, "lr": 0.001, "time_s": 0.5, "pruned": 3},
]


# ----------------------------------------------------------------------------- CSV


def test_csv_logger_writes_every_row_and_column(tmp_path: Path) -> None:
    logger = CsvLogger()
    logger.start(run_id="abc", config={}, results_dir=tmp_path)
    for row in ROWS:
        logger.log_epoch(row)
    logger.log_images("trigger", torch.rand(2, 1, 8, 8))
    logger.log_summary({"run_id": "abc"})
    path = logger.finish(tmp_path / "runs" / "abc.json")
    assert path == tmp_path / "runs" / "abc.epochs.csv"
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames == ["stage", "epoch", "loss", "train_acc", "lr", "time_s", "pruned"]
        read = list(reader)
    assert len(read) == 3 and [r["stage"] for r in read] == ["victim", "victim", "fine-tune"]
    for row, back in zip(ROWS, read):
        assert float(back["loss"]) == row["loss"]  # full float precision survives
        assert back["pruned"] == str(row.get("pruned", ""))
    assert sorted(p.name for p in path.parent.iterdir()) == ["abc.epochs.csv"]  # no temp file left


def test_csv_logger_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "abc.epochs.csv"
    target.write_text("old complete file\n")
    logger = CsvLogger()
    for row in ROWS:
        logger.log_epoch(row)

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(fileio.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        logger.finish(tmp_path / "abc.json")
    assert target.read_text() == "old complete file\n"  # never half a CSV
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abc.epochs.csv"]


def test_csv_logger_without_epochs_writes_nothing(tmp_path: Path) -> None:
    assert CsvLogger().finish(tmp_path / "abc.json") is None
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(("name", "cls"), [("csv", CsvLogger), ("wandb", WandbLogger)])
def test_logger_options_compose_and_instantiate(name: str, cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with initialize_config_module(config_module="backdoorbench.conf", version_base=None):
        cfg = compose(config_name="config", overrides=[f"logger={name}"])
    logger = instantiate(cfg.logger)
    assert isinstance(logger, cls)
    if cls is WandbLogger:
        assert (logger.project, logger.entity, logger.mode, logger.tags) == ("backdoorbench", None, "offline", [])


def test_wandb_mode_config_then_env_then_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert WandbLogger().mode == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert WandbLogger().mode == "disabled"
    assert WandbLogger(mode="offline").mode == "offline"
    with pytest.raises(ConfigError, match="logger.mode='onlin' is not a wandb mode; use one of offline, online"):
        WandbLogger(mode="onlin")
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    with pytest.raises(ConfigError, match="WANDB_MODE='dryrun'"):
        WandbLogger()


def test_wandb_logger_needs_start() -> None:
    with pytest.raises(RuntimeError, match="start"):
        WandbLogger(mode="offline").log_epoch(ROWS[0])


# ----------------------------------------------------------------------------- wandb, offline


def read_wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file: a 7-byte header, then LevelDB-log chunks in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    raw, block, pos = path.read_bytes(), 32768, 7
    assert raw[:4] == b":W&B"
    records, chunks = [], []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        chunks.append(raw[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


def _items(entries) -> dict[str, object]:
    return {"/".join(e.nested_key) or e.key: json.loads(e.value_json) for e in entries}


def test_wandb_logger_offline_run_holds_config_history_images_summary(tmp_path: Path, monkeypatch) -> None:
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = WandbLogger(project="backdoorbench-test", tags=["unit"])
    config = {"attack": {"_target_": "backdoorbench.attacks.badnets.BadNets", "poison_rate": 0.1}, "seed": 0}
    logger.start(run_id="abc123", group_id="group9", config=config, results_dir=tmp_path / "results")
    for row in ROWS:
        logger.log_epoch(row)
    logger.log_images("trigger", torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0)))
    record = {"run_id": "abc123",
              "metrics": {"attacked": {"clean_acc": 0.98, "asr": 0.97, "ra": 0.02},
                          "defended": {"clean_acc": 0.96, "asr": 0.05, "ra": 0.9}, "der": 0.95, "detection": None},
              "defense": {"name": "neural_cleanse", "extras": {"anomaly_index_of_smallest": 3.5, "flagged": [0],
                                                               "unlearned": 1}},
              "stealth": {"psnr": {"mean": 30.5, "std": 1.25}, "lpips": None}, "config": config}
    logger.log_summary(record)
    folder = logger.finish(tmp_path / "results" / "runs" / "abc123.json")
    # finish() returns once wandb's service has the exit record; its writer closes the file when
    # the service stops, as at process exit.
    wandb.teardown()

    # <results_dir>/wandb/offline-run-*, the folder the README names, with the per-epoch CSV beside the record
    assert folder.parent == tmp_path / "results" / "wandb" and folder.name.startswith("offline-run-")
    epochs_csv = (tmp_path / "results" / "runs" / "abc123.epochs.csv").read_text().splitlines()
    assert epochs_csv[0] == "stage,epoch,loss,train_acc,lr,time_s,pruned" and len(epochs_csv) == 1 + len(ROWS)
    (run_file,) = folder.glob("run-*.wandb")
    records = read_wandb_records(run_file)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "run" in kinds and "exit" in kinds  # the run was opened and closed

    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == "abc123" and run.run_group == "group9" and list(run.tags) == ["unit"]
    config_back = _items(run.config.update)  # the config given at start, plus any later updates
    for r in records:
        if r.WhichOneof("record_type") == "config":
            config_back.update(_items(r.config.update))
    assert config_back["attack"] == config["attack"] and config_back["seed"] == 0

    history = [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    victim = [h for h in history if "victim/loss" in h]
    assert [h["victim/epoch"] for h in victim] == [1, 2]
    assert [h["victim/loss"] for h in victim] == [ROWS[0]["loss"], ROWS[1]["loss"]]
    (fine_tune,) = [h for h in history if "fine-tune/loss" in h]
    assert fine_tune["fine-tune/pruned"] == 3 and "fine-tune/stage" not in fine_tune
    (images,) = [h for h in history if "images/trigger/path" in h]

    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(_items(r.summary.update))
    assert summary["metrics"] == record["metrics"] and summary["stealth"] == record["stealth"]
    assert summary["record_path"].endswith("abc123.json") and "config" not in summary
    # the headline numbers also as flat keys: the run table's columns
    assert (summary["test/clean_acc"], summary["test/asr"], summary["test/ra"]) == (0.98, 0.97, 0.02)
    assert (summary["test/defended_clean_acc"], summary["test/defended_asr"], summary["test/der"]) == (0.96, 0.05, 0.95)
    assert summary["defense/anomaly_index_of_smallest"] == 3.5 and summary["defense/unlearned"] == 1
    assert "defense/flagged" not in summary and not any(key.startswith("detection/") for key in summary)

    png = folder / "files" / images["images/trigger/path"]
    with Image.open(png) as grid:  # 4 gray 8x8 images in one row, 2 px borders, as RGB
        assert grid.size == (4 * 10 + 2, 12) and grid.mode == "RGB"


def test_summary_numbers_flatten_the_headline_metrics_only() -> None:
    from backdoorbench.loggers import summary_numbers

    record = {"metrics": {"attacked": {"clean_acc": 0.9, "asr": 0.8, "ra": 0.1, "pgd_acc": 0.2},
                          "defended": None, "der": None,
                          "detection": {"tpr": 0.75, "fpr": 0.125, "auroc": 0.9, "threshold_note": "text"}},
              "defense": {"name": "strip", "extras": {"entropy_threshold_bits": 1.5, "calibration_frr": 0.01,
                                                      "per_class": [1.0, 2.0], "flag": True}}}
    assert summary_numbers(record) == {
        "test/clean_acc": 0.9, "test/asr": 0.8, "test/ra": 0.1, "test/pgd_acc": 0.2,
        "detection/tpr": 0.75, "detection/fpr": 0.125, "detection/auroc": 0.9,
        "defense/entropy_threshold_bits": 1.5, "defense/calibration_frr": 0.01,
    }
    assert summary_numbers({"metrics": {}, "defense": {"name": "none"}}) == {}
