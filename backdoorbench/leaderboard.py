"""`python -m backdoorbench.leaderboard [results_dir=DIR] [dataset=..] [model=..] [target_mode=..]`.

Tables built from records only, per dataset: (a) attacks x target mode of the runs without a
defense (CA, ASR, RA, PSNR, SSIM, LPIPS), (b) defenses x attacks (CA and ASR after the defense,
DER, detection AUROC where the defense detects, ASR after the reactivation stage where measured). Records that differ only in their seed (same
`group_id`) form one row: mean ± std over seeds, with n, flagged † when n < 3. Different settings
of the same attack are different rows, labelled by what differs between them (e.g. `epochs=1`).
One row per attack x mode (x defense) is *canonical*, the benchmark's protocol setting; the others
are sweeps and earlier settings (see `mark_canonical`).
Writes Markdown, CSV and a self-contained sortable HTML page to `<results_dir>/leaderboard/`.
A record that can't be read is skipped with one warning naming the file; it never stops the table.
"""

from __future__ import annotations

import csv
import html
import io
import json
import statistics
import sys
import urllib.parse
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backdoorbench.config import NON_RESULT_KEYS, protocol_name
from backdoorbench.errors import ConfigError, UserError
from backdoorbench.fileio import atomic_write_text, ensure_writable_dir
from backdoorbench.records import RecordError, RunRecord, latest_repeats, load_record

TARGET_MODES = ("all2one", "all2all")
FILTERS = ("dataset", "model", "target_mode")
FEW_SEEDS = 3  # rows with fewer seeds than this are flagged
FLAG = "†"
USAGE = "usage: python -m backdoorbench.leaderboard [results_dir=DIR] [dataset=NAME] [model=NAME] [target_mode=all2one|all2all]"
HELP = f"""{USAGE}

Builds the leaderboard from the run records under <results_dir>/runs: one row per setting (the
mean and spread over its seeds) in <results_dir>/leaderboard/leaderboard.md, leaderboard.html,
attacks.csv and defenses.csv. dataset=, model= and target_mode= keep only the matching records.
results_dir defaults to outputs, where runs write by default; the committed tables are
results_dir=results."""


@dataclass(frozen=True)
class Column:
    """One numeric column: its header, how to read it from a record, how to print a value."""

    header: str
    key: str  # the CSV name
    read: Callable[[RunRecord], float | None]
    fmt: Callable[[float], str]


def _pct(value: float) -> str:
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


def _auroc(record: RunRecord) -> float | None:
    detection = record.metrics.get("detection")
    return detection.get("auroc") if isinstance(detection, dict) else None


ATTACK_COLUMNS = (
    Column("CA %", "ca", _metric("attacked", "clean_acc"), _pct),
    Column("ASR %", "asr", _metric("attacked", "asr"), _pct),
    Column("RA %", "ra", _metric("attacked", "ra"), _pct),
    Column("PSNR dB", "psnr", _stealth("psnr"), lambda v: f"{v:.2f}"),
    Column("SSIM", "ssim", _stealth("ssim"), lambda v: f"{v:.4f}"),
    Column("LPIPS", "lpips", _stealth("lpips"), lambda v: f"{v:.4f}"),
    # Filled per row by build_rows, not read from one record: see clean_controls.
    Column("ΔCA vs clean", "ca_vs_clean", lambda r: None, lambda v: f"{100 * v:+.2f}"),
)
CLEAN_ATTACK = "none"  # the clean control: the same training without a trigger (attack=none)
def _cost_seconds(record: RunRecord) -> float | None:
    """The defense's counted seconds; a record made before the cost was counted: its defense stage's."""
    cost = record.defense_cost or {}
    return cost.get("seconds", record.timings_s.get("defense"))


def _cost(name: str) -> Callable[[RunRecord], float | None]:
    def read(record: RunRecord) -> float | None:
        return (record.defense_cost or {}).get(name)
    return read


def _benign(record: RunRecord) -> float | None:
    return (record.benign or {}).get("false_positive")


def _reactivated_asr(record: RunRecord) -> float | None:
    """ASR of the defended model after the last step of the retuning attack (eval.reactivation);
    None when the run did not measure it, or measured only the undefended victim."""
    block = getattr(record, "reactivation", None) or {}
    curve = block.get("defended")
    return curve["asr"][-1] if isinstance(curve, dict) and curve.get("asr") else None


DEFENSE_COLUMNS = (
    Column("CA after %", "ca_after", _metric("defended", "clean_acc"), _pct),
    Column("ASR after %", "asr_after", _metric("defended", "asr"), _pct),
    Column("DER", "der", lambda r: r.metrics.get("der"), lambda v: f"{v:.3f}"),
    Column("AUROC", "auroc", _auroc, lambda v: f"{v:.3f}"),
    Column("ASR after reactivation %", "asr_reactivated", _reactivated_asr, _pct),
    Column("cost s", "cost_s", _cost_seconds, lambda v: f"{v:.1f}"),
    # Two decimals, as the protocol tables: significant digits gave a mean and its std different decimals
    # ("13 ± 0.0425").
    Column("passes/img", "passes_per_img", _cost("passes_per_train_image"), lambda v: f"{v:.2f}"),
    # Filled per row by build_rows from other rows: see benign_controls and sensitivity_spread.
    Column("benign FP %", "benign_fp", _benign, _pct),
    Column("ASR spread", "asr_spread", lambda r: None, lambda v: f"{100 * v:.2f}"),
)


@dataclass
class Cell:
    mean: float
    std: float  # sample std over seeds; 0 for one value
    n: int


