"""Sweeps through the launcher plugins: joblib (parallel local processes) and submitit_local, the
stand-in for submitit_slurm (same submitit machinery, no cluster). Each writes one valid record
per job; the Slurm settings compose and pass the preflight."""

from pathlib import Path

import pytest

from backdoorbench.records import load_record
from tests.conftest import run_cli

TINY = ("trainer.epochs=1", "eval.stealth_images=0", "logger=none")


def records_under(results_dir: Path) -> list[Path]:
    return sorted((results_dir / "runs").rglob("*.json"))


def assert_two_seeded_records(results_dir: Path) -> None:
    records = [load_record(path) for path in records_under(results_dir)]  # load_record validates
    assert sorted(r.seed for r in records) == [0, 1]
    assert len({r.run_id for r in records}) == 2 and len({r.group_id for r in records}) == 1
    for record in records:
        assert record.config["trainer"]["epochs"] == 1
        assert 0 <= record.metrics["attacked"]["clean_acc"] <= 1 and record.timings_s["train"] > 0


@pytest.mark.slow
def test_joblib_multirun_runs_two_jobs_in_worker_processes(tmp_path):
    proc = run_cli("--multirun", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "seed=0,1", *TINY,
                   f"results_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr  # Hydra logs to stdout
    assert "Joblib.Parallel(n_jobs=2" in output  # the plugin launched them, not the basic launcher
    assert "validated against ConfigStore schema" not in output  # our same-name yaml: warning filtered
    assert_two_seeded_records(tmp_path)


@pytest.mark.slow
def test_submitit_local_multirun_runs_two_submitit_jobs(tmp_path):
    proc = run_cli("--multirun", "hydra/launcher=submitit_local", "seed=0,1", *TINY, f"results_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_two_seeded_records(tmp_path)
    # Each job ran as its own submitit job (pickled, executed, result pickled back), as on Slurm.
    [sweep] = (tmp_path / "hydra" / "multirun").glob("*/*")
    results = sorted((sweep / ".submitit").glob("*/*_result.pkl"))
    assert len(results) == 2, sorted(p.name for p in (sweep / ".submitit").rglob("*"))
    logs = "".join(p.read_text() for p in (sweep / ".submitit").glob("*/*_log.out"))
    assert logs.count("record: ") == 2  # the summary table each job printed


@pytest.mark.slow
def test_a_failed_submitit_job_is_one_line_naming_it_and_its_log_and_the_sweep_waits_for_the_rest(tmp_path):
    proc = run_cli("--multirun", "hydra/launcher=submitit_local", "trainer.optimizer.lr=1e30,0.01", *TINY,
                   f"results_dir={tmp_path}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line, summary] = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    [sweep] = (tmp_path / "hydra" / "multirun").glob("*/*")
    [err] = [path for path in (sweep / ".submitit").glob("*/*_log.err") if "became nan" in path.read_text()]
    assert line == (f"error: job {err.parent.name} (trainer.optimizer.lr=1e+30) failed: victim: the training loss "
                    f"became nan at epoch 1; lower the learning rate; its log: {err}"), line
    assert summary == "error: 1 of 2 jobs failed; the other 1 finished"
    [record] = [load_record(path) for path in records_under(tmp_path)]  # the other job's
    assert record.config["trainer"]["optimizer"]["lr"] == 0.01


def test_a_failed_job_is_named_by_the_settings_that_set_it_apart_and_its_own_error_line(tmp_path):
    from types import SimpleNamespace

    from backdoorbench.launchers import failure_line, sweep_settings

    sweeps = [["attack=badnets", "seed=0", f"results_dir={tmp_path}"], ["attack=badnets", "seed=1", f"results_dir={tmp_path}"]]
    assert sweep_settings(sweeps) == [["seed=0"], ["seed=1"]]
    assert sweep_settings([sweeps[0]]) == [[]]
    err = tmp_path / "7_1_0_log.err"
    err.write_text("srun: error: node1: task 0: Exited with exit code 2\nsome log line\nerror: dataset.root is missing\n")
    job = SimpleNamespace(job_id="7_1", paths=SimpleNamespace(stderr=err))
    assert failure_line(job, ["seed=1"], "Job 7_1 has not produced any output") == \
        f"error: job 7_1 (seed=1) failed: dataset.root is missing; its log: {err}"
    err.write_text("Traceback (most recent call last):\n  ...\nRuntimeError: CUDA out of memory\n")
    submitit_says = "Job 7_1 (task: 0) with path x.pkl\nhas not produced any output (state: FAILED)"
    assert failure_line(job, [], submitit_says) == f"error: job 7_1 failed: RuntimeError: CUDA out of memory; its log: {err}"


@pytest.mark.parametrize("launcher", ["joblib", "submitit_local", "submitit_slurm"])
def test_launcher_configs_compose_with_our_settings(launcher):
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from backdoorbench.config import ignore_launcher_schema_match  # importing registers the schemas

    ignore_launcher_schema_match()  # pytest resets warning filters per test
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="backdoorbench.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()
    settings = cfg.hydra.launcher
    assert settings._target_.startswith("hydra_plugins.")
    if launcher == "submitit_slurm":
        assert settings.gpus_per_node == 1 and settings.timeout_min == 240 and settings.max_num_timeout == 3
        assert "partition" in settings and settings.cpus_per_task == 8
    if launcher == "joblib":
        assert settings.n_jobs == 2


def test_preflight_checks_launcher_choices_and_settings(tmp_path):
    from backdoorbench.cli import preflight
    from backdoorbench.errors import ConfigError

    preflight(["--multirun", "hydra/launcher=submitit_slurm", "hydra.launcher.partition=gpu",
               "hydra.launcher.timeout_min=30", f"results_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"unknown hydra/launcher 'slurmm'; choose one of: .*submitit_slurm"):
        preflight(["--multirun", "hydra/launcher=slurmm", f"results_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="hydra.launcher.timeout_min=soon"):
        preflight(["--multirun", "hydra/launcher=submitit_slurm", "hydra.launcher.timeout_min=soon",
                   f"results_dir={tmp_path}"])
    assert list(tmp_path.iterdir()) == []
