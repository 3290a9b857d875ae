"""Hold up under crashes: a run killed with SIGKILL mid-training resumes from its last epoch
checkpoint and ends with exactly the metrics of an uninterrupted run (CPU); a killed or failed run
never leaves a record, whole or partial."""

from __future__ import annotations

import csv
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from backdoorbench.records import load_record
from tests.conftest import ROOT, run_cli

# Few epochs, but long enough that a kill lands mid-training: 1,000 training images (the rest of
# mnist5k is the test set), so an epoch takes about a second on a CPU core.
EPOCHS = 3
SETTING = (f"trainer.epochs={EPOCHS}", "dataset.test_per_class=400", "eval.stealth_images=0", "trainer.progress=false")


def records_under(results_dir: Path) -> list[Path]:
    return sorted((results_dir / "runs").rglob("*.json"))


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def checkpoints_under(results_dir: Path) -> list[Path]:
    # The folder key (run id, cache key, ...) is the pipeline's business; only the file name is fixed.
    return sorted((results_dir / "checkpoints").glob("**/victim.pt"))


def kill_after_first_checkpoint(results_dir: Path, timeout: float = 300) -> tuple[Path, int]:
    """Start the run, SIGKILL it once its epoch checkpoint exists; return (checkpoint, epoch)."""
    kill_once_written(SETTING, results_dir, "victim.pt", timeout)
    [checkpoint] = checkpoints_under(results_dir)
    epoch = torch.load(checkpoint, map_location="cpu", weights_only=True)["epoch"]
    return checkpoint, epoch


def epoch_rows(record_path: Path) -> list[dict[str, str]]:
    with open(record_path.with_suffix(".epochs.csv")) as handle:
        return [{k: v for k, v in row.items() if k != "time_s"} for row in csv.DictReader(handle)]


@pytest.mark.slow  # 29 s: the quick suite must stay under 10 min; CI runs it with -m slow
def test_sigkill_mid_training_then_rerun_resumes_to_the_same_metrics(tmp_path):
    straight = run_cli(*SETTING, f"results_dir={tmp_path / 'straight'}")
    assert straight.returncode == 0, straight.stderr
    [straight_path] = records_under(tmp_path / "straight")
    reference = load_record(straight_path)

    killed = tmp_path / "killed"
    checkpoint, epoch = kill_after_first_checkpoint(killed)
    assert 1 <= epoch < EPOCHS  # killed mid-training, after at least one finished epoch
    assert files_under(killed / "runs") == []  # no record of an unfinished run, no half-written one

    resumed = run_cli(*SETTING, f"results_dir={killed}")
    assert resumed.returncode == 0, resumed.stderr
    assert f"victim: resumed from {checkpoint} after epoch {epoch} of {EPOCHS}" in resumed.stdout + resumed.stderr
    [path] = records_under(killed)
    record = load_record(path)
    assert record.run_id == reference.run_id
    assert record.metrics == reference.metrics  # exactly: CA, ASR, RA of the attacked model
    assert record.attack["poisoned_indices_sha256"] == reference.attack["poisoned_indices_sha256"]
    # Every epoch is in the log, the restored ones included, with the same losses and accuracies.
    assert epoch_rows(path) == epoch_rows(straight_path) and len(epoch_rows(path)) == EPOCHS
    assert checkpoints_under(killed) == []  # a finished run removes its checkpoint
    print(f"\nresume: {EPOCHS} epochs, killed after epoch {epoch}, metrics equal: {record.metrics['attacked']}")


# Training-controlled attacks: their generator, its optimizer and their per-batch stream are in each
# epoch checkpoint, and what `prepare` computed (Input-aware's mask) in its own file. Each case is
# killed once the named checkpoint file exists: LIRA in stage I, WB in stage II (stage I done),
# Input-aware after its mask pre-training and one victim epoch, WaNet and Blind after one victim epoch.
ATTACK_SETTING = ("trainer.epochs=2", "dataset.test_per_class=450", "eval.stealth_images=0", "trainer.progress=false")
ATTACK_CASES = {
    "wanet": (["attack=wanet", "trainer.rotation=10"], "victim.pt"),  # poisoned, then cropped and rotated
    "input_aware": (["attack=input_aware", "attack.mask_epochs=1", "attack.channels=4", "attack.depth=1"], "victim.pt"),
    "lira": (["attack=lira", "attack.stage1_epochs=2", "attack.generator_width=4"], "victim.stage1.pt"),
    "wb": (["attack=wb", "attack.stage1_epochs=1", "attack.generator_width=4"], "victim.pt"),
    # the clean-loss history of the last 3 batches decides each batch (of 4 an epoch); it is in the checkpoint
    "blind": (["attack=blind", "attack.loss_threshold=2.5", "attack.batch_history_len=3"], "victim.pt"),
}


