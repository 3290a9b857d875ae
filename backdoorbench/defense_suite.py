"""The end of `experiment=defense_suite`: the swept defense's row beside the built-ins' canonical rows.

A Hydra callback (conf/experiment/defense_suite.yaml) that runs in the process that launched the
sweep, once every job is done. It regenerates the leaderboard from the records under the sweep's
results_dir (`python -m backdoorbench.leaderboard`), then prints, for each dataset / protocol /
model the sweep ran, a defense x attack grid of CA / ASR after: the undefended victims first, then
the rows this sweep made, then each built-in defense's canonical row. Only records are read.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class PrintDefenseRows(Callback):
    """Prints the swept defense's leaderboard rows beside the built-ins when the multirun ends."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.time()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        results_dir = Path(str(config.results_dir)).expanduser()
        attacks = [a for a in str(config.hydra.sweeper.params.get("attack", "")).split(",") if a]
        groups = sweep_records(results_dir, getattr(self, "started", 0.0))
        if not groups:
            print("defense_suite: this sweep wrote no defended record (defense=none?)", flush=True)
            return
        board = subprocess.run([sys.executable, "-m", "backdoorbench.leaderboard", f"results_dir={results_dir}"],
                               check=False, capture_output=True, text=True)
        if board.returncode != 0:
            reason = (board.stderr.strip().splitlines() or ["no message"])[-1]
            print(f"defense_suite: the leaderboard failed ({reason}); run "
                  f"`python -m backdoorbench.leaderboard results_dir={results_dir}`", flush=True)
            return
        print(suite_table(results_dir / "leaderboard", groups, attacks), flush=True)


def sweep_records(results_dir: Path, since: float) -> dict[str, list[dict[str, Any]]]:
    """The defended records written under `results_dir` since `since` (a time), by group id."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for path in (results_dir / "runs").rglob("*.json"):
        try:
            if path.stat().st_mtime < since:
                continue
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and (record.get("defense") or {}).get("name") not in (None, "none"):
            groups.setdefault(str(record.get("group_id")), []).append(record)
    return groups


def _read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _cell(ca: str | float | None, asr: str | float | None, n: Any) -> str:
    """`CA / ASR` in %, with n; n/a where there is none (the threat model excludes the attack)."""
    if ca in (None, "") or asr in (None, ""):
        return "n/a"
    return f"{100 * float(ca):.1f} / {100 * float(asr):.1f} (n={n})"


def _before(records: list[dict[str, Any]]) -> str:
    """The attacked victims' CA / ASR, mean over the group's records (one per seed)."""
    attacked = [r["metrics"]["attacked"] for r in records]

    def mean(key: str) -> float:
        return sum(float(m[key]) for m in attacked) / len(attacked)

    return _cell(mean("clean_acc"), mean("asr"), len({r["seed"] for r in records}))


def suite_table(board: Path, groups: dict[str, list[dict[str, Any]]], attacks: list[str]) -> str:
    """The grid, as Markdown, from the leaderboard's defenses.csv in `board` and the sweep's records."""
    defenses = _read(board / "defenses.csv")
    ours = [r for r in defenses if r["group_id"] in groups]

    def key(row: dict[str, str]) -> tuple[str, ...]:
        return row["dataset"], row["protocol"], row["model"], row["target_mode"]

    lines = []
    for setting in sorted({key(r) for r in ours}):
        mine = [r for r in ours if key(r) == setting]
        columns = [a for a in attacks if any(r["attack"] == a for r in mine)] or sorted({r["attack"] for r in mine})
        table: dict[str, dict[str, str]] = {"(attacked, no defense)": {}}
        for row in mine:
            table["(attacked, no defense)"][row["attack"]] = _before(groups[row["group_id"]])
            label = row["defense"] + (f" ({row['setting']})" if row.get("setting") else "")
            table.setdefault(f"**{label}**", {})[row["attack"]] = _cell(row["ca_after_mean"], row["asr_after_mean"], row["n"])
        names = {r["defense"] for r in mine}
        for row in defenses:
            if key(row) == setting and row.get("canonical") == "true" and row["defense"] not in names \
                    and row["attack"] in columns:
                table.setdefault(row["defense"], {})[row["attack"]] = _cell(row["ca_after_mean"], row["asr_after_mean"],
                                                                            row["n"])
        dataset, protocol, model, mode = setting
        lines += [(f"\n{dataset} / {model}, protocol {protocol}, {mode}: CA / ASR after the defense, % "
                   "(mean over seeds, n); the built-ins' canonical rows"), "",
                  "| defense | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
        lines += [f"| {name} | " + " | ".join(cells.get(a, "") for a in columns) + " |" for name, cells in table.items()]
    lines.append(f"\nthe whole board: {board / 'leaderboard.md'}")
    return "\n".join(lines)
