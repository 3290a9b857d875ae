"""Cells one row takes from other rows (ΔCA vs its clean control, benign FP, the sensitivity spread,
measures a later run of the same setting made), and `build_rows`, which puts a table together."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from typing import Any

from backdoorbench.records import RunRecord
from backdoorbench.report.cells import Cell, NotApplicable
from backdoorbench.report.query import (CLEAN_ATTACK, NON_RESULT_KEYS, Row, group_rows, mark_canonical, victim_training,
                                        sort_rows)


def flatten(node: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as {dotted key: the value's JSON text}."""
    if isinstance(node, dict):
        out: dict[str, str] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: json.dumps(node, sort_keys=True)}


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


def training_key(row: Row) -> tuple[str, str, str]:
    """What a row's victim training shares with its clean control: dataset, model and every
    trainer key that changes the numbers. Records of an older schema compare with current ones:
    a key added since counts at the value that reproduces the old training, and `amp`/`precision`
    count as the precision the run computed in (so a CPU record with `amp: true` matches a CPU
    record with `precision: auto`, both fp32; a CUDA bf16 run matches neither)."""
    trained = {**row.config, "trainer": victim_training(row.config)}  # the victim-only keys over the trainer's
    trainer = {k: v for k, v in flatten(trained).items()
               if k.startswith("trainer.") and k not in NON_RESULT_KEYS and k not in _PRECISION_KEYS}
    trainer = {k: _number_text(v) for k, v in {**_TRAINER_KEYS_ADDED, **trainer}.items()}  # 0 == 0.0
    if trainer.get("trainer.rotation") == "0.0":  # no rotation: its probability plays no part
        trainer.pop("trainer.rotation_p", None)
    trainer["precision (computed)"] = row.precision
    return f"{row.dataset}, {row.protocol} protocol", row.model, json.dumps(trainer, sort_keys=True)


def clean_controls(rows: list[Row]) -> None:
    """Fill each attack row's `ca_vs_clean`: its mean CA minus the mean CA of the clean control
    (attack `none`, no defense) of the same dataset, model and trainer config (every trainer key
    but progress; `training_key` reads older record schemas), in points. The control rows of both
    target modes are pooled (a clean model has no mode): their seed-weighted mean, their std the
    larger of the rows' stds and the spread of their means; the cell's ± is the root-sum-square of
    the two stds. No control trained the same way: no value (run `attack=none` with that trainer)."""
    controls: dict[tuple[str, str, str], list[Cell]] = defaultdict(list)
    for row in rows:
        if row.table == "attacks" and row.attack == CLEAN_ATTACK and row.cells.get("ca") is not None:
            controls[training_key(row)].append(row.cells["ca"])
    for row in rows:
        if row.table != "attacks":
            continue
        row.cells["ca_vs_clean"] = None
        found, ca = controls.get(training_key(row)), row.cells.get("ca")
        if row.attack == CLEAN_ATTACK or not found or ca is None:
            continue
        n = sum(c.n for c in found)
        mean = sum(c.mean * c.n for c in found) / n
        spread = statistics.stdev([c.mean for c in found]) if len(found) > 1 else 0.0
        std = max(spread, max(c.std for c in found))
        row.cells["ca_vs_clean"] = Cell(ca.mean - mean, (ca.std**2 + std**2) ** 0.5, ca.n)


def defense_key(row: Row) -> tuple[str, str, str, str]:
    """A defense row's dataset, model, trainer and defense config: what its benign control shares."""
    return (*training_key(row), json.dumps(row.config.get("defense"), sort_keys=True))


def benign_controls(rows: list[Row]) -> None:
    """Fill each defense row's `benign_fp` from the row of the same defense (the same settings,
    dataset, model and trainer) run against a clean victim (`attack=none`, whose records hold
    `benign`): what the defense flags when there is nothing to find. No such run: no value."""
    controls = {defense_key(r): r.cells.get("benign_fp") for r in rows
                if r.table == "defenses" and r.attack == CLEAN_ATTACK and r.cells.get("benign_fp")}
    for row in rows:
        if row.table == "defenses" and not isinstance(row.cells.get("benign_fp"), NotApplicable):
            row.cells["benign_fp"] = controls.get(defense_key(row))


