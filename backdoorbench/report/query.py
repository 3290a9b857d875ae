"""The query layer over records: load, filter, group into rows (one per setting, the mean over its
seeds), label each row by its setting and pick the canonical rows. It reads the records only: what
it needs beyond the measurements (protocol, applicability, defaults, canonical peer group, the
setting) the run wrote into `record.report`, and older records get it from `records.upgrade`."""

from __future__ import annotations

import json
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backdoorbench.errors import ConfigError
from backdoorbench.records import RecordError, RunRecord, latest_repeats, load_record, record_table
from backdoorbench.run_keys import NON_RESULT_KEYS  # noqa: F401  (derived reads it here)
from backdoorbench.report.cells import COLUMNS, DETECTION_COLUMNS, Cell, NotApplicable, summarize

TARGET_MODES = ("all2one", "all2all")
FILTERS = ("dataset", "model", "target_mode")
CLEAN_ATTACK = "none"  # the clean control: the same training without a trigger (attack=none)


def victim_training(config: dict[str, Any]) -> dict[str, Any]:
    """The trainer keys a record's victim trained with: `trainer`, under the keys its `victim_trainer`
    sets (the attack's own schedule in its official code; null and [] leave the trainer's)."""
    victim = {key: value for key, value in (config.get("victim_trainer") or {}).items() if value not in (None, [])}
    return {**(config.get("trainer") or {}), **victim}


def facts(record: RunRecord) -> dict[str, Any]:
    """What the run wrote for reporting (`record.report`; an older record's comes from `records.upgrade`)."""
    if not isinstance(record.report, dict):
        raise RecordError(f"record {record.run_id} has no report; read records with records.load_record, "
                          "which upgrades an older one")
    return record.report


@dataclass
class Row:
    """The records of one setting (the same config but the seed) as one line of a table."""

    table: str  # "attacks", "defenses" or "detections" (detection-only runs: the detection board's only)
    dataset: str
    model: str
    attack: str
    target_mode: str  # e.g. all2one(0), all2all
    defense: str
    group_id: str
    seeds: list[int]
    config: dict[str, Any]
    cells: dict[str, Cell | NotApplicable | None] = field(default_factory=dict)
    label: str = ""  # the method's own values that differ from the protocol's defaults
    run_ids: list[str] = field(default_factory=list)
    record_paths: list[str] = field(default_factory=list)  # relative to results_dir, as written
    command: str = ""  # the command that reruns every seed of the row
    created_at: str = ""  # the newest record's
    canonical: bool = False
    precision: str = "fp32"  # what its forward passes computed in (computed_precision of its records)
    protocol: str = "quick"  # its training protocol (records from before protocols ran quick)
    facts: dict[str, Any] = field(default_factory=dict)  # its first record's `report`: every seed agrees
    stage: str = ""  # its defense's stage (pre_train, in_train, post_train, input); "" without a defense

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def training(self) -> str:
        """The victim's training budget, e.g. `10 ep` or `30 ep, no aug`: rows of one table may differ in it."""
        trainer = victim_training(self.config)
        text = f"{trainer.get('epochs', '?')} ep"
        text = text if trainer.get("augment", True) else text + ", no aug"
        # a protocol other than quick is named: the protocol tables group by this, never across protocols
        return text if self.protocol == "quick" else f"{self.protocol} protocol, {text}"


def load_records_with_paths(results_dir: str | Path) -> list[tuple[RunRecord, Path]]:
    """Every readable record under `<results_dir>/runs/` with its path; one warning per file that is
    not. A config run more than once (`<run_id>.<n>.json`) counts once: its latest repeat."""
    records = []
    for path in sorted((Path(results_dir) / "runs").rglob("*.json")):
        try:
            records.append((load_record(path), path))
        except RecordError as exc:
            warnings.warn(f"skipping record {exc}", stacklevel=2)
    return latest_repeats(records)


def load_records(results_dir: str | Path) -> list[RunRecord]:
    """Every readable record under `<results_dir>/runs/`; one warning per file that is not."""
    return [record for record, _ in load_records_with_paths(results_dir)]