@dataclass(frozen=True)
class NotApplicable:
    """A defense cell whose defense's threat model excludes the attack (the record says
    `applicable: false`): shown as n/a, never as a value. Falsy, so it sorts and exports like a
    missing value where a renderer only asks whether there is a number."""

    reason: str

    def __bool__(self) -> bool:
        return False


NOT_APPLICABLE = "n/a"


def exclusion(record: RunRecord) -> str | None:
    """Why the record's defense never met its attack, or None. A record says so itself
    (`applicable: false`, since the pipeline asks the defense); a record made before it asked
    is judged the same way from the classes its config names, so an old run of, e.g., ABL
    against WaNet is shown n/a too, not as the success its numbers seem to say."""
    if record.defense.get("applicable") is False:
        return str(record.defense.get("not_applicable", ""))
    if "applicable" in record.defense or record.defense.get("name") in (None, "none"):
        return None
    from hydra.utils import get_class
    try:
        defense_cls = get_class(record.config["defense"]["_target_"])
        attack_cls = get_class(record.config["attack"]["_target_"])
    except Exception:  # a record of a class that no longer exists: nothing to judge it by
        return None
    reason = getattr(defense_cls, "excludes", lambda *_: None)(record.attack["name"], attack_cls)
    return None if reason is None else f"{reason} (judged from the record's config: the record predates the check)"


@dataclass
class Row:
    table: str  # "attacks" or "defenses"
    dataset: str
    model: str
    attack: str
    target_mode: str  # e.g. all2one(0), all2all
    defense: str
    group_id: str
    seeds: list[int]
    config: dict[str, Any]
    cells: dict[str, Cell | None] = field(default_factory=dict)
    label: str = ""  # what differs from the other rows of the same attack (and defense)
    run_ids: list[str] = field(default_factory=list)
    record_paths: list[str] = field(default_factory=list)  # relative to results_dir, as written
    command: str = ""  # the command that reruns every seed of the row
    created_at: str = ""  # the newest record's
    canonical: bool = False
    precision: str = "fp32"  # what its forward passes computed in (computed_precision of its records)
    protocol: str = "quick"  # its training protocol (config.protocol.name; records from before protocols ran quick)

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def training(self) -> str:
        """The victim's training budget, e.g. `10 ep` or `30 ep, no aug`: rows of one table may differ in it."""
        trainer = self.config.get("trainer") or {}
        text = f"{trainer.get('epochs', '?')} ep"
        text = text if trainer.get("augment", True) else text + ", no aug"
        # a protocol other than quick is named: the protocol tables group by this, never across protocols
        return text if self.protocol == "quick" else f"{self.protocol} protocol, {text}"


def load_records_with_paths(results_dir: Path) -> list[tuple[RunRecord, Path]]:
    """Every readable record under `<results_dir>/runs/` with its path; one warning per file that is
    not. A config run more than once (`<run_id>.<n>.json`) counts once: its latest repeat."""
    records = []
    for path in sorted((Path(results_dir) / "runs").rglob("*.json")):
        try:
            records.append((load_record(path), path))
        except RecordError as exc:
            warnings.warn(f"skipping record {exc}", stacklevel=2)
    return latest_repeats(records)


def load_records(results_dir: Path) -> list[RunRecord]:
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


def summarize(values: list[float]) -> Cell | None:
    values = [float(v) for v in values if v is not None]
    if not values:
        return None
    return Cell(statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0, len(values))


def _flatten(node: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(node, dict):
        out: dict[str, str] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: json.dumps(node, sort_keys=True)}


def _short_value(text: str) -> str:
    value = json.loads(text)
    if isinstance(value, str):
        return value.rsplit(".", 1)[-1] if value.count(".") >= 2 else value  # a _target_ path: its class
    if isinstance(value, float):
        return f"{value:g}"
    return text


OPTIONAL_STAGES = ("eval.reactivation",)  # evaluation stages a record may lack (older) or hold switched off


def _optional_stages_as_switches(flat: dict[str, str]) -> dict[str, str]:
    """A flattened config with each optional stage as one key, `<stage>`: `on` or `off`, and the
    stage's settings only where it ran: a record made before the stage existed and one with the
    stage off are the same setting, and a row whose stage ran is labelled e.g. `reactivation=on`
    (with the settings in which such rows differ)."""
    for stage in OPTIONAL_STAGES:
        ran = flat.get(f"{stage}.enabled") == "true"
        flat = {k: v for k, v in flat.items() if not (k == f"{stage}.enabled" or (not ran and k.startswith(stage + ".")))}
        flat[stage] = '"on"' if ran else '"off"'
    return flat