def kill_once_written(args: list[str], results_dir: Path, name: str, timeout: float = 300) -> str:
    """Run `python -m backdoorbench args`, SIGKILL it as soon as a checkpoint file `name` exists;
    return what it printed."""
    log = results_dir.parent / f"{results_dir.name}.killed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "backdoorbench", *args, f"results_dir={results_dir}"],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout
        try:
            while not list((results_dir / "checkpoints").glob(f"**/{name}")):
                assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before {name}:\n{log.read_text()}"
                assert time.monotonic() < deadline, f"no {name} within the timeout"
                time.sleep(0.02)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return log.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("attack", ATTACK_CASES)
def test_training_controlled_attack_resumes_exactly_after_sigkill(tmp_path, attack, compose_cfg, monkeypatch, caplog):
    from backdoorbench.pipeline import run

    extra, killed_at = ATTACK_CASES[attack]
    args = [*ATTACK_SETTING, *extra]
    # Only the killed run is a separate process (a CLI start costs seconds): the uninterrupted run
    # and the resumed one run here. The subprocess gets this process's thread count, since CPU sums
    # may round differently with another.
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    reference, straight_path = run(compose_cfg(*args, f"results_dir={tmp_path / 'straight'}"))

    killed = tmp_path / "killed"
    kill_once_written(args, killed, killed_at)
    assert files_under(killed / "runs") == []
    caplog.set_level(logging.INFO)
    record, path = run(compose_cfg(*args, f"results_dir={killed}"))
    assert "resumed from" in caplog.text, caplog.text[-3000:]
    if attack == "input_aware":  # the mask pre-training is restored, not run again
        assert "input_aware: preparation restored from" in caplog.text and "mask epoch" not in caplog.text
    assert record.run_id == reference.run_id
    assert record.metrics == reference.metrics  # exactly, the backdoor (ASR) included
    # every epoch of every stage (mask pre-training, LIRA's two stages) with the same numbers
    assert epoch_rows(path) == epoch_rows(straight_path)
    assert list((killed / "checkpoints").rglob("*.pt")) == []


def test_a_defense_failing_after_training_leaves_no_record(tmp_path):
    # A real failure after the victim trained: fine-tuning at a huge learning rate turns NaN (in
    # its 2nd epoch: the 1st has two batches, and the first update only shows in the second).
    proc = run_cli("trainer.epochs=1", "dataset.test_per_class=400", "eval.stealth_images=0",
                   "defense=fine_tuning", "defense.epochs=2", "defense.lr=1e30", f"results_dir={tmp_path}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: fine-tune: the training loss became nan at epoch 2; lower the learning rate")
    assert files_under(tmp_path / "runs") == []
    assert not (tmp_path / "hydra").exists()  # Hydra's files for the failed run are removed too


def test_an_unexpected_crash_after_training_leaves_no_record(tmp_path, compose_cfg, monkeypatch):
    from backdoorbench.defenses.fine_tuning import FineTuning
    from backdoorbench.pipeline import run

    def crash(self, ctx):
        raise RuntimeError("injected crash in the defense")

    monkeypatch.setattr(FineTuning, "apply", crash)
    cfg = compose_cfg("trainer.epochs=1", "dataset.test_per_class=400", "eval.stealth_images=0",
                      "defense=fine_tuning", "logger=csv", "trainer.progress=false", f"results_dir={tmp_path}")
    with pytest.raises(RuntimeError, match="injected crash"):
        run(cfg)
    assert files_under(tmp_path / "runs") == []  # no record, and no epochs.csv: the logger writes
    # only beside a finished record


def test_a_broken_or_foreign_prepare_checkpoint_is_one_line(tmp_path):
    from backdoorbench.attacks.input_aware import InputAware
    from backdoorbench.errors import DataError
    from backdoorbench.victim import prepare_attack

    attack = InputAware(num_classes=10, image_shape=(1, 28, 28), channels=4, depth=1)
    path = tmp_path / "prepare.pt"
    for content, message in ((b"not a zip", "cannot be read"), (None, "is not input_aware's saved preparation")):
        if content is None:
            torch.save({"format": "something else"}, path)
        else:
            path.write_bytes(content)
        with pytest.raises(DataError, match=message) as info:
            prepare_attack(attack, path, trainer=None, train=None, generator=torch.Generator(), build_model=None)
        assert "\n" not in str(info.value) and "delete it" in str(info.value)
    assert not attack.mask_ready  # nothing was restored from either file
