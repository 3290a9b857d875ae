"""Run loggers, selected by `logger=<name>`; `logger=none` keeps only the record.

Every logger has the same five calls, made by the pipeline in this order:
`start(run_id=, group_id=, config=, results_dir=)` once, `log_epoch(row)` per training epoch,
`log_images(name, images)` for trigger examples, `log_summary(record)` with the finished record,
and `finish(record_path)` after the record is written.
"""

from __future__ import annotations

import csv
import io
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

from backdoorbench.errors import ConfigError
from backdoorbench.fileio import atomic_write_text

log = logging.getLogger(__name__)

class RunLogger(Protocol):
    def start(self, *, run_id: str, group_id: str | None, config: dict[str, Any], results_dir: Path) -> None: ...
    def log_epoch(self, row: dict[str, Any]) -> None: ...
    def log_images(self, name: str, images: Tensor) -> None: ...
    def log_summary(self, record: dict[str, Any]) -> None: ...
    def finish(self, record_path: Path) -> Path | None: ...


class CsvLogger:
    """Collects one row per training epoch (victim, defense) and writes them as CSV beside the record."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def start(self, *, run_id: str, group_id: str | None = None, config: dict[str, Any] | None = None,
              results_dir: Path | None = None) -> None:
        """Nothing to open: the CSV is written once, next to the record, when the run ends."""

    def log_epoch(self, row: dict[str, Any]) -> None:
        self.rows.append(dict(row))

    def log_images(self, name: str, images: Tensor) -> None:
        """A CSV holds no images; the record and the attack's config reproduce them."""

    def log_summary(self, record: dict[str, Any]) -> None:
        """The record itself is the summary."""

    def finish(self, record_path: Path) -> Path | None:
        if not self.rows:
            return None
        # Stages log different columns (a defense may add its own); the union keeps every value.
        columns = list(dict.fromkeys(key for row in self.rows for key in row))
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        return atomic_write_text(Path(record_path).with_suffix(".epochs.csv"), buffer.getvalue())


WANDB_MODES = ("offline", "online", "disabled")


def image_grid(images: Tensor, nrow: int = 8) -> Any:
    """(N, C, H, W) images, float in [0, 1] or uint8, as one (H', W', 3) uint8 numpy grid."""
    from torchvision.utils import make_grid

    images = images.detach().cpu()
    images = images.float() / 255 if not images.is_floating_point() else images.float().clamp(0, 1)
    if images.shape[1] == 1:
        images = images.expand(-1, 3, -1, -1)
    grid = make_grid(images, nrow=nrow, padding=2, pad_value=1.0)
    return (grid * 255).round().byte().permute(1, 2, 0).numpy()


def summary_numbers(record: dict[str, Any]) -> dict[str, float]:
    """The record's headline numbers under flat keys, the columns of wandb's run table: the test
    CA/ASR/RA of the attacked and the defended model, DER, detection rates, and the defense's own
    scalar results (e.g. neural_cleanse's anomaly index)."""
    def numbers(prefix: str, values: dict[str, Any] | None) -> dict[str, float]:
        return {f"{prefix}{key}": value for key, value in (values or {}).items()
                if isinstance(value, (int, float)) and not isinstance(value, bool)}

    metrics = record.get("metrics") or {}
    out = numbers("test/", metrics.get("attacked"))
    out.update(numbers("test/defended_", metrics.get("defended")))
    if isinstance(metrics.get("der"), (int, float)):
        out["test/der"] = metrics["der"]
    out.update(numbers("detection/", metrics.get("detection")))
    out.update(numbers("defense/", (record.get("defense") or {}).get("extras")))
    return out


class WandbLogger:
    """Weights & Biases: the resolved config, per-epoch metrics, trigger image grids, and the final
    record as the run summary (with its headline numbers also under flat keys, see summary_numbers);
    the per-epoch CSV beside the record is written as with logger=csv.

    Offline unless a mode is chosen (`logger.mode=online`, or WANDB_MODE in the environment), so a
    run never needs the network. Files go to `<dir>/wandb/offline-run-*` (`dir` defaults to
    results_dir, so `<results_dir>/wandb/offline-run-*`); upload later with `wandb sync <that folder>`.
    Runs that differ only in seed share a group.
    """

    def __init__(self, project: str = "backdoorbench", entity: str | None = None, mode: str | None = None,
                 tags: list[str] | tuple[str, ...] = (), dir: str | None = None) -> None:
        self.project, self.entity, self.tags, self.dir = project, entity, list(tags), dir
        self.mode = self._resolve_mode(mode)
        self.run: Any = None
        self._stages: set[str] = set()
        self.csv = CsvLogger()

    @staticmethod
    def _resolve_mode(mode: str | None) -> str:
        source, value = ("logger.mode", mode) if mode is not None else ("WANDB_MODE", os.environ.get("WANDB_MODE"))
        if value is None or value == "":
            return "offline"
        if value not in WANDB_MODES:
            raise ConfigError(f"{source}={value!r} is not a wandb mode; use one of {', '.join(WANDB_MODES)}")
        return value

    def start(self, *, run_id: str, group_id: str | None = None, config: dict[str, Any] | None = None,
              results_dir: Path | None = None) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ConfigError("logger=wandb needs the wandb package; pip install wandb, or use logger=csv") from exc
        # wandb writes into <dir>/wandb/ itself; the default dir is results_dir, so runs land in
        # <results_dir>/wandb/offline-run-*, not <results_dir>/wandb/wandb/.
        folder = Path(self.dir if self.dir is not None else results_dir or ".").expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(
                project=self.project, entity=self.entity, mode=self.mode, tags=self.tags, dir=str(folder),
                name=run_id, group=group_id, config=config, reinit="finish_previous",
            )
        except wandb.errors.Error as exc:  # e.g. online without an API key
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"logger=wandb could not start in mode {self.mode!r} ({message}); "
                              "use logger.mode=offline or run `wandb login`") from exc

    def _require_run(self) -> Any:
        if self.run is None:
            raise RuntimeError("WandbLogger.start() must be called before logging")
        return self.run

    def log_epoch(self, row: dict[str, Any]) -> None:
        run = self._require_run()
        self.csv.log_epoch(row)
        stage = str(row.get("stage", "train"))
        if stage not in self._stages:
            # Plot each training stage (victim, fine-tune, ...) against its own epoch counter.
            run.define_metric(f"{stage}/epoch")
            run.define_metric(f"{stage}/*", step_metric=f"{stage}/epoch")
            self._stages.add(stage)
        run.log({f"{stage}/{key}": value for key, value in row.items()
                 if key != "stage" and isinstance(value, (int, float)) and not isinstance(value, bool)})

    def log_images(self, name: str, images: Tensor, caption: str | None = None) -> None:
        import wandb

        self._require_run().log({f"images/{name}": wandb.Image(image_grid(images), caption=caption)})

    def log_summary(self, record: dict[str, Any]) -> None:
        # The config is already the run's config; the rest (metrics, stealth, timings, ...) is the summary.
        summary = {key: value for key, value in record.items() if key != "config"}
        self._require_run().summary.update({**summary, **summary_numbers(record)})

    def finish(self, record_path: Path) -> Path | None:
        run = self._require_run()
        self.csv.finish(record_path)
        run.summary["record_path"] = str(record_path)
        folder = Path(run.dir).parent  # <dir>/wandb/<offline-run-...>/files -> the run's folder
        run.finish()
        self.run = None
        if self.mode == "offline":
            log.info("wandb: offline run in %s; upload it with: wandb sync %s", folder, folder)
        return folder