def sweep_key(row: Row, swept: tuple[str, ...]) -> tuple[str, ...]:
    """What the rows of one sensitivity sweep share: every config key that changes the ASR after the
    defense but the swept ones and the seed. The trainer compares as `training_key` does (a record of
    an older schema joins a sweep run since), and `eval.*` is left out: it only adds measurements
    after the defense (robust accuracy, reactivation, stealth), so the defense table's rows and the
    reactivation runs at the defaults join the sweep of the same setting."""
    flat = {k: _number_text(v) for k, v in flatten(row.config).items()
            if not k.startswith(("trainer.", "eval.")) and k not in NON_RESULT_KEYS + ("seed",) + swept}
    return (*training_key(row), json.dumps(flat, sort_keys=True))


def _frozen(value: Any) -> Any:
    """A config value as a dict key: lists as tuples (NAD's betas)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def setting_value(text: str) -> Any:
    """A flattened config value (JSON text) as a sweep's setting: numbers as floats, lists as tuples."""
    return _frozen(json.loads(_number_text(text)))


def row_setting(row: Row, keys: tuple[str, ...]) -> tuple:
    """The row's values of the dotted config `keys` as a sweep's setting (None where a key is absent)."""
    flat = flatten(row.config)
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


def sensitivity_keys(row: Row) -> tuple[str, ...]:
    """The dotted config keys the row's defense's sensitivity sweep varies (`report.sensitivity_keys`)."""
    return tuple(f"defense.{key}" for key in row.facts.get("sensitivity_keys") or ())


def sensitivity_spread(rows: list[Row]) -> None:
    """Fill `asr_spread` of a defense row at its defaults: max - min of the mean ASR after over the
    settings of its sensitivity sweep (the rows that differ from it only in the keys the sweep varies,
    `report.sensitivity_keys`), when there are at least two. How far the defense's result moves with
    its own knobs. A sweep compares like with like: of the seed sets its rows ran, the one that covers
    the most settings (then the most seeds), one row per setting; the cell's n is that set's size, so
    a 3-seed row whose sweep ran seed 0 only shows a one-seed spread, flagged."""
    sweeps: dict[tuple[str, ...], list[Row]] = defaultdict(list)
    for row in rows:
        if row.table != "defenses" or isinstance(row.cells.get("asr_spread"), NotApplicable):
            continue
        row.cells["asr_spread"] = None
        keys = sensitivity_keys(row)
        if keys and isinstance(row.cells.get("asr_after"), Cell):
            sweeps[(keys, *sweep_key(row, keys))].append(row)
    for (keys, *_), members in sweeps.items():
        seeds, chosen = sweep_settings(members, keys)
        if len(chosen) < 2:
            continue
        means = [r.cells["asr_after"].mean for r in chosen.values()]
        for row in members:
            if row.facts.get("defense_at_defaults"):
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
            by_setting[sweep_key(row, ())].append(row)
    for members in by_setting.values():
        for key in BORROWED_COLUMNS:
            measured = [m for m in members if isinstance(m.cells.get(key), Cell)]
            if not measured:
                continue
            source = max(measured, key=lambda m: (m.n, m.created_at))
            for row in members:
                if row.cells.get(key) is None:
                    row.cells[key] = source.cells[key]


def build_rows(records: list[RunRecord], paths: list[str] | None = None) -> list[Row]:
    """The rows of both tables from `records`: one per setting, its cells filled, the canonical rows
    marked, in table order; `paths` (one per record, relative to results_dir) link rows to records."""
    rows = group_rows(records, paths)
    clean_controls(rows)
    benign_controls(rows)
    sensitivity_spread(rows)
    borrowed_measures(rows)
    mark_canonical(rows, training_key)
    return sort_rows(rows)
