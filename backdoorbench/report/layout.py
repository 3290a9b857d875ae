"""What a table shows and says: its key columns, the columns hidden because they carry nothing, the
sections (dataset x protocol), and the words every renderer prints (units, terms, footnote)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from backdoorbench.report.cells import COLUMNS, FEW_SEEDS, FLAG, Column
from backdoorbench.report.query import Row

UNITS = ("CA, ASR, RA, TPR, FPR, benign FP in %; ΔCA vs clean and ASR spread in points; PSNR in dB; SSIM, LPIPS, "
         "DER, F1 and AUROC in [0, 1]; cost in seconds and passes per training image; 'after' = after the defense.")
GLOSSARY = (
    ("CA", "clean accuracy: % of the clean test set classified correctly."),
    ("ASR", "attack success rate: % of the triggered test images whose label differs from the target that are "
            "classified as the target."),
    ("RA", "robust accuracy: % of those triggered images still classified as their true label."),
    ("after", "measured on the model the defense returns (CA after, ASR after)."),
    ("DER", "defense effectiveness rate, in [0, 1]: [max(0, ΔASR) − max(0, ΔCA) + 1] / 2 with Δ = before − after; "
            "0.5 = nothing changed, 1 = backdoor removed at no cost in CA."),
    ("reactivation", "ASR after reactivation: the defended model's ASR after the retuning attack of Min et al. "
                     "(NeurIPS 2024): a few fine-tuning steps on a small training subset holding a few poisoned samples "
                     "(eval.reactivation; budget in the record). Near the clean floor: the backdoor is gone; near the "
                     "attacked ASR: it was only hidden. – where the run did not measure it."),
    ("AUROC", "in [0, 1]: how well the defense's scores separate poisoned from clean (training samples for the data "
              "detectors, test inputs for STRIP); 0.5 = chance; – for a defense that does not detect."),
    ("TPR", "true positive rate, in %, at the detector's own threshold or flags: the share of the poisoned training "
            "samples it flags (dataset-level detectors) or of the triggered test inputs it rejects (input-level)."),
    ("FPR", "false positive rate, in %, at the same threshold: the share of the clean training samples flagged, or "
            "of the clean test inputs rejected."),
    ("F1", "in [0, 1], at the same threshold: 2 TP / (2 TP + FP + FN), the harmonic mean of precision and recall; "
           "– for an input detector's record made before F1 was recorded."),
    ("run", "on the detection board: full (the whole defense ran: retrained on the kept samples, or rejecting "
            "inputs; the defense table shows it too) or detection only (eval.detection_only=true: scored and "
            "flagged, nothing retrained; shown on the detection board only)."),
    ("cost", "cost s: the seconds of the defense's own work (not its scoring) on the machine that ran it; the "
             "defense stage's time in older records. Machines differ: passes/img compares across them."),
    ("passes/img", "images passed forward plus backward through the model during the defense, per training image "
                   "(a fine-tuning epoch on 5% clean data: 0.1); the record also holds FLOPs."),
    ("benign", "benign FP, in %: what the defense flags on a clean victim (attack none) with the same settings: "
               "Neural Cleanse 100 if it flags any class, else 0; STRIP the share of clean test inputs rejected; "
               "Spectral and AC the share of the clean training set removed; – where no such run was made "
               "(python -m backdoorbench --multirun experiment=benign)."),
    ("spread", "ASR spread, in points, on a defense's row at its default settings: max − min ASR after over the "
               "rows that differ from it only in the hyper-parameter its sensitivity sweep varies (e.g. Neural "
               "Cleanse's anomaly threshold; python -m backdoorbench --multirun experiment=sensitivity_<defense>), "
               "over the seeds the sweep ran (its n): large = fragile; – where no sweep was run."),
    ("ΔCA vs clean", "in percentage points: the row's CA minus that of the clean control (attack none) trained the "
                     "same way (dataset, model, trainer, computed precision; an older record's retired trainer.amp counts as "
                     "the precision it ran in); – where no such control was run."),
    ("PSNR", "peak signal-to-noise ratio of triggered vs clean test images, in dB (higher: less visible)."),
    ("SSIM", "structural similarity of triggered vs clean test images, in [0, 1] (1: identical)."),
    ("LPIPS", "learned perceptual distance (AlexNet) of triggered vs clean images (0: identical); – where its "
              "weights were absent offline."),
    ("model", "the victim's architecture."),
    ("attack", "the attack's name (none: the clean control); defense: the defense's."),
    ("mode", "the target rule: all2one(t) sends every triggered image to class t, all2all sends class y to y + 1 mod C."),
    ("training", "the victim's training budget: epochs, and 'no aug' when trained without crop/flip augmentation."),
    ("setting", "the attack's and the defense's own config values that differ from their protocol's defaults, in "
                "their own key names (budget= where the defense's budget was cut); – at the defaults."),
    ("n", "the number of seeds (one run each) in the row."),
    ("config", "the first 8 hex digits of the row's group_id (the hash of its resolved config without the seed); "
               "under it: the row's seeds, its records and the command that reruns them."),
    ("±", "mean ± sample standard deviation over the seeds; no ± for one seed or where the seeds agree to the "
          "digits shown; (n=k) where only k of the row's runs have the value."),
    (FLAG, f"fewer than {FEW_SEEDS} seeds: read the spread with care."),
    ("canonical", "one row per attack x mode (x defense), the benchmark's protocol setting: of the rows of one "
                  "attack and mode, the one with the most seeds, then the one at the attack's defaults, then at the "
                  "defense's defaults (of a sensitivity sweep), then the one with the fewest values off the "
                  "defaults, the newest on a tie. The others are sweeps and "
                  "earlier settings. A clean control is canonical when a canonical row is compared with it. "
                  "On the page, a blue bar marks the canonical rows."),
)
HIDEABLE = ("model", "mode", "training", "setting", "n")  # shown above a table when the same in all its rows
FOOTNOTE = (f"{FLAG} fewer than {FEW_SEEDS} seeds (n < {FEW_SEEDS}): read the spread with care. "
            "Mean ± sample std over seeds, no ± where the seeds agree to the digits shown; (n=k) where only k of "
            "the row's runs have the value; – where none has it (e.g. AUROC of a defense that does not detect); "
            "n/a where the defense's threat model excludes the attack (its records say why).")


@dataclass
class Layout:
    """What one table shows: its columns, less those that carry nothing."""

    keys: list[str]
    columns: list[Column]
    constant: dict[str, str]  # a key column with one value in every row: hidden, stated once
    empty: list[str]  # headers of the numeric columns no row has a value for: hidden


def key_columns(table: str) -> list[str]:
    """The text columns of a table, before its numbers."""
    keys = ["model", "attack", "mode", "training", "setting", "n"]
    return (["defense"] + keys) if table == "defenses" else keys


def key_values(row: Row) -> list[str]:
    """The row's values of `key_columns(row.table)`."""
    values = [row.model, row.attack, row.target_mode, row.training, row.label or "–", str(row.n)]
    return ([row.defense] + values) if row.table == "defenses" else values


