"""`python -m backdoorbench [overrides]`: one run (or a Hydra --multirun sweep) of the pipeline."""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from backdoorbench.cli import discard_job_outputs, fail, preflight
from backdoorbench.errors import UserError


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def app(cfg: DictConfig) -> None:
    from backdoorbench.pipeline import run, summary_table

    try:
        record, path = run(cfg, overrides=list(HydraConfig.get().overrides.task))
    except UserError as exc:
        discard_job_outputs(cfg.results_dir)
        fail(exc)
    print(summary_table(record, path), flush=True)


def main() -> None:
    try:
        preflight(sys.argv[1:])
    except UserError as exc:
        fail(exc)
    app()


if __name__ == "__main__":
    main()