def filter_records(records: list[RunRecord], *, dataset: str | None = None, model: str | None = None,
                   target_mode: str | None = None) -> list[RunRecord]:
    """The records matching every filter given; a filter no record matches is a ConfigError."""
    if target_mode is not None and target_mode not in TARGET_MODES:
        raise ConfigError(f"target_mode={target_mode!r} is unknown; choose one of: {', '.join(TARGET_MODES)}")
    wanted = {"dataset": dataset, "model": model, "target_mode": target_mode}
    getters = {
        "dataset": lambda r: r.dataset["name"],
        "model": lambda r: r.model["name"],
        "target_mode": lambda r: r.attack["target_mode"],
    }
    for key, value in wanted.items():
        if value is None:
            continue
        present = sorted({str(getters[key](r)) for r in records})
        kept = [r for r in records if getters[key](r) == value]
        if not kept:
            found = ", ".join(present) if present else "none"
            raise ConfigError(f"no record has {key}={value!r}; the records have {key}: {found}")
        records = kept
    return records


def short_value(value: Any) -> str:
    """A config value as a label prints it: numbers as %g, strings bare, anything else as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return f"{value:g}"
    return json.dumps(value, sort_keys=True)


def setting_label(setting: dict[str, dict[str, Any]], dropped: tuple[str, ...] = ()) -> str:
    """`report.setting` as a label, e.g. `poison_rate=0.05, threshold=0.1`: the method's own values
    that differ from its protocol's defaults, in its own key names (a key both the attack and the
    defense set keeps its `attack.`/`defense.` prefix); `dropped` keys left out; "" at the defaults."""
    items = [(part, key, value) for part in ("attack", "defense") for key, value in (setting.get(part) or {}).items()
             if key not in dropped]
    names = [key for _, key, _ in items]
    parts = [(f"{part}.{key}" if names.count(key) > 1 else key, value) for part, key, value in items]
    return ", ".join(f"{name}={short_value(value)}" for name, value in sorted(parts, key=lambda p: p[0]))


def setting_labels(settings: list[dict[str, dict[str, Any]]], dropped: tuple[str, ...] = ()) -> list[str]:
    """For the `report.setting`s of runs drawn side by side, a label each of only the values in which
    they differ (a key one lacks is at its default there, `–`); "" for each when they agree."""
    flat = [{(part, key): json.dumps(value, sort_keys=True) for part in ("attack", "defense")
             for key, value in (setting.get(part) or {}).items() if key not in dropped} for setting in settings]
    keys = sorted({k for f in flat for k in f}, key=lambda k: (k[1], k[0]))
    differing = [k for k in keys if len({f.get(k) for f in flat}) > 1]
    names = [key for _, key in differing]
    labels = []
    for f in flat:
        parts = [(f"{part}.{key}" if names.count(key) > 1 else key,
                  short_value(json.loads(f[(part, key)])) if (part, key) in f else "–") for part, key in differing]
        labels.append(", ".join(f"{name}={value}" for name, value in sorted(parts)))
    return labels


def row_label(row: Row, dropped: tuple[str, ...] = ()) -> str:
    """The row's setting label; a cut defense budget (`defense.budget`, e.g. cpu) is always named."""
    label = setting_label(row.facts.get("setting") or {}, dropped)
    budget = (row.config.get("defense") or {}).get("budget")
    if budget not in (None, "official") and "budget=" not in label and "budget" not in dropped:
        label = ", ".join(filter(None, [label, f"budget={budget}"]))
    return label


def mode_text(attack: dict[str, Any]) -> str:
    """The target rule as a table prints it: `all2one(0)` or `all2all`."""
    target = attack.get("target")
    return attack["target_mode"] + (f"({target})" if target is not None and attack["target_mode"] == "all2one" else "")


def rerun_command(records: list[RunRecord]) -> str:
    """The command that reruns every seed of one row: the first record's overrides, without the
    ones that don't change a result (results_dir, progress, ...), with the row's seeds."""
    dropped = set(NON_RESULT_KEYS) | {"seed"}
    kept = []
    for override in records[0].overrides or []:
        key = override.split("=", 1)[0].lstrip("+~")
        if key not in dropped and not any(key.startswith(d + ".") for d in dropped):
            kept.append(override)
    seeds = sorted({r.seed for r in records})
    sweep = ["--multirun"] if len(seeds) > 1 else []
    return " ".join(["python -m backdoorbench", *sweep, *kept, "seed=" + ",".join(map(str, seeds))])


def computed_precision(record: RunRecord) -> str:
    """The precision a record's forward passes ran in: `env.precision` where the record has it;
    before that key, the retired `trainer.amp` (bf16 autocast on CUDA only; the CPU never autocast)."""
    if record.env.get("precision"):
        return str(record.env["precision"])
    amp = (record.config.get("trainer") or {}).get("amp", False)
    return "bf16" if amp and str(record.env.get("device", "cpu")).startswith("cuda") else "fp32"


