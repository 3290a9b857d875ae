"""The leaderboard as CSV: one file per table, every column (mean, std, n) whether or not a row has it."""

from __future__ import annotations

import csv
import io

from backdoorbench.report.cells import COLUMNS, NOT_APPLICABLE, NotApplicable
from backdoorbench.report.query import Row


def to_csv(rows: list[Row], table: str) -> str:
    """attacks.csv or defenses.csv."""
    columns = COLUMNS[table]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    keys = ["dataset", "protocol"] + (["defense"] if table == "defenses" else []) + [
        "model", "attack", "target_mode", "training", "setting", "n", "seeds", "group_id", "canonical"]
    writer.writerow(keys + [f"{c.key}_{part}" for c in columns for part in ("mean", "std", "n")])
    for row in (r for r in rows if r.table == table):
        values = {"dataset": row.dataset, "protocol": row.protocol, "defense": row.defense, "model": row.model,
                  "attack": row.attack, "target_mode": row.target_mode, "training": row.training, "setting": row.label,
                  "n": row.n, "seeds": " ".join(map(str, row.seeds)), "group_id": row.group_id,
                  "canonical": str(row.canonical).lower()}
        out = [values[k] for k in keys]
        for c in columns:
            cell = row.cells[c.key]
            if isinstance(cell, NotApplicable):
                out += [NOT_APPLICABLE, "", 0]
            else:
                out += [repr(cell.mean), repr(cell.std), cell.n] if cell else ["", "", 0]
        writer.writerow(out)
    return buffer.getvalue()