def layout(rows: list[Row], table: str) -> Layout:
    """The columns a table of `rows` shows: a key column with one value throughout is stated once, an empty one hidden."""
    all_keys = key_columns(table)
    values = [dict(zip(all_keys, key_values(r))) for r in rows]
    constant = {k: values[0][k] for k in HIDEABLE if len(rows) > 1 and len({v[k] for v in values}) == 1}
    columns = COLUMNS[table]
    empty = [c.header for c in columns if all(r.cells.get(c.key) is None for r in rows)]
    return Layout(keys=[k for k in all_keys if k not in constant], columns=[c for c in columns if c.header not in empty],
                  constant=constant, empty=empty)


def layout_note(shape: Layout) -> str:
    """The sentence above a table naming what it hides."""
    parts = []
    if shape.constant:
        parts.append("In every row: " + ", ".join(f"{k} {v}" for k, v in shape.constant.items()) + ".")
    if shape.empty:
        parts.append(f"Not shown, no row has a value: {', '.join(shape.empty)}.")
    return " ".join(parts)


def by_section(rows: list[Row]) -> dict[str, list[Row]]:
    """Rows by dataset and training protocol, each pair its own section: rows of two protocols are
    never compared in one table (`mnist5k, quick protocol`, `cifar10, backdoorbench protocol`)."""
    out: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        out[f"{row.dataset}, {row.protocol} protocol"].append(row)
    return dict(sorted(out.items()))


def describe_filters(filters: dict[str, str | None]) -> str:
    """` Filters: dataset=mnist5k.` for the filters given; "" for none."""
    given = [f"{k}={v}" for k, v in filters.items() if v is not None]
    return f" Filters: {', '.join(given)}." if given else ""
