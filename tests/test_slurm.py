"""Sweeps through `hydra/launcher=submitit_slurm` on a real Slurm cluster (slurmctld, slurmd,
slurmdbd, MariaDB, munged on localhost; tests/slurm_cluster.py): every job writes its record; a job
over its time limit is signalled, requeued by submitit, resumes from its checkpoint and ends with
exactly the metrics of an uninterrupted run; a job failing with a user error says so in one line
and leaves the sweep's other jobs to finish. Marked `slurm`; skipped where Slurm can't start."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backdoorbench.records import load_record
from tests.conftest import ROOT
from tests.slurm_cluster import PARTITION

pytestmark = pytest.mark.slurm

# What a CPU-only test node offers; the rest of submitit_slurm.yaml is as a user gets it.
SLURM = ("--multirun", "hydra/launcher=submitit_slurm", f"hydra.launcher.partition={PARTITION}",
         "hydra.launcher.gpus_per_node=0", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2")
QUIET = ("eval.stealth_images=0", "logger=none", "trainer.progress=false")


def sweep(cluster, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m backdoorbench args...` with the cluster's $SLURM_CONF, as a user submits a sweep."""
    env = {**os.environ, **cluster.env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "backdoorbench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def records_under(results_dir: Path) -> list[Path]:
    return sorted((results_dir / "runs").rglob("*.json"))


def submitit_folder(results_dir: Path) -> Path:
    [folder] = (results_dir / "hydra" / "multirun").glob("*/*/.submitit")
    return folder


def job_logs(results_dir: Path, suffix: str) -> dict[str, str]:
    """{array task id (e.g. '3_1'): its log text} for `suffix` 'out' or 'err'."""
    return {path.parent.name: path.read_text()  # submitit's folder per job is named by its Slurm id
            for path in sorted(submitit_folder(results_dir).glob(f"*/*_log.{suffix}"))}


def job_states(cluster, jobs, *, runs: bool = False) -> dict[str, list[str]]:
    """{job id: its states in the accounting database}: the last run's, or with `runs` one per run
    (a requeue starts a new run of the same job id)."""
    args = ["--noheader", "--parsable2", "--allocations", "--format=JobID,State", f"--jobs={','.join(jobs)}"]
    out = cluster.slurm("sacct", *args, *(["--duplicates"] if runs else [])).stdout
    states: dict[str, list[str]] = {}
    for line in out.splitlines():
        job, state = line.split("|")
        states.setdefault(job, []).append(state.split()[0])
    return states


ENDED = {"COMPLETED", "FAILED", "TIMEOUT", "CANCELLED", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED"}


def final_states(cluster, jobs, timeout: float = 300) -> dict[str, list[str]]:
    """job_states once every job has ended: submitit returns when a job wrote its result, a
    moment before Slurm (and its accounting) sees the job end."""
    deadline = time.monotonic() + timeout
    while True:
        states = job_states(cluster, jobs)
        if all(runs[-1] in ENDED for runs in states.values()):
            return job_states(cluster, jobs, runs=True)
        assert time.monotonic() < deadline, f"jobs still not ended after {timeout} s: {states}"
        time.sleep(1)


def test_a_two_job_sweep_runs_as_slurm_jobs_and_each_writes_its_record(slurm_cluster, tmp_path):
    proc = sweep(slurm_cluster, *SLURM, "seed=0,1", "trainer.epochs=1", *QUIET, f"results_dir={tmp_path}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [load_record(path) for path in records_under(tmp_path)]  # load_record validates
    assert sorted(r.seed for r in records) == [0, 1]
    assert len({r.run_id for r in records}) == 2 and len({r.group_id for r in records}) == 1
    for record in records:
        assert record.config["trainer"]["epochs"] == 1 and record.timings_s["train"] > 0
        assert 0 <= record.metrics["attacked"]["clean_acc"] <= 1
    # They ran as Slurm jobs: one array of two tasks, both COMPLETED in the accounting database.
    logs = job_logs(tmp_path, "out")
    assert len(logs) == 2 and all("record: " in text for text in logs.values()), logs
    states = final_states(slurm_cluster, logs)
    assert all(states[task] == ["COMPLETED"] for task in logs), states


def test_a_job_failing_with_a_user_error_says_so_in_one_line_and_the_others_finish(slurm_cluster, tmp_path):
    # A learning rate that turns the loss NaN: an error only training can reveal (the preflight
    # passes it). It is the sweep's first job, the one the submitting process waits for first.
    proc = sweep(slurm_cluster, *SLURM, "trainer.optimizer.lr=1e30,0.01", "trainer.epochs=1",
                 "dataset.test_per_class=400", *QUIET, f"results_dir={tmp_path}")
    assert proc.returncode != 0
    failed_line = "error: victim: the training loss became nan at epoch 1; lower the learning rate"
    errs = job_logs(tmp_path, "err")
    states = final_states(slurm_cluster, errs)
    [failed] = [job for job, text in errs.items() if failed_line in text]
    assert states[failed] == ["FAILED"], states
    error_lines = [line for line in errs[failed].splitlines() if line.startswith("error:")]
    assert error_lines == [failed_line] and "Traceback" not in errs[failed], errs[failed]
    # The other job of the sweep ran to its end on its own and wrote its record.
    [other] = set(errs) - {failed}
    assert states[other] == ["COMPLETED"], states
    [record] = [load_record(path) for path in records_under(tmp_path)]
    assert record.config["trainer"]["optimizer"]["lr"] == 0.01
    print(f"\nsubmitting process, exit {proc.returncode}:\n{proc.stderr[-1500:]}")
