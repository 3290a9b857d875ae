"""Results are sacred: a default run never writes into the committed results/, and the same config
run again (another machine, another thread count) keeps its record beside the first one."""

from __future__ import annotations

import subprocess

import pytest
import torch

from backdoorbench.leaderboard import load_records_with_paths
from backdoorbench.records import RunRecord, latest_repeats, load_record, save_record
from tests.conftest import ROOT, run_cli
from tests.test_records import make_record

SMALL = ("trainer.epochs=1", "dataset.test_per_class=450", "eval.stealth_images=8", "trainer.progress=false")


def test_a_default_run_writes_outside_the_committed_results(tmp_path, monkeypatch):
    # No results_dir given, run from a folder of its own: everything goes under ./outputs/,
    # which git ignores, so a default run in a fresh clone leaves `git status` clean.
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # this checkout's package, whatever is installed
    proc = run_cli("trainer.epochs=0", "eval.stealth_images=0", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]
    [record] = (tmp_path / "outputs" / "runs").rglob("*.json")
    assert f"record: {record.relative_to(tmp_path)}" in proc.stdout
    relative = record.relative_to(tmp_path)
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", str(relative)])
    assert ignored.returncode == 0, f"{relative} would show in git status"


def test_the_same_config_run_twice_keeps_both_records(tmp_path, compose_cfg):
    from backdoorbench.pipeline import run

    cfg = compose_cfg(*SMALL, "cache=false", f"results_dir={tmp_path}")  # both train, as on two machines
    threads = torch.get_num_threads()
    paths = []
    try:
        for count in (1, 2):  # the same config on "another machine": another thread count
            torch.set_num_threads(count)
            paths.append(run(cfg)[1])
    finally:
        torch.set_num_threads(threads)
    first, second = paths
    assert first.name.endswith(".json") and second == first.with_name(first.stem + ".2.json")
    records = [load_record(p) for p in paths]
    assert [r.repeat for r in records] == [1, 2] and records[0].run_id == records[1].run_id
    assert [r.env["torch_threads"] for r in records] == [1, 2]
    # each keeps its own artifacts and epoch log, and the first run's files are as it wrote them
    assert records[0].artifacts == first.with_suffix(".npz").name
    assert records[1].artifacts == second.with_suffix(".npz").name
    for path in paths:
        assert path.with_suffix(".npz").is_file() and path.with_suffix(".epochs.csv").is_file()
    assert load_record(first) == records[0]
    # the leaderboard and the figures count the seed once: the latest repeat
    assert [path for _, path in load_records_with_paths(tmp_path)] == [second]


def test_a_taken_name_is_never_replaced(tmp_path):
    # A record written meanwhile under the chosen name (the same config finishing elsewhere at the
    # same moment) is kept; the exclusive write refuses instead of replacing it.
    path = save_record(make_record(), tmp_path / "abc123.json")
    before = path.read_bytes()
    with pytest.raises(FileExistsError):
        save_record(make_record(seed=1, config={"seed": 1}), path, exclusive=True)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["abc123.json"]


def test_latest_repeat_wins_whatever_the_file_order(tmp_path):
    older, newer, other = make_record(repeat=2), make_record(repeat=10), make_record(run_id="other")
    records: list[tuple[RunRecord, object]] = [(newer, tmp_path / "abc123.10.json"), (older, tmp_path / "abc123.2.json"),
                                               (other, tmp_path / "other.json")]
    assert latest_repeats(records) == [records[0], records[2]]


def test_repeat_must_be_a_positive_integer(tmp_path):
    from backdoorbench.records import RecordError

    for bad in (0, "2", True):
        with pytest.raises(RecordError, match="repeat must be an integer >= 1"):
            save_record(make_record(repeat=bad), tmp_path / "r.json")


def test_a_record_says_which_cpu_kernels_computed_it():
    # the same seed repeats to the bit only on the same vector ISA: the record names it, and a run
    # pinned to AVX2 (ATEN_CPU_CAPABILITY) says so
    import os
    import sys

    code = ("import torch; from backdoorbench.provenance import environment; "
            "e = environment(torch.device('cpu')); print(e['cpu_capability'], bool(e['cpu']))")
    here = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert here.stdout.split() == [torch.backends.cpu.get_cpu_capability(), "True"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
        pinned = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                                check=True)
        assert pinned.stdout.split()[0] == "DEFAULT"


def test_the_record_names_torchvisions_full_version_without_importing_it(monkeypatch):
    # read from its version.py where no module has imported torchvision (its import pulls in
    # torch._dynamo); the same string, local build tag included, as torchvision.__version__
    import sys

    import torchvision

    from backdoorbench.provenance import environment, torchvision_version

    assert environment(torch.device("cpu"))["torchvision"] == torchvision.__version__
    monkeypatch.delitem(sys.modules, "torchvision")
    assert torchvision_version() == torchvision.__version__
    assert "torchvision" not in sys.modules
