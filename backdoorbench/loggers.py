"""Per-epoch loggers, selected by `logger=<name>`; `logger=none` keeps only the record."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from backdoorbench.fileio import atomic_write_text


class CsvLogger:
    """Collects one row per training epoch (victim, defense) and writes them as CSV beside the record."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def log_epoch(self, row: dict[str, Any]) -> None:
        self.rows.append(dict(row))

    def finish(self, record_path: Path) -> Path | None:
        if not self.rows:
            return None
        columns = list(dict.fromkeys(key for row in self.rows for key in row))
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.rows)
        return atomic_write_text(record_path.with_suffix(".epochs.csv"), buffer.getvalue())
