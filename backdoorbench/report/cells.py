"""A table's numbers: a cell (mean, std, n over seeds), the columns of the two tables and how a cell prints."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from backdoorbench.records import RunRecord

FEW_SEEDS = 3  # rows with fewer seeds than this are flagged
FLAG = "†"
NOT_APPLICABLE = "n/a"


@dataclass
class Cell:
    """The mean and sample std (0 for one value) of a column over the seeds that have it."""

    mean: float
    std: float
    n: int


@dataclass(frozen=True)
class NotApplicable:
    """A defense cell whose defense's threat model excludes the attack (the record's
    `report.applicable` is false): shown as n/a, never as a value. Falsy, so it sorts and exports
    like a missing value where a renderer only asks whether there is a number."""

    reason: str

    def __bool__(self) -> bool:
        return False


def summarize(values: list[float | None]) -> Cell | None:
    """The cell of the values present; None when there are none."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return None
    return Cell(statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values))


@dataclass(frozen=True)
class Column:
    """One numeric column: its header, how to read it from a record, how to print a value."""

    header: str
    key: str  # the CSV name
    read: Callable[[RunRecord], float | None]
    fmt: Callable[[float], str]


def pct(value: float) -> str:
    """A fraction as a percentage with two decimals."""
    return f"{100 * value:.2f}"


def _stealth(name: str) -> Callable[[RunRecord], float | None]:
    def read(record: RunRecord) -> float | None:
        entry = (record.stealth or {}).get(name)
        return entry.get("mean") if isinstance(entry, dict) else None
    return read


def _metric(stage: str, name: str) -> Callable[[RunRecord], float | None]:
    def read(record: RunRecord) -> float | None:
        block = record.metrics.get(stage)
        return block.get(name) if isinstance(block, dict) else None
    return read


def _detection(name: str) -> Callable[[RunRecord], float | None]:
    def read(record: RunRecord) -> float | None:
        detection = record.metrics.get("detection")
        return detection.get(name) if isinstance(detection, dict) else None
    return read


_auroc = _detection("auroc")


def detection_f1(record: RunRecord) -> float | None:
    """F1 at the detector's own flags (`metrics.detection.f1`). A record made before F1 was recorded:
    a dataset-level detector's from what it kept, exactly, as 2 TP / (flagged + poisoned) with
    TP = TPR x poisoned (the poisoned samples of the set it was given: the exported set's where it
    read one); an input detector's record lacks its count of triggered inputs: None."""
    detection = record.metrics.get("detection")
    if not isinstance(detection, dict):
        return None
    if "f1" in detection:
        return detection["f1"]
    flagged = detection.get("n_flagged")
    positives = (record.defense.get("exported_set") or {}).get("n_poisoned", record.attack.get("n_poisoned"))
    if flagged is None or positives is None:
        return None
    if positives == 0:  # a clean set: any flag is wrong (F1 0); none is 0 / 0
        return 0.0 if flagged else None
    tpr = detection.get("tpr")
    return None if tpr is None else 2 * round(tpr * positives) / (flagged + positives)


def cost_seconds(record: RunRecord) -> float | None:
    """The defense's counted seconds; a record made before the cost was counted: its defense stage's."""
    cost = record.defense_cost or {}
    return cost.get("seconds", record.timings_s.get("defense"))


def _cost(name: str) -> Callable[[RunRecord], float | None]:
    def read(record: RunRecord) -> float | None:
        return (record.defense_cost or {}).get(name)
    return read


def _benign(record: RunRecord) -> float | None:
    return (record.benign or {}).get("false_positive")


def reactivated_asr(record: RunRecord) -> float | None:
    """ASR of the defended model after the last step of the retuning attack (eval.reactivation);
    None when the run did not measure it, or measured only the undefended victim."""
    block = getattr(record, "reactivation", None) or {}
    curve = block.get("defended")
    return curve["asr"][-1] if isinstance(curve, dict) and curve.get("asr") else None


ATTACK_COLUMNS = (
    Column("CA %", "ca", _metric("attacked", "clean_acc"), pct),
    Column("ASR %", "asr", _metric("attacked", "asr"), pct),
    Column("RA %", "ra", _metric("attacked", "ra"), pct),
    Column("PSNR dB", "psnr", _stealth("psnr"), lambda v: f"{v:.2f}"),
    Column("SSIM", "ssim", _stealth("ssim"), lambda v: f"{v:.4f}"),
    Column("LPIPS", "lpips", _stealth("lpips"), lambda v: f"{v:.4f}"),
    # Filled per row by build_rows, not read from one record: see controls.clean_controls.
    Column("ΔCA vs clean", "ca_vs_clean", lambda r: None, lambda v: f"{100 * v:+.2f}"),
)
DEFENSE_COLUMNS = (
    Column("CA after %", "ca_after", _metric("defended", "clean_acc"), pct),
    Column("ASR after %", "asr_after", _metric("defended", "asr"), pct),
    Column("DER", "der", lambda r: r.metrics.get("der"), lambda v: f"{v:.3f}"),
    Column("AUROC", "auroc", _auroc, lambda v: f"{v:.3f}"),
    Column("ASR after reactivation %", "asr_reactivated", reactivated_asr, pct),
    Column("cost s", "cost_s", cost_seconds, lambda v: f"{v:.1f}"),
    # Two decimals, as the protocol tables: significant digits gave a mean and its std different decimals
    # ("13 ± 0.0425").
    Column("passes/img", "passes_per_img", _cost("passes_per_train_image"), lambda v: f"{v:.2f}"),
    # Filled per row by build_rows from other rows: see controls.benign_controls and sensitivity_spread.
    Column("benign FP %", "benign_fp", _benign, pct),
    Column("ASR spread", "asr_spread", lambda r: None, lambda v: f"{100 * v:.2f}"),
)
# The detection board's cells (report/detection.py), read from every detecting run, full or
# detection-only: at the detector's own threshold or flags; benign FP filled from the clean-model row.
DETECTION_COLUMNS = (
    Column("TPR %", "tpr", _detection("tpr"), pct),
    Column("FPR %", "fpr", _detection("fpr"), pct),
    Column("F1", "f1", detection_f1, lambda v: f"{v:.3f}"),
    Column("AUROC", "auroc", _auroc, lambda v: f"{v:.3f}"),
    Column("benign FP %", "benign_fp", _benign, pct),
)
TABLES = (("attacks", "Attacks (no defense)", ATTACK_COLUMNS), ("defenses", "Defenses", DEFENSE_COLUMNS))
# The columns of each table's rows; a detection-only run ("detections") is a row of the detection board only.
COLUMNS = {**{table: columns for table, _, columns in TABLES}, "detections": DETECTION_COLUMNS}


def cell_text(cell: Cell | NotApplicable | None, column: Column, row_n: int) -> str:
    """`mean ± std` with the column's digits; no ± for one value, or where the seeds agree to the
    digits shown (a `± 0.00` says nothing the n column does not)."""
    if isinstance(cell, NotApplicable):
        return NOT_APPLICABLE
    if cell is None:
        return "–"
    spread = column.fmt(cell.std).lstrip("+")
    text = column.fmt(cell.mean) if cell.n == 1 or float(spread) == 0 else f"{column.fmt(cell.mean)} ± {spread}"
    if cell.n != row_n:
        text += f" (n={cell.n})"
    return text + (f" {FLAG}" if cell.n < FEW_SEEDS else "")
