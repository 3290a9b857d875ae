"""What a run shows while it works: a bar with loss/acc/lr on a terminal, one log line per epoch
everywhere (a terminal, a file, Hydra's log), progress of long stages, warnings as one line."""

from __future__ import annotations

import csv
import logging
import re
import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from backdoorbench import progress
from backdoorbench.datasets.base import Split
from backdoorbench.metrics.stealth import LpipsUnavailableWarning
from backdoorbench.train import Trainer, refresh_every
from tests.conftest import ROOT

EPOCH_LINE = re.compile(r"\b([A-Za-z][\w-]*(?: [\w-]+)*?) epoch (\d+)/(\d+): loss (\d+\.\d{4}), acc (\d\.\d{4}), lr (\S+), (\d+\.\d) s")


def tiny_split(n: int = 40) -> Split:
    g = torch.Generator().manual_seed(0)
    return Split(torch.randint(0, 256, (n, 1, 8, 8), dtype=torch.uint8, generator=g), torch.randint(0, 3, (n,), generator=g))


def tiny_trainer(**kwargs) -> Trainer:
    return Trainer(epochs=3, batch_size=8, optimizer=partial(torch.optim.SGD, lr=0.1), augment=False, device="cpu", **kwargs)


def test_refresh_interval_reads_the_sums_a_few_times_an_epoch() -> None:
    assert refresh_every(32) == 4  # mnist5k: 32 batches, 8 readings
    assert refresh_every(3) == 1
    assert refresh_every(100_000) == 50  # never fewer than one reading per 50 steps
    for batches in range(1, 500):
        readings = batches // refresh_every(batches)
        assert readings >= min(batches, 8) or batches // 50 <= readings


def test_each_epoch_logs_one_line_with_the_rows_numbers(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
    with caplog.at_level(logging.INFO, logger="backdoorbench.train"):
        history = tiny_trainer(progress=False).fit(model, tiny_split(), generator=torch.Generator().manual_seed(1),
                                                   desc="victim")
    lines = [r.getMessage() for r in caplog.records if r.name == "backdoorbench.train"]
    assert len(lines) == 3
    for line, row in zip(lines, history):
        stage, epoch, epochs, loss, acc, lr, seconds = EPOCH_LINE.fullmatch(line).groups()
        assert (stage, int(epoch), int(epochs)) == ("victim", row["epoch"], 3)
        assert (loss, acc, seconds) == (f"{row['loss']:.4f}", f"{row['train_acc']:.4f}", f"{row['time_s']:.1f}")
        assert float(lr) == pytest.approx(row["lr"], rel=1e-3)
    assert history[0]["lr"] > history[2]["lr"]  # the cosine schedule shows in the lines


def test_the_bar_shows_loss_acc_and_lr_on_a_terminal(monkeypatch, capsys) -> None:
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
    history = tiny_trainer(progress=True).fit(model, tiny_split(), generator=torch.Generator().manual_seed(1),
                                              epochs=1, desc="victim")
    shown = capsys.readouterr().err
    # the last state of the bar before it is cleared: all 5 batches, the epoch's own loss and accuracy
    states = re.findall(r"victim 1/1: [^\r\n]*5/5[^\r\n]*loss=(\d\.\d{4}), acc=(\d\.\d{4}), lr=([\d.e-]+)", shown)
    assert states, shown
    assert states[-1] == (f"{history[0]['loss']:.4f}", f"{history[0]['train_acc']:.4f}", "0.1")


def test_no_bar_when_not_on_a_terminal_or_switched_off(monkeypatch, capsys) -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    tiny_trainer(progress=True).fit(model, tiny_split(), generator=torch.Generator().manual_seed(1), epochs=1)
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    tiny_trainer(progress=False).fit(model, tiny_split(), generator=torch.Generator().manual_seed(1), epochs=1)
    assert capsys.readouterr().err == ""


def test_track_reports_a_long_stage_off_a_terminal(monkeypatch, caplog) -> None:
    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    with caplog.at_level(logging.INFO, logger="backdoorbench.progress"):
        assert list(progress.track(range(4), "nc: trigger search", unit="epochs", every_s=0)) == [0, 1, 2, 3]
        for i in progress.track(range(10), "anp: masks", unit="iterations", every_s=3600):
            if i == 2:
                break
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:4] == [f"nc: trigger search: {k}/4 epochs, 0 s" for k in range(1, 5)]
    assert re.fullmatch(r"nc: trigger search: done, 4/4 epochs in \d+\.\d s", lines[4])
    # a stage that ends early (NC's early stop) says how many it finished; no periodic line within the hour
    assert len(lines) == 6 and re.fullmatch(r"anp: masks: stopped, 2/10 iterations in \d+\.\d s", lines[5])


