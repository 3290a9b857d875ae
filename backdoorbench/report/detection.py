"""The detection board: for each dataset, protocol and model, every detector against every attack at
the detector's own threshold or flags (TPR, FPR, F1 and the AUROC of its scores, mean ± std over the
seeds, n) beside what it flags on a clean model (benign FP), the dataset-level detectors (training
samples) and the input-level ones (test inputs) in tables of their own.

A detector's full runs (retrained on the kept samples, or rejecting inputs: the defense table's rows)
and its detection-only runs (`eval.detection_only=true`) share the detection, so both compete for its
cell: the canonical choice of the tables (`query.canonical_rank`: the most seeds, the defaults, the
fewest values off them), a full run before a detection-only one where only their age would decide."""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from dataclasses import dataclass

from backdoorbench.report.cells import DETECTION_COLUMNS, NOT_APPLICABLE, Cell, Column, NotApplicable, cell_text
from backdoorbench.report.derived import defense_key
from backdoorbench.report.query import CLEAN_ATTACK, Row, canonical_rank

TITLE = "Detection: each detector at its own threshold"
LEVELS = {"dataset": "Dataset-level detectors: training samples flagged",
          "input": "Input-level detectors: test inputs rejected"}
FULL, DETECTION_ONLY = "full", "detection only"
INTRO = ("Each cell: TPR, FPR (in %) and F1 at the detector's own threshold or flags, and the AUROC of its scores, "
         "mean ± std over the seeds (n); benign FP: what it flags on a clean model (attack none) with the same "
         "settings, – where no such run was made. A dataset-level detector flags training samples (its FPR is the "
         "share of the clean training samples flagged), an input-level one rejects test inputs (the share of clean "
         "test inputs rejected; TPR over the triggered test inputs). Each cell is the canonical row of its detector "
         "and attack among the full runs (retrained on the kept samples, or rejecting: the defense table's rows) "
         "and the detection-only runs (eval.detection_only=true), which share the detection: the most seeds, then "
         "the defaults, then the fewest values off them; where a full and a detection-only run tie on all of that, "
         f"the full run. run: {FULL} or {DETECTION_ONLY}. {NOT_APPLICABLE}: the detector's threat model excludes "
         "the attack.")
KEYS = ("detector", "attack", "mode", "training", "setting", "n", "run")
HIDEABLE = ("mode", "training", "setting", "n", "run")


@dataclass
class Entry:
    """One cell of the board: the canonical row of a detector and an attack, and its detection cells."""

    row: Row
    cells: dict[str, Cell | NotApplicable | None]

    @property
    def run(self) -> str:
        return DETECTION_ONLY if self.row.table == "detections" else FULL

    def keys(self) -> dict[str, str]:
        row = self.row
        return {"detector": row.defense, "attack": row.attack, "mode": row.target_mode, "training": row.training,
                "setting": row.label or "–", "n": str(row.n), "run": self.run}


@dataclass
class Board:
    """The entries of one detector level in one dataset, protocol and model."""

    heading: str
    level: str  # dataset or input
    entries: list[Entry]


def level_of(row: Row) -> str:
    """`input` for an inference-time detector, `dataset` for one that flags training samples."""
    return "input" if row.stage == "input" else "dataset"


def measured(row: Row) -> bool:
    """Whether a defense's row holds a detection (a TPR, FPR or AUROC of some seed)."""
    return any(isinstance(row.cells.get(key), Cell) for key in ("tpr", "fpr", "auroc"))


def place(row: Row) -> tuple[str, str, str, str]:
    """Where a detector's cells sit: dataset, protocol, model and the detector."""
    return row.dataset, row.protocol, row.model, row.defense


def _rank(row: Row) -> tuple:
    """`canonical_rank` with a full run before a detection-only one where only their age would decide."""
    rank = canonical_rank(row)
    return (*rank[:4], row.table == "defenses", *rank[4:])