def setting_labels(configs: list[dict[str, Any]]) -> list[str]:
    """For configs of rows that share attack (and defense), a short label per config of the values
    in which they differ, e.g. `epochs=1, poison_rate=0.05`; "" when there is only one."""
    if len(configs) < 2:
        return [""] * len(configs)
    ignored = set(NON_RESULT_KEYS) | {"seed"}
    flat = [_optional_stages_as_switches({k: v for k, v in _flatten(c).items()
                                 if not any(k == i or k.startswith(i + ".") for i in ignored)}) for c in configs]
    keys = sorted(set().union(*flat))
    differing = [k for k in keys if len({f.get(k, "null") for f in flat}) > 1]
    # A key that some configs lack and the others hold at one value came or went with a schema
    # change (a record older than the key), not with a choice of setting: left out of the labels
    # unless two configs could not be told apart without it.
    chosen = [k for k in differing if len({f[k] for f in flat if k in f}) > 1]
    schema_only = [k for k in differing if k not in chosen]
    told_apart = len({tuple(f.get(k, "null") for k in chosen) for f in flat}) == len(
        {tuple(f.get(k, "null") for k in differing) for f in flat})
    differing = chosen
    names: dict[str, str] = {}
    for key in differing:
        parts = key.split(".")
        short = parts[-1] if parts[-1] != "_target_" else ".".join(parts[:-1])
        clash = [k for k in differing if k != key and k.split(".")[-1] == parts[-1]]
        names[key] = key if clash else short
    differing.sort(key=lambda k: names[k])
    labels = []
    for f in flat:
        parts = [f"{names[k]}={_short_value(f[k]) if k in f else '–'}" for k in differing]
        lacking = sorted({k.split(".")[-1] for k in schema_only if k not in f})
        if not told_apart and lacking:  # the configs differ only in keys one schema has and another lacks
            shown = ", ".join(lacking[:3]) + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
            parts.append(f"config without {shown} (another schema)")
        labels.append(", ".join(parts))
    return labels


def _mode(attack: dict[str, Any]) -> str:
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


def build_rows(records: list[RunRecord], paths: list[str] | None = None) -> list[Row]:
    """One row per group of records that differ only in seed, in the attacks or the defenses table;
    `paths` (one per record, relative to results_dir) become the rows' links to their records."""
    groups: dict[str, list[tuple[RunRecord, str]]] = defaultdict(list)
    for record, path in zip(records, paths if paths is not None else [""] * len(records)):
        groups[record.group_id].append((record, path))
    rows = []
    for group_id, pairs in groups.items():
        pairs.sort(key=lambda p: (p[0].seed, p[0].run_id))
        members = [r for r, _ in pairs]
        first = members[0]
        table = "attacks" if first.defense["name"] == "none" else "defenses"
        columns = ATTACK_COLUMNS if table == "attacks" else DEFENSE_COLUMNS
        row = Row(table=table, dataset=first.dataset["name"], model=first.model["name"], attack=first.attack["name"],
                  target_mode=_mode(first.attack), defense=first.defense["name"], group_id=group_id,
                  seeds=[r.seed for r in members], config=first.config, run_ids=[r.run_id for r in members],
                  record_paths=[p for _, p in pairs], command=rerun_command(members),
                  created_at=max(r.created_at for r in members),
                  precision="/".join(sorted({computed_precision(r) for r in members})),
                  protocol=record_protocol(first))
        excluded = exclusion(first)  # the same config: every seed agrees
        row.cells = {c.key: NotApplicable(excluded) if excluded is not None
                     else summarize([c.read(r) for r in members]) for c in columns}
        rows.append(row)
    peers: dict[tuple, list[Row]] = defaultdict(list)
    for row in rows:
        peers[(row.table, row.dataset, row.protocol, row.model, row.attack, row.target_mode, row.defense)].append(row)
    for members in peers.values():
        for row, label in zip(members, setting_labels([m.config for m in members])):
            row.label = label
            budget = (row.config.get("defense") or {}).get("budget")
            if budget not in (None, "official") and "budget=" not in label:  # a cut budget is always named
                row.label = ", ".join(filter(None, [label, f"budget={budget}"]))
    clean_controls(rows)
    benign_controls(rows)
    sensitivity_spread(rows)
    borrowed_measures(rows)
    mark_canonical(rows)
    rows.sort(key=lambda r: (r.dataset, r.protocol, r.table, r.defense, r.model, r.attack, r.target_mode, r.label,
                             r.group_id))
    return rows


def record_protocol(record: RunRecord) -> str:
    """The training protocol a record's run followed (conf/protocol/; config.protocol_name)."""
    return protocol_name(record.config)


def computed_precision(record: RunRecord) -> str:
    """The precision a record's forward passes ran in: `env.precision` where the record has it;
    before that key, the retired `trainer.amp` (bf16 autocast on CUDA only; the CPU never autocast)."""
    if record.env.get("precision"):
        return str(record.env["precision"])
    amp = (record.config.get("trainer") or {}).get("amp", False)
    return "bf16" if amp and str(record.env.get("device", "cpu")).startswith("cuda") else "fp32"


# Trainer keys added after records were made, with the value that reproduces the older training
# (a record without the key trained as if it had this value).
_TRAINER_KEYS_ADDED = {"trainer.rotation": "0", "trainer.rotation_p": "0.5", "trainer.schedule_period": "null",
                       "trainer.plateau_patience": "10"}
# Keys that only choose the precision: the key compares the precision computed instead.
_PRECISION_KEYS = ("trainer.amp", "trainer.precision")


def _number_text(text: str) -> str:
    """A flattened value with its numbers as floats (a config written 0 and one written 0.0 agree)."""
    value = json.loads(text)
    return repr(float(value)) if isinstance(value, (int, float)) and not isinstance(value, bool) else text


def _training_key(row: Row) -> tuple[str, str, str]:
    """What a row's victim training shares with its clean control: dataset, model and every
    trainer key that changes the numbers. Records of an older schema compare with current ones:
    a key added since counts at the value that reproduces the old training, and `amp`/`precision`
    count as the precision the run computed in (so a CPU record with `amp: true` matches a CPU
    record with `precision: auto`, both fp32; a CUDA bf16 run matches neither)."""
    trainer = {k: v for k, v in _flatten(row.config).items()
               if k.startswith("trainer.") and k not in NON_RESULT_KEYS and k not in _PRECISION_KEYS}
    trainer = {k: _number_text(v) for k, v in {**_TRAINER_KEYS_ADDED, **trainer}.items()}  # 0 == 0.0
    if trainer.get("trainer.rotation") == "0.0":  # no rotation: its probability plays no part
        trainer.pop("trainer.rotation_p", None)
    trainer["precision (computed)"] = row.precision
    return f"{row.dataset}, {row.protocol} protocol", row.model, json.dumps(trainer, sort_keys=True)


