"""`python -m backdoorbench [overrides]`: one run (or a Hydra --multirun sweep) of the pipeline."""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from backdoorbench import distributed, launchers, progress
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
    if path is not None:  # rank 0 of a torchrun, or the only process
        print(summary_table(record, path), flush=True)


def main() -> None:
    try:
        preflight(sys.argv[1:])
    except UserError as exc:
        fail(exc)
    progress.warnings_as_log_lines()
    launchers.install()  # a sweep's failed Slurm jobs: one line each, not Hydra's traceback
    if distributed.rank() > 0:
        # Other ranks of a torchrun write nothing: Hydra's run folder goes to a temp folder that is
        # removed at exit, without its .hydra/ files or a log file (their log goes to stdout).
        scratch = tempfile.mkdtemp(prefix="backdoorbench-rank")
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        sys.argv += [f"hydra.run.dir={scratch}", "hydra.output_subdir=null", "hydra/job_logging=stdout"]
    app()


if __name__ == "__main__":
    main()