def test_track_draws_a_bar_on_a_terminal_and_then_one_line(monkeypatch, capsys, caplog) -> None:
    monkeypatch.setattr(progress, "on_terminal", lambda: True)
    with caplog.at_level(logging.INFO, logger="backdoorbench.progress"):
        for _ in progress.track(range(3), "strip: entropy", unit="batches", every_s=0):
            pass
    assert "strip: entropy" in capsys.readouterr().err  # the bar
    [line] = [r.getMessage() for r in caplog.records]  # the bar replaces the periodic lines
    assert line.startswith("strip: entropy: done, 3/3 batches in ")


def test_a_warning_becomes_one_log_line(monkeypatch, caplog, capsys) -> None:
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # restored after the test
    progress.warnings_as_log_lines()
    with caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("always")
        # catch_warnings restores showwarning on exit; install again inside it
        progress.warnings_as_log_lines()
        warnings.warn("LPIPS not computed: weights not found", LpipsUnavailableWarning, stacklevel=1)
        warnings.warn("some library notice", DeprecationWarning, stacklevel=1)
    ours, theirs = caplog.records
    assert (ours.name, ours.levelname, ours.getMessage()) == ("backdoorbench.metrics.stealth", "WARNING",
                                                             "LPIPS not computed: weights not found")
    assert theirs.name == "py.warnings" and theirs.getMessage().startswith("some library notice (DeprecationWarning, ")
    assert capsys.readouterr().err == ""  # not Python's two-line format


@pytest.mark.slow  # 10 s: a real two-epoch run in a subprocess; the quick suite keeps to 10 min
def test_a_two_epoch_run_sent_to_a_file_shows_one_line_per_epoch(tmp_path: Path) -> None:
    log_file = tmp_path / "log.txt"
    with log_file.open("w") as out:
        proc = subprocess.run([sys.executable, "-m", "backdoorbench", "trainer.epochs=2", "eval.stealth_images=0",
                               "dataset.test_per_class=10", f"results_dir={tmp_path / 'x'}"],
                              cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=300)
    text = log_file.read_text()
    assert proc.returncode == 0, text
    found = [m.groups() for m in EPOCH_LINE.finditer(text)]
    assert [(stage, epoch, epochs) for stage, epoch, epochs, *_ in found] == [("victim", "1", "2"), ("victim", "2", "2")]
    [record] = (tmp_path / "x" / "runs").rglob("*.json")
    with record.with_suffix(".epochs.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    for (*_, loss, acc, lr, _), row in zip(found, rows):  # the printed numbers are the CSV's
        assert (loss, acc) == (f"{float(row['loss']):.4f}", f"{float(row['train_acc']):.4f}")
    [hydra_log] = (tmp_path / "x" / "hydra").rglob("*.log")  # Hydra's own log holds the same lines
    assert [m.groups() for m in EPOCH_LINE.finditer(hydra_log.read_text())] == found
    assert "\r" not in text and "it/s" not in text  # no bar in a file
    assert text.index("epoch 2/2") < text.index("record: ")


def test_a_long_defense_stage_reports_what_it_did(monkeypatch, caplog) -> None:
    from backdoorbench.attacks.badnets import BadNets
    from backdoorbench.defenses.strip import Strip
    from tests.test_defenses_detect import NUM_CLASSES, SHAPE, PatchDominated, context, quadrant_data

    monkeypatch.setattr(progress, "on_terminal", lambda: False)
    attack = BadNets(num_classes=NUM_CLASSES, image_shape=SHAPE, patch_size=3)
    poisoned = attack.poison_dataset(quadrant_data(40, seed=9), torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="backdoorbench.progress"):
        Strip(num_superimpose=8, batch_size=16).apply(context(PatchDominated(attack), poisoned, quadrant_data(40, seed=7)))
    [line] = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(r"strip: entropy of 40 inputs x 8 overlays: done, 3/3 batches in \d+\.\d s", line)