def boards(rows: list[Row]) -> list[Board]:
    """The boards of `rows` (built by `derived.build_rows`), by dataset, protocol, model and level."""
    candidates = [r for r in rows if r.table in ("defenses", "detections")]
    detectors = {place(r) for r in candidates if r.attack != CLEAN_ATTACK and measured(r)}
    peers: dict[tuple, list[Row]] = defaultdict(list)
    for row in candidates:  # a detector's measured pairs, and those its threat model excludes
        if (row.attack != CLEAN_ATTACK and place(row) in detectors
                and (measured(row) or isinstance(row.cells.get("tpr"), NotApplicable))):
            peers[(*place(row), row.attack, row.target_mode)].append(row)
    controls: dict[tuple, list[Row]] = defaultdict(list)
    for row in candidates:
        if row.attack == CLEAN_ATTACK and isinstance(row.cells.get("benign_fp"), Cell):
            controls[defense_key(row)].append(row)
    found: dict[tuple[str, str, str, str], list[Entry]] = defaultdict(list)
    for members in peers.values():
        row = max(members, key=_rank)
        cells = {c.key: row.cells.get(c.key) for c in DETECTION_COLUMNS}
        if not isinstance(cells["tpr"], NotApplicable):
            control = max(controls.get(defense_key(row), []), default=None,
                          key=lambda r: (r.n, r.table == "defenses", r.created_at, r.group_id))
            cells["benign_fp"] = control.cells["benign_fp"] if control is not None else None
        found[(row.dataset, row.protocol, row.model, level_of(row))].append(Entry(row, cells))
    return [Board(f"{dataset}, {protocol} protocol, {model}", level,
                  sorted(entries, key=lambda e: (e.row.defense, e.row.attack, e.row.target_mode)))
            for (dataset, protocol, model, level), entries in sorted(found.items(), key=lambda item: (
                item[0][:3], list(LEVELS).index(item[0][3])))]


@dataclass
class Shape:
    """What one board table shows: its key columns (a key with one value throughout stated once), its
    numeric columns (those some entry has)."""

    keys: list[str]
    columns: list[Column]
    note: str


def shape_of(board: Board) -> Shape:
    values = [e.keys() for e in board.entries]
    constant = {k: values[0][k] for k in HIDEABLE if len(values) > 1 and len({v[k] for v in values}) == 1}
    empty = [c.header for c in DETECTION_COLUMNS if all(e.cells.get(c.key) is None for e in board.entries)]
    note = []
    if constant:
        note.append("In every row: " + ", ".join(f"{k} {v}" for k, v in constant.items()) + ".")
    if empty:
        note.append(f"Not shown, no row has a value: {', '.join(empty)}.")
    return Shape([k for k in KEYS if k not in constant], [c for c in DETECTION_COLUMNS if c.header not in empty],
                 " ".join(note))


def texts(entry: Entry, shape: Shape) -> list[str]:
    """An entry's cells as the board prints them, key columns first, its config last."""
    keys = entry.keys()
    return ([keys[k] for k in shape.keys] + [cell_text(entry.cells.get(c.key), c, entry.row.n) for c in shape.columns]
            + [f"`{entry.row.group_id[:8]}`"])


def to_markdown(rows: list[Row]) -> list[str]:
    """The boards as Markdown tables, under one heading; [] when no run detected anything."""
    found = boards(rows)
    if not found:
        return []
    lines = ["", f"## {TITLE}", "", INTRO]
    heading = None
    for board in found:
        if board.heading != heading:
            heading = board.heading
            lines += ["", f"### {heading}"]
        shape = shape_of(board)
        header = shape.keys + [c.header for c in shape.columns] + ["config"]
        lines += ["", f"#### {LEVELS[board.level]}", ""] + ([shape.note, ""] if shape.note else [])
        lines += ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(t.replace("|", "\\|") for t in texts(e, shape)) + " |" for e in board.entries]
    return lines


def to_csv(rows: list[Row]) -> str:
    """detection.csv: one line per board entry, every column (mean, std, n) whether or not it has it."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    keys = ["dataset", "protocol", "model", "level", "detector", "attack", "target_mode", "training", "setting", "n",
            "seeds", "run", "group_id"]
    writer.writerow(keys + [f"{c.key}_{part}" for c in DETECTION_COLUMNS for part in ("mean", "std", "n")])
    for board in boards(rows):
        for entry in board.entries:
            row = entry.row
            values = {"dataset": row.dataset, "protocol": row.protocol, "model": row.model, "level": board.level,
                      "detector": row.defense, "attack": row.attack, "target_mode": row.target_mode,
                      "training": row.training, "setting": row.label, "n": row.n,
                      "seeds": " ".join(map(str, row.seeds)), "run": entry.run, "group_id": row.group_id}
            out = [values[k] for k in keys]
            for c in DETECTION_COLUMNS:
                cell = entry.cells.get(c.key)
                if isinstance(cell, NotApplicable):
                    out += [NOT_APPLICABLE, "", 0]
                else:
                    out += [repr(cell.mean), repr(cell.std), cell.n] if cell else ["", "", 0]
            writer.writerow(out)
    return buffer.getvalue()
