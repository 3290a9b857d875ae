"""The submitit launchers' sweep (hydra/launcher=submitit_slurm, submitit_local), reporting each
failed job in one line.

hydra-submitit-launcher 1.2 waits for the jobs in order and re-raises the first failure, so the
submitting process printed Hydra's traceback of submitit's `UncompletedJobError` (40 lines of the
job's error stream) and stopped waiting for the rest. `launch` below submits the same job array
with the same executor parameters, waits for every job, and prints one line per failed job: its
Slurm id, its overrides, its own `error:` line (or last line) and the path of its `.err` log;
then exits with code 2. `install()` puts it in place of the plugin's `launch`: Hydra finds plugins
only inside `hydra_plugins`, so a subclass of ours could not be named in the launcher's yaml.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def install() -> None:
    """Use `launch` for the submitit launchers of this process (the submitting one: jobs never launch)."""
    try:
        from hydra_plugins.hydra_submitit_launcher import submitit_launcher
    except ImportError:  # the plugin is a dependency; without it hydra/launcher=submitit_* fails on its own
        return
    submitit_launcher.BaseSubmititLauncher.launch = launch


def _executor(launcher: Any) -> Any:
    """submitit's executor for the launcher's cluster, with the launcher's parameters, as the plugin builds it."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    cluster = launcher._EXECUTOR
    init_keys = {"max_num_timeout"}  # the executor's constructor takes these, prefixed with its cluster
    params = launcher.params
    executor = submitit.AutoExecutor(cluster=cluster, folder=params["submitit_folder"],
                                     **{f"{cluster}_{key}": value for key, value in params.items() if key in init_keys})
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{key if key in shared else f"{cluster}_{key}": value
                                  for key, value in params.items() if key not in init_keys | {"submitit_folder"}})
    return executor


def launch(self: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Any]:
    """Submit one array job for the sweep, wait for all of it, and report failures one line each."""
    from hydra.core.singleton import Singleton
    from hydra.core.utils import filter_overrides

    assert self.config is not None and len(job_overrides) > 0
    executor = _executor(self)
    sweep_dir = Path(str(self.config.hydra.sweep.dir))
    log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if "mode" in self.config.hydra.sweep:
        os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
    job_params = []
    for offset, overrides in enumerate(job_overrides):
        idx = initial_job_idx + offset
        log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
        job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
    jobs = executor.map_array(self, *zip(*job_params))
    returns, failures = [], []
    for job, overrides in zip(jobs, sweep_settings(job_overrides)):
        try:
            [result] = job.results()
        except Exception as exc:  # submitit's UncompletedJobError / FailedJobError, or its unpickling
            failures.append(failure_line(job, overrides, str(exc)))
            continue
        if getattr(result, "status", None) is not None and result.status.name == "FAILED":
            # The task raised inside Hydra's run_job: its JobReturn holds the exception.
            exc = result._return_value
            failures.append(failure_line(job, overrides, f"{type(exc).__name__}: {exc}"))
            continue
        returns.append(result)
    if failures:
        for line in failures:
            print(line, file=sys.stderr, flush=True)
        if len(jobs) > 1:
            print(f"error: {len(failures)} of {len(jobs)} jobs failed; the other {len(jobs) - len(failures)} "
                  "finished", file=sys.stderr, flush=True)
        sys.exit(2)
    return returns


def sweep_settings(job_overrides: Sequence[Sequence[str]]) -> list[list[str]]:
    """Each job's overrides that tell it apart from the sweep's other jobs (those it shares with
    all of them, results_dir say, name no job); none for a sweep of one."""
    parsed = [dict(o.split("=", 1) if "=" in o else (o, "") for o in overrides) for overrides in job_overrides]
    varying = {key for job in parsed for key in job if any(other.get(key) != job[key] for other in parsed)}
    return [[o for o in overrides if o.split("=", 1)[0] in varying] for overrides in job_overrides]


def _job_error(stderr: Path, message: str) -> str:
    """The job's own one-line reason: its last `error: ...` line, else a one-line exception
    message, else the last line of its error stream (or of submitit's multi-line message)."""
    try:
        text = stderr.read_text(errors="replace")
    except OSError:
        text = ""
    errors = [line[len("error: "):] for line in text.splitlines() if line.startswith("error: ")]
    if errors:
        return errors[-1]
    if message.strip() and "\n" not in message.strip():  # an exception's own one-line message
        return message.strip()
    for source in (text, message):
        lines = [line.strip() for line in source.splitlines()
                 if line.strip() and not line.startswith(("-" * 10, "srun:", "submitit "))]
        if lines:
            return lines[-1]
    return "no error stream"


def failure_line(job: Any, overrides: Sequence[str], message: str) -> str:
    """`error: job 12_0 (lr=1e+30) failed: <its reason>; its log: <folder>/12_0_0_log.err`."""
    from hydra.core.utils import filter_overrides

    stderr = Path(job.paths.stderr)
    shown = " ".join(filter_overrides(list(overrides)))
    where = f" ({shown})" if shown else ""
    return f"error: job {job.job_id}{where} failed: {_job_error(stderr, message)}; its log: {stderr}"