def clean_controls(rows: list[Row]) -> None:
    """Fill each attack row's `ca_vs_clean`: its mean CA minus the mean CA of the clean control
    (attack `none`, no defense) of the same dataset, model and trainer config (every trainer key
    but progress; `_training_key` reads older record schemas), in points. The control rows of both
    target modes are pooled (a clean model has no mode): their seed-weighted mean, their std the
    larger of the rows' stds and the spread of their means; the cell's ± is the root-sum-square of
    the two stds. No control trained the same
    way: no value (run `attack=none` with that trainer)."""
    controls: dict[tuple[str, str, str], list[Cell]] = defaultdict(list)
    for row in rows:
        if row.table == "attacks" and row.attack == CLEAN_ATTACK and row.cells.get("ca") is not None:
            controls[_training_key(row)].append(row.cells["ca"])
    for row in rows:
        if row.table != "attacks":
            continue
        row.cells["ca_vs_clean"] = None
        found, ca = controls.get(_training_key(row)), row.cells.get("ca")
        if row.attack == CLEAN_ATTACK or not found or ca is None:
            continue
        n = sum(c.n for c in found)
        mean = sum(c.mean * c.n for c in found) / n
        spread = statistics.stdev([c.mean for c in found]) if len(found) > 1 else 0.0
        std = max(spread, max(c.std for c in found))
        row.cells["ca_vs_clean"] = Cell(ca.mean - mean, (ca.std**2 + std**2) ** 0.5, ca.n)


def _defense_key(row: Row) -> tuple[str, str, str, str]:
    """A defense row's dataset, model, trainer and defense config: what its benign control shares."""
    return (*_training_key(row), json.dumps(row.config.get("defense"), sort_keys=True))


def benign_controls(rows: list[Row]) -> None:
    """Fill each defense row's `benign_fp` from the row of the same defense (the same settings,
    dataset, model and trainer) run against a clean victim (`attack=none`, whose records hold
    `benign`): what the defense flags when there is nothing to find. No such run: no value."""
    controls = {_defense_key(r): r.cells.get("benign_fp") for r in rows
                if r.table == "defenses" and r.attack == CLEAN_ATTACK and r.cells.get("benign_fp")}
    for row in rows:
        if row.table == "defenses" and not isinstance(row.cells.get("benign_fp"), NotApplicable):
            row.cells["benign_fp"] = controls.get(_defense_key(row))


def _sweep_key(row: Row, swept: tuple[str, ...]) -> tuple[str, ...]:
    """What the rows of one sensitivity sweep share: every config key that changes the ASR after the
    defense but the swept ones and the seed. The trainer compares as `_training_key` does (a record of
    an older schema joins a sweep run since), and `eval.*` is left out: it only adds measurements
    after the defense (robust accuracy, reactivation, stealth), so the defense table's rows and the
    reactivation runs at the defaults join the sweep of the same setting."""
    flat = {k: _number_text(v) for k, v in _flatten(row.config).items()
            if not k.startswith(("trainer.", "eval.")) and k not in NON_RESULT_KEYS + ("seed",) + swept}
    return (*_training_key(row), json.dumps(flat, sort_keys=True))


def _frozen(value: Any) -> Any:
    """A config value as a dict key: lists as tuples (NAD's betas)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def setting_value(text: str) -> Any:
    """A flattened config value (JSON text) as a sweep's setting: numbers as floats, lists as tuples."""
    return _frozen(json.loads(_number_text(text)))


def row_setting(row: Row, keys: tuple[str, ...]) -> tuple:
    """The row's values of the dotted config `keys` as a sweep's setting (None where a key is absent)."""
    flat = _flatten(row.config)
    return tuple(setting_value(flat[k]) if k in flat else None for k in keys)


def sweep_settings(members: list[Row], keys: tuple[str, ...]) -> tuple[tuple[int, ...], dict[tuple, Row]]:
    """Of rows that differ only in the dotted config `keys` (and the seeds), one row per setting,
    all of one seed set: the set that covers the most settings, then the most seeds; the newest row
    of a setting. Returns that seed set and {setting (the keys' values, numbers as floats): row}."""
    by_seeds: dict[tuple[int, ...], dict[tuple, Row]] = defaultdict(dict)
    for row in sorted(members, key=lambda r: r.created_at, reverse=True):
        by_seeds[tuple(sorted(row.seeds))].setdefault(row_setting(row, keys), row)
    if not by_seeds:
        return (), {}
    return max(by_seeds.items(), key=lambda item: (len(item[1]), len(item[0])))


