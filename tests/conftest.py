"""Shared fixtures: the real mnist5k data (loaded once), a composed config, and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))

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
