"""Shared fixtures: the real mnist5k data (loaded once), a composed config, and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))
# No test downloads anything: eval.lpips=auto would fetch LPIPS's AlexNet weights where the network
# answers, so every test, and every run it starts, asks port 0 of this machine, which refuses.
os.environ["BACKDOORBENCH_LPIPS_URL"] = "http://127.0.0.1:0/alexnet-owt-7be5be79.pth"

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def mnist5k():
    from backdoorbench.datasets.mnist5k import load_mnist5k

    return load_mnist5k()


@pytest.fixture
def compose_cfg():
    """compose_cfg(*overrides) -> the resolved DictConfig, as `python -m backdoorbench` would get it."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    import backdoorbench.config  # noqa: F401  (registers the schemas)

    def _compose(*overrides: str):
        GlobalHydra.instance().clear()
        with initialize_config_module(config_module="backdoorbench.conf", version_base="1.3"):
            return compose(config_name="config", overrides=list(overrides))

    yield _compose
    GlobalHydra.instance().clear()


def run_cli(*args: str, cwd: Path | None = None, module: str = "backdoorbench", timeout: int = 300):
    """Run `python -m <module> args...` in a subprocess; returns CompletedProcess (text)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd or ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# Real short runs on mnist5k whose records and artifacts the artifact and figure tests read:
# name -> overrides. No training epoch: the artifacts' shapes and their agreement with the
# record are what is checked, and an untrained victim shows them as well as a trained one.
# The fine-pruning runs hold 30 test images per class: their test-set pruning curve (12 points of CA,
# ASR and RA) is most of the fixture's time at the full 100. Neural Cleanse's epochs deal 200 images.
TINY_RUNS = {
    "fine_pruning": ["trainer.epochs=0", "dataset.test_per_class=30", "defense=fine_pruning", "defense.epochs=0",
                     "defense.max_prune_ratio=0.5"],
    # the same at twice the clean data: figure 7 (clean budget) needs two budgets
    "fine_pruning_clean_0.1": ["trainer.epochs=0", "dataset.test_per_class=30", "defense=fine_pruning",
                               "defense.epochs=0", "defense.max_prune_ratio=0.5", "defense.clean_fraction=0.1"],
    "strip": ["trainer.epochs=0", "defense=strip", "defense.num_superimpose=4"],
    "neural_cleanse": ["trainer.epochs=0", "defense=neural_cleanse", "defense.epochs=2", "defense.epoch_samples=200",
                       "defense.unlearn_epochs=0"],
    "rate_0.05": ["trainer.epochs=0", "attack.poison_rate=0.05"],
    "rate_0.1": ["trainer.epochs=0", "attack.poison_rate=0.1"],
    # the angular-margin paper's preset on mnist5k, its PGD shrunk: rows per eps, loss and source
    **{f"angular_margin_{lam}": ["paper=angular_margin/mnist", "dataset=mnist5k", "attack=none", "defense=angular_margin",
                                 f"defense.penalty_weight={lam}", "trainer.epochs=0", "eval.pgd.eps=[0.1,0.5]",
                                 "eval.pgd.steps=2", "eval.pgd.images=20"] for lam in (0, 100)},
}


@pytest.fixture(scope="session")
def tiny_results(tmp_path_factory):
    """A results folder made by real short runs (TINY_RUNS): {name: (record, record path)}, folder."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    import backdoorbench.config  # noqa: F401  (registers the schemas)
    from backdoorbench.pipeline import run

    results = tmp_path_factory.mktemp("tiny_results")
    runs = {}
    for name, overrides in TINY_RUNS.items():
        GlobalHydra.instance().clear()
        with initialize_config_module(config_module="backdoorbench.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=[*overrides, f"results_dir={results}", "logger=none",
                                                           "trainer.progress=false", "eval.stealth_images=16"])
        runs[name] = run(cfg)
    GlobalHydra.instance().clear()
    return runs, results


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real single-node Slurm cluster on localhost (tests/slurm_cluster.py), started once per
    session and stopped at its end. Skipped with the reason where it can't start (not root, the
    Debian packages absent); under CI=true it must start, so there the reason is a failure."""
    from tests.slurm_cluster import SlurmCluster, SlurmUnavailable

    cluster = SlurmCluster()
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"Slurm must run in CI (.ci/run installs it): {exc}", pytrace=False)
        pytest.skip(f"no Slurm cluster here: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()