def sensitivity_spread(rows: list[Row]) -> None:
    """Fill `asr_spread` of a defense row at its defaults: max - min of the mean ASR after over the
    settings of its sensitivity sweep (the rows that differ from it only in the keys the sweep varies,
    protocols.SENSITIVITY), when there are at least two. How far the defense's result moves with its
    own knobs. A sweep compares like with like: of the seed sets its rows ran, the one that covers the
    most settings (then the most seeds), one row per setting; the cell's n is that set's size, so a
    3-seed row whose sweep ran seed 0 only shows a one-seed spread, flagged."""
    from backdoorbench.protocols import SENSITIVITY, at_defaults

    sweeps: dict[tuple[str, ...], list[Row]] = defaultdict(list)
    for row in rows:
        if row.table != "defenses" or isinstance(row.cells.get("asr_spread"), NotApplicable):
            continue
        row.cells["asr_spread"] = None
        keys = tuple(f"defense.{key}" for key in SENSITIVITY.get(row.defense, ()))
        if keys and isinstance(row.cells.get("asr_after"), Cell):
            sweeps[_sweep_key(row, keys)].append(row)
    for members in sweeps.values():
        keys = tuple(f"defense.{key}" for key in SENSITIVITY[members[0].defense])
        seeds, chosen = sweep_settings(members, keys)
        if len(chosen) < 2:
            continue
        means = [r.cells["asr_after"].mean for r in chosen.values()]
        for row in members:
            if at_defaults(row.config.get("defense"), row.defense):
                row.cells["asr_spread"] = Cell(max(means) - min(means), 0.0, len(seeds))


# Columns a row of an older schema, or one run without the opt-in stage, lacks and can take from a
# row of the same setting that measured them: they depend on the defense and its setting, not on
# which run of that setting measured them.
BORROWED_COLUMNS = ("asr_reactivated", "passes_per_img")


def borrowed_measures(rows: list[Row]) -> None:
    """Fill a defense row's empty `BORROWED_COLUMNS` cells from the row of the same setting (the same
    key as a sensitivity sweep's, nothing swept: every config key but the seed and `eval.*`, the
    trainer across schemas) that has them, the one with the most seeds, then the newest: the defense
    table's 3-seed rows show the reactivation run's ASR and the cost of a later run, with that
    row's n, so `(n=1) †` says where it came from."""
    by_setting: dict[tuple[str, ...], list[Row]] = defaultdict(list)
    for row in rows:
        if row.table == "defenses":
            by_setting[_sweep_key(row, ())].append(row)
    for members in by_setting.values():
        for key in BORROWED_COLUMNS:
            measured = [m for m in members if isinstance(m.cells.get(key), Cell)]
            if not measured:
                continue
            source = max(measured, key=lambda m: (m.n, m.created_at))
            for row in members:
                if row.cells.get(key) is None:
                    row.cells[key] = source.cells[key]


def mark_canonical(rows: list[Row]) -> None:
    """Set `canonical` on one row per (table, dataset, model, attack, mode, defense): among its
    settings, the one with the most seeds, then the one at the defense's defaults of the keys its
    sensitivity sweep varies, the newest of those on a tie (a protocol rerun at more
    seeds or a later setting supersedes); the other settings are sweeps and earlier protocols.
    A clean control (`attack=none` without a defense) is canonical when a canonical attack row is
    compared with it (same dataset, model and trainer), so there can be one per training budget:
    of controls trained the same way under two record schemas, the one with more seeds, then the newest."""
    peers: dict[tuple, list[Row]] = defaultdict(list)
    for row in rows:
        row.canonical = False
        if not (row.table == "attacks" and row.attack == CLEAN_ATTACK):
            peers[(row.table, row.dataset, row.protocol, row.model, row.attack, row.target_mode, row.defense)].append(row)
    from backdoorbench.protocols import at_defaults, attack_at_defaults

    def at_default(row: Row) -> bool:  # of a sensitivity sweep's rows, the one at the defense's defaults
        return row.table == "defenses" and at_defaults(row.config.get("defense"), row.defense)

    def attack_at_default(row: Row) -> bool:  # of an attack's rows, those at its config's rates and options
        return attack_at_defaults(row.config.get("attack"), row.attack, row.config.get("protocol"))

    for members in peers.values():
        max(members, key=lambda r: (r.n, attack_at_default(r), at_default(r), r.created_at, r.group_id)).canonical = True
    compared = {_training_key(r) for r in rows if r.canonical and r.table == "attacks"}
    controls: dict[tuple[str, str, str], list[Row]] = defaultdict(list)
    for row in rows:
        if row.table == "attacks" and row.attack == CLEAN_ATTACK:
            training = _training_key(row)
            if training in compared:
                controls[training].append(row)
    for members in controls.values():  # one per training: records of two schemas trained the same way
        max(members, key=lambda r: (r.n, r.created_at, r.group_id)).canonical = True


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


def _key_columns(table: str) -> list[str]:
    keys = ["model", "attack", "mode", "training", "setting", "n"]
    return (["defense"] + keys) if table == "defenses" else keys


def _key_values(row: Row) -> list[str]:
    values = [row.model, row.attack, row.target_mode, row.training, row.label or "–", str(row.n)]
    return ([row.defense] + values) if row.table == "defenses" else values


