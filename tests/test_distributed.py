"""Data-parallel training under torchrun: 2 CPU processes over gloo against one process.

The defining property: with global batch semantics, N processes compute the gradient of the same
batch as one process, so a network without batch norm or dropout ends with the same weights (up
to the order of float sums). With batch norm and dropout, as in the real pipeline, a DDP run is
another valid sample of training (each process normalizes its own half batch and draws its own
dropout masks), so its metrics are compared within a tolerance instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import ddp_worker
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def torchrun(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    return subprocess.run(command, cwd=ROOT, env={**env, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True,
                          text=True, timeout=timeout)


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


@pytest.mark.slow
def test_two_processes_train_the_same_weights_as_one_and_only_rank_0_writes(tmp_path):
    done = torchrun(str(ROOT / "tests" / "ddp_worker.py"), str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    # Rank 1 wrote nothing: one result, one trainer checkpoint, no temp file.
    assert files_under(tmp_path) == ["ckpt/plain.pt", "result.pt"]
    result = torch.load(tmp_path / "result.pt", weights_only=True)
    assert result["world_size"] == 2
    checkpoint = torch.load(tmp_path / "ckpt" / "plain.pt", weights_only=True)
    assert checkpoint["epoch"] == 2 and checkpoint["meta"]["world_size"] == 2
    assert result["small_batch_error"].startswith("train: 2 processes need at least 2 images each per batch, but "
                                                  "trainer.batch_size=3")

    torch.manual_seed(123)  # the worker's fits seed themselves
    one = ddp_worker.plain_fit()
    two = result["plain"]
    for key, value in one["state"].items():
        assert torch.allclose(value, two["state"][key], rtol=0, atol=1e-6), key
    # the extra tensor (trainer's optimizer) and the side tensor (own optimizer, averaged gradients)
    assert torch.allclose(one["shift"], two["shift"], rtol=0, atol=1e-6)
    assert torch.allclose(one["scale"], two["scale"], rtol=0, atol=1e-6)
    assert not torch.equal(two["scale"], torch.ones_like(two["scale"]))  # it did train
    assert [r["train_acc"] for r in one["history"]] == [r["train_acc"] for r in two["history"]]
    assert [r["loss"] for r in one["history"]] == pytest.approx([r["loss"] for r in two["history"]], rel=1e-6)

    # Every training-controlled attack trains under DDP, and all processes end with the same
    # victim and the same trigger (generator gradients averaged, rank 0's batch-norm statistics).
    assert result["attacks_agree"] == {"wanet": True, "input_aware": True, "lira": True, "lira_lookahead": True,
                                       "wb": True}


# Measured for this setting (mnist5k, 1 epoch), seeds 0-2: 2 processes vs 1 differed by at most
# 0.013 CA, 0.023 ASR, 0.011 RA, while seed 0 vs 1 vs 2 in one process spans 0.089 CA and 0.11 ASR.
TOLERANCE = {"clean_acc": 0.03, "asr": 0.05, "ra": 0.03}


@pytest.mark.slow
def test_torchrun_pipeline_writes_one_record_with_the_metrics_of_one_process(tmp_path, compose_cfg):
    from backdoorbench.pipeline import run

    overrides = ["trainer.epochs=1", "eval.stealth_images=0", "trainer.progress=false"]
    done = torchrun("-m", "backdoorbench", *overrides, f"results_dir={tmp_path / 'ddp'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("record: ") == 1  # only rank 0 prints the table
    files = files_under(tmp_path / "ddp")
    records = [f for f in files if f.startswith("runs/") and f.endswith(".json")]
    assert len(records) == 1 and len([f for f in files if f.endswith(".epochs.csv")]) == 1
    assert len({f.split("/")[3] for f in files if f.startswith("hydra/runs/")}) == 1  # rank 1's went to a temp folder
    assert not any(f.startswith("checkpoints/") for f in files)
    ddp = json.loads((tmp_path / "ddp" / records[0]).read_text())
    assert ddp["env"]["world_size"] == 2

    one, _ = run(compose_cfg(*overrides, f"results_dir={tmp_path / 'one'}"))
    assert one.env["world_size"] == 1 and one.run_id == ddp["run_id"]
    for key, tolerance in TOLERANCE.items():
        assert abs(ddp["metrics"]["attacked"][key] - one.metrics["attacked"][key]) <= tolerance, key
    assert ddp["metrics"]["attacked"]["clean_acc"] > 0.6  # it learned