def exclusion(record: RunRecord) -> str | None:
    """Why the record's defense never met its attack (`report.not_applicable`), or None."""
    found = facts(record)
    return None if found["applicable"] else str(found.get("not_applicable") or "")


def group_rows(records: list[RunRecord], paths: list[str] | None = None) -> list[Row]:
    """One row per group of records that differ only in seed, in the attacks or the defenses table,
    with its cells summarized and its label set; `paths` (one per record, relative to results_dir)
    become the rows' links to their records."""
    groups: dict[str, list[tuple[RunRecord, str]]] = defaultdict(list)
    for record, path in zip(records, paths if paths is not None else [""] * len(records)):
        groups[record.group_id].append((record, path))
    rows = []
    for group_id, pairs in groups.items():
        pairs.sort(key=lambda p: (p[0].seed, p[0].run_id))
        members = [r for r, _ in pairs]
        first = members[0]
        table = record_table({"defense": first.defense, "config": first.config})
        row = Row(table=table, dataset=first.dataset["name"], model=first.model["name"], attack=first.attack["name"],
                  target_mode=mode_text(first.attack), defense=first.defense["name"], group_id=group_id,
                  seeds=[r.seed for r in members], config=first.config, run_ids=[r.run_id for r in members],
                  record_paths=[p for _, p in pairs], command=rerun_command(members),
                  created_at=max(r.created_at for r in members),
                  precision="/".join(sorted({computed_precision(r) for r in members})),
                  protocol=facts(first)["protocol"], facts=facts(first), stage=str(first.defense.get("stage", "")))
        excluded = exclusion(first)  # the same config: every seed agrees
        # a defense row carries the detection board's cells too (a full run's detection counts there)
        columns = COLUMNS[table] + (DETECTION_COLUMNS if table == "defenses" else ())
        row.cells = {c.key: NotApplicable(excluded) if excluded is not None
                     else summarize([c.read(r) for r in members]) for c in columns}
        row.label = row_label(row)
        rows.append(row)
    return rows


def canonical_rank(row: Row) -> tuple:
    """How a canonical row is chosen among its peers (the highest wins): the most seeds, then at the
    attack's defaults, then at the defense's defaults of the keys its sensitivity sweep varies, then the
    setting with the fewest values off the defaults, then the newest."""
    at_defense_defaults = row.table != "attacks" and bool(row.facts.get("defense_at_defaults"))
    # then the setting that departs from the defaults in the fewest of the methods' own values
    departures = sum(len(part) for part in (row.facts.get("setting") or {}).values())
    return (row.n, bool(row.facts.get("attack_at_defaults")), at_defense_defaults, -departures, row.created_at,
            row.group_id)


def mark_canonical(rows: list[Row], training_key) -> None:
    """Set `canonical` on one row per peer group (`report.canonical_key`: table, dataset, protocol,
    model, attack, mode, defense): among its settings, the one with the most seeds, then the one at
    the attack's defaults, then at the defense's defaults of the keys its sensitivity sweep varies, then
    the one with the fewest values off the defaults (`report.setting`), the newest of those on a tie (a protocol rerun at more seeds or a later setting supersedes); the
    other settings are sweeps and earlier protocols. A clean control (`attack=none` without a
    defense) is canonical when a canonical attack row is compared with it (the same `training_key`),
    so there can be one per training budget: of controls trained the same way under two record
    schemas, the one with more seeds, then the newest."""
    peers: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        row.canonical = False
        if not (row.table == "attacks" and row.attack == CLEAN_ATTACK):
            peers[row.facts["canonical_key"]].append(row)
    for members in peers.values():
        max(members, key=canonical_rank).canonical = True
    compared = {training_key(r) for r in rows if r.canonical and r.table == "attacks"}
    controls: dict[Any, list[Row]] = defaultdict(list)
    for row in rows:
        if row.table == "attacks" and row.attack == CLEAN_ATTACK and training_key(row) in compared:
            controls[training_key(row)].append(row)
    for members in controls.values():  # one per training: records of two schemas trained the same way
        max(members, key=lambda r: (r.n, r.created_at, r.group_id)).canonical = True


def sort_rows(rows: list[Row]) -> list[Row]:
    """The order every table lists rows in: dataset, protocol, table, defense, model, attack, mode, label."""
    return sorted(rows, key=lambda r: (r.dataset, r.protocol, r.table, r.defense, r.model, r.attack, r.target_mode,
                                       r.label, r.group_id))