TABLES = (("attacks", "Attacks (no defense)", ATTACK_COLUMNS), ("defenses", "Defenses", DEFENSE_COLUMNS))
UNITS = ("CA, ASR, RA, benign FP in %; ΔCA vs clean and ASR spread in points; PSNR in dB; SSIM, LPIPS, DER and "
         "AUROC in [0, 1]; cost in seconds and passes per training image; 'after' = after the defense.")
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
    ("setting", "the config values in which the row differs from the other rows of the same attack (and defense); "
                "– where it is the only one."),
    ("n", "the number of seeds (one run each) in the row."),
    ("config", "the first 8 hex digits of the row's group_id (the hash of its resolved config without the seed); "
               "under it: the row's seeds, its records and the command that reruns them."),
    ("±", "mean ± sample standard deviation over the seeds; no ± for one seed or where the seeds agree to the "
          "digits shown; (n=k) where only k of the row's runs have the value."),
    (FLAG, f"fewer than {FEW_SEEDS} seeds: read the spread with care."),
    ("canonical", "one row per attack x mode (x defense), the benchmark's protocol setting: of the rows of one "
                  "attack and mode, the one with the most seeds, then the one at the defense's defaults (of a "
                  "sensitivity sweep), the newest on a tie. The others are sweeps and "
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


def layout(rows: list[Row], table: str) -> Layout:
    all_keys = _key_columns(table)
    values = [dict(zip(all_keys, _key_values(r))) for r in rows]
    constant = {k: values[0][k] for k in HIDEABLE if len(rows) > 1 and len({v[k] for v in values}) == 1}
    columns = dict((t, c) for t, _, c in TABLES)[table]
    empty = [c.header for c in columns if all(r.cells.get(c.key) is None for r in rows)]
    return Layout(keys=[k for k in all_keys if k not in constant], columns=[c for c in columns if c.header not in empty],
                  constant=constant, empty=empty)


def _layout_note(shape: Layout) -> str:
    parts = []
    if shape.constant:
        parts.append("In every row: " + ", ".join(f"{k} {v}" for k, v in shape.constant.items()) + ".")
    if shape.empty:
        parts.append(f"Not shown, no row has a value: {', '.join(shape.empty)}.")
    return " ".join(parts)


def _by_dataset(rows: list[Row]) -> dict[str, list[Row]]:
    """Rows by dataset and training protocol, each pair its own section: rows of two protocols are
    never compared in one table (`mnist5k, quick protocol`, `cifar10, backdoorbench protocol`)."""
    out: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        out[f"{row.dataset}, {row.protocol} protocol"].append(row)
    return dict(sorted(out.items()))


def _describe_filters(filters: dict[str, str | None]) -> str:
    given = [f"{k}={v}" for k, v in filters.items() if v is not None]
    return f" Filters: {', '.join(given)}." if given else ""


def _cells(row: Row, shape: Layout) -> list[str]:
    keys = dict(zip(_key_columns(row.table), _key_values(row)))
    return ([keys[k] for k in shape.keys] + [cell_text(row.cells[c.key], c, row.n) for c in shape.columns]
            + [f"`{row.group_id[:8]}`"])


def to_markdown(rows: list[Row], filters: dict[str, str | None] | None = None) -> str:
    lines = [
        "# backdoorbench leaderboard",
        "",
        "Generated by `python -m backdoorbench.leaderboard` from the records under `runs/`; do not edit."
        + _describe_filters(filters or {}),
        UNITS + " Each table lists its canonical rows (one per attack x mode at the protocol's setting) apart "
        "from the other settings (sweeps, earlier protocols); the terms are defined at the end.",
    ]
    for dataset, members in _by_dataset(rows).items():
        lines += ["", f"## {dataset}"]
        for table, title, _ in TABLES:
            chosen = [r for r in members if r.table == table]
            if not chosen:
                continue
            shape = layout(chosen, table)
            header = shape.keys + [c.header for c in shape.columns] + ["config"]
            lines += ["", f"### {title}"]
            if _layout_note(shape):
                lines += ["", _layout_note(shape)]
            for canonical, part in ((True, "Canonical"), (False, "Other settings: sweeps and earlier protocols")):
                part_rows = [r for r in chosen if r.canonical == canonical]
                if not part_rows:
                    continue
                count = f"{len(part_rows)} row" + ("s" if len(part_rows) != 1 else "")
                lines += ["", f"#### {part} ({count})", "",
                          "| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
                for row in part_rows:
                    lines.append("| " + " | ".join(c.replace("|", "\\|") for c in _cells(row, shape)) + " |")
    lines += ["", FOOTNOTE, "", "## Terms", ""]
    lines += [f"- **{term}**: {text}" for term, text in GLOSSARY]
    lines.append("")
    return "\n".join(lines)


def to_csv(rows: list[Row], table: str) -> str:
    columns = dict((t, c) for t, _, c in TABLES)[table]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    keys = ["dataset", "protocol"] + (["defense"] if table == "defenses" else []) + ["model", "attack", "target_mode", "training",
                                                                        "setting", "n", "seeds", "group_id",
                                                                        "canonical"]
    writer.writerow(keys + [f"{c.key}_{part}" for c in columns for part in ("mean", "std", "n")])
    for row in (r for r in rows if r.table == table):
        values = {"dataset": row.dataset, "protocol": row.protocol, "defense": row.defense, "model": row.model, "attack": row.attack,
                  "target_mode": row.target_mode, "training": row.training, "setting": row.label, "n": row.n,
                  "seeds": " ".join(map(str, row.seeds)), "group_id": row.group_id,
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


# Each table sorts on its own header cells; a cell's data-sort is its key (the unrounded mean, or
# text), the header's data-type says how to compare; missing values go last either way. The radio
# buttons show the canonical rows, the other settings, or all. No library, no server, no network.
SORT_SCRIPT = """
(function () {
  function compare(x, y, numeric) {
    return numeric ? Number(x) - Number(y) : x.localeCompare(y, undefined, {numeric: true});
  }
  function sortTable(table, column, th) {
    var numeric = th.getAttribute("data-type") === "number";
    var ascending = th.getAttribute("aria-sort") !== "ascending";
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
    var body = table.tBodies[0];
    var rows = Array.prototype.map.call(body.rows, function (row, i) {
      return {row: row, key: row.cells[column].getAttribute("data-sort"), i: i};
    });
    rows.sort(function (a, b) {
      if (a.key === "" || b.key === "") return (a.key === "") - (b.key === "") || a.i - b.i;
      return (ascending ? 1 : -1) * compare(a.key, b.key, numeric) || a.i - b.i;
    });
    rows.forEach(function (r) { body.appendChild(r.row); });
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, column) {
      th.addEventListener("click", function () { sortTable(table, column, th); });
      th.addEventListener("keydown", function (event) {
        if (event.key === "Enter" || event.key === " ") { event.preventDefault(); sortTable(table, column, th); }
      });
    });
  });
  function show(view) { document.body.className = "view-" + view; }
  document.querySelectorAll("input[name=view]").forEach(function (input) {
    input.addEventListener("change", function () { show(input.value); });
    if (input.checked) show(input.value);
  });
})();
"""
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 100%; }
.scroll { overflow: auto; max-height: 80vh; max-width: 100%; margin-bottom: 0.5em; border: 1px solid #ccc; }
table { border-collapse: separate; border-spacing: 0; font-size: 14px; }
th, td { border-right: 1px solid #ddd; border-bottom: 1px solid #ddd; padding: 4px 8px; text-align: right;
         white-space: nowrap; vertical-align: top; background: #fff; }
th { background: #f2f2f2; cursor: pointer; user-select: none; position: sticky; top: 0; z-index: 2; }
th:first-child, td:first-child { position: sticky; left: 0; z-index: 1; }
th:first-child { z-index: 3; }
th[aria-sort=ascending]::after { content: " ▲"; } th[aria-sort=descending]::after { content: " ▼"; }
td.text, th.text { text-align: left; } code { font-size: 12px; }
td.setting { white-space: normal; min-width: 10em; max-width: 16em; }
body.view-canonical tr.other, body.view-other tr.canonical { display: none; }
tr.canonical td:first-child { box-shadow: inset 3px 0 0 #2a7ab0; }
details.runs summary { cursor: pointer; }
details.runs div { white-space: normal; min-width: 24em; max-width: 36em; text-align: left; font-size: 12px; padding-top: 4px; }
.note { color: #555; font-size: 13px; margin: 0.3em 0; }
dl.terms { display: grid; grid-template-columns: max-content 1fr; gap: 2px 12px; font-size: 13px; max-width: 70em; }
dl.terms dt { font-weight: 600; } dl.terms dd { margin: 0; }
"""


def _term(header: str) -> str:
    if "reactivation" in header:
        return "reactivation"
    if header.startswith("ΔCA"):
        return "ΔCA vs clean"
    return "spread" if header == "ASR spread" else header.split()[0]


def _runs_cell(row: Row) -> str:
    esc = html.escape
    links = []
    for run_id, path in zip(row.run_ids, row.record_paths or [""] * len(row.run_ids)):
        label = f"<code>{esc(run_id[:8])}</code>"
        links.append(f'<a href="../{esc(urllib.parse.quote(path))}">{label}</a>' if path else label)
    return (f'<details class="runs"><summary><code>{esc(row.group_id[:8])}</code></summary><div>'
            f"seeds {esc(', '.join(map(str, row.seeds)))}; records {', '.join(links)}<br>"
            f"<code>{esc(row.command)}</code></div></details>")


def to_html(rows: list[Row], filters: dict[str, str | None] | None = None, notes: str | None = None) -> str:
    """The page; `notes`, a link relative to the leaderboard folder, names where the commands are told."""
    esc = html.escape
    definitions = dict(GLOSSARY)
    canonical = sum(r.canonical for r in rows)
    where = f' The commands that made them: the results folder\'s <a href="{esc(notes)}">README.md</a>.' if notes else ""
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">', "<title>backdoorbench leaderboard</title>",
        f"<style>{STYLE}</style></head><body>", "<h1>backdoorbench leaderboard</h1>",
        "<p>Generated by <code>python -m backdoorbench.leaderboard</code> from the records under <code>runs/</code>; "
        f"do not edit.{esc(_describe_filters(filters or {}))}{where} Click a column header to sort; click a row's "
        "config for its seeds, records and command.</p>",
        f"<p>{esc(UNITS)}</p>",
        '<details><summary>What the columns mean</summary><dl class="terms">',
        *(f"<dt>{esc(term)}</dt><dd>{esc(text)}</dd>" for term, text in GLOSSARY),
        "</dl></details>",
        '<p class="view">Rows: <label><input type="radio" name="view" value="canonical" checked> canonical '
        f'({canonical}: one per attack x mode at the protocol\'s setting)</label> <label><input type="radio" '
        f'name="view" value="other"> other settings ({len(rows) - canonical}: sweeps, earlier protocols)</label> '
        '<label><input type="radio" name="view" value="all"> all</label></p>',
    ]
    for dataset, members in _by_dataset(rows).items():
        parts.append(f"<h2>{esc(dataset)}</h2>")
        for table, title, _ in TABLES:
            chosen = [r for r in members if r.table == table]
            if not chosen:
                continue
            shape = layout(chosen, table)
            n_canonical = sum(r.canonical for r in chosen)
            note = f"Canonical rows: {n_canonical}, others: {len(chosen) - n_canonical}. " + _layout_note(shape)
            parts += [f"<h3>{esc(title)}</h3>", f'<p class="note">{esc(note)}</p>',
                      f'<div class="scroll"><table class="sortable" data-table="{table}"><thead><tr>']
            for key in shape.keys:
                kind = "number" if key == "n" else "text"
                parts.append(f'<th class="text" data-type="{kind}" tabindex="0" '
                             f'title="{esc(definitions.get(key, definitions["attack"]))}">{esc(key)}</th>')
            for c in shape.columns:
                parts.append(f'<th data-type="number" tabindex="0" title="{esc(definitions[_term(c.header)])}">'
                             f"{esc(c.header)}</th>")
            parts.append(f'<th class="text" data-type="text" tabindex="0" title="{esc(definitions["config"])}">config</th>')
            parts.append("</tr></thead><tbody>")
            for row in chosen:
                parts.append(f'<tr class="{"canonical" if row.canonical else "other"}">')
                keys = dict(zip(_key_columns(table), _key_values(row)))
                for key in shape.keys:
                    sort = str(row.n) if key == "n" else ("" if keys[key] == "–" else keys[key])
                    kind = "text setting" if key == "setting" else "text"
                    parts.append(f'<td class="{kind}" data-sort="{esc(sort)}">{esc(keys[key])}</td>')
                for c in shape.columns:
                    cell = row.cells[c.key]
                    sort = repr(cell.mean) if cell else ""
                    parts.append(f'<td data-sort="{sort}">{esc(cell_text(cell, c, row.n))}</td>')
                parts.append(f'<td class="text" data-sort="{esc(row.group_id)}">{_runs_cell(row)}</td>')
                parts.append("</tr>")
            parts.append("</tbody></table></div>")
    if not rows:
        parts.append("<p>No records.</p>")
    parts += [f"<p>{esc(FOOTNOTE)}</p>", f"<script>{SORT_SCRIPT}</script>", "</body></html>", ""]
    return "\n".join(parts)


@dataclass
class LeaderboardFiles:
    markdown: Path
    html: Path
    csv: dict[str, Path]
    n_rows: int
    n_records: int
    protocols: Path | None = None  # the protocol tables of issue 18 (backdoorbench.protocol_tables)


def write_leaderboard(results_dir: str | Path, *, dataset: str | None = None, model: str | None = None,
                      target_mode: str | None = None) -> LeaderboardFiles:
    """Build the tables from the records under `<results_dir>/runs/` and write them to
    `<results_dir>/leaderboard/` (leaderboard.md, leaderboard.html, attacks.csv, defenses.csv, and
    protocols.md: the reactivation, clean-budget and sensitivity tables)."""
    results_dir = Path(results_dir).expanduser()
    if not (results_dir / "runs").is_dir():
        raise ConfigError(f"results_dir={str(results_dir)!r} has no runs/ folder; run `python -m backdoorbench "
                          f"results_dir={results_dir}` first, or pass the results_dir that holds the records")
    filters = {"dataset": dataset, "model": model, "target_mode": target_mode}
    loaded = load_records_with_paths(results_dir)
    records = filter_records([r for r, _ in loaded], **filters)
    if not records:
        raise ConfigError(f"no readable record under {results_dir / 'runs'}; run `python -m backdoorbench` first")
    where = {id(r): p.relative_to(results_dir).as_posix() for r, p in loaded}
    rows = build_rows(records, [where[id(r)] for r in records])
    out = ensure_writable_dir(results_dir / "leaderboard", "the leaderboard folder at results_dir")
    # results/README.md tells the commands of the committed rows; another results_dir may have its own
    notes = "../README.md" if (results_dir / "README.md").is_file() else None
    from backdoorbench.protocol_tables import protocol_markdown

    texts = {"leaderboard.md": to_markdown(rows, filters), "leaderboard.html": to_html(rows, filters, notes),
             "attacks.csv": to_csv(rows, "attacks"), "defenses.csv": to_csv(rows, "defenses"),
             "protocols.md": protocol_markdown(rows, records)}
    paths = {name: atomic_write_text(out / name, text) for name, text in texts.items()}
    return LeaderboardFiles(markdown=paths["leaderboard.md"], html=paths["leaderboard.html"],
                            csv={"attacks": paths["attacks.csv"], "defenses": paths["defenses.csv"]},
                            n_rows=len(rows), n_records=len(records), protocols=paths["protocols.md"])


def parse_args(args: list[str], options: dict[str, str | None], usage: str) -> dict[str, str | None]:
    """key=value arguments over `options` (the defaults); a ConfigError naming a bad one."""
    options = dict(options)
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in options:
            raise ConfigError(f"unknown argument {arg!r}; {usage}")
        if not value:
            raise ConfigError(f"{key}= needs a value; {usage}")
        options[key] = value
    return options


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "-h" in args or "--help" in args:
        print(HELP)
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            options = parse_args(args, {"results_dir": "outputs", **{k: None for k in FILTERS}}, USAGE)
            results_dir = options.pop("results_dir")
            files = write_leaderboard(results_dir, **options)
        except UserError as exc:
            files = exc
    for warning in caught:  # one line each, not Python's two-line warning format
        print(f"warning: {warning.message}", file=sys.stderr)
    if isinstance(files, UserError):
        print(f"error: {files}", file=sys.stderr)
        return 2
    print(f"{files.n_rows} rows from {files.n_records} records -> {files.markdown}, {files.html}, "
          f"{files.csv['attacks']}, {files.csv['defenses']}, {files.protocols}")
    return 0


if __name__ == "__main__":
    # run the package's module, not this __main__ copy: protocol_tables imports backdoorbench.leaderboard,
    # and its classes (NotApplicable, Cell) must be the ones the rows are built with
    from backdoorbench.leaderboard import main as package_main

    sys.exit(package_main())
