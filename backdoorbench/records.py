"""The run record: one JSON per run, validated on load, written atomically.

Numbers are JSON numbers (never strings); metrics are fractions in [0, 1]. Records are written
in SCHEMA_VERSION; `load_record` reads every version in READABLE_VERSIONS (an older record gets
null for the fields its version lacks) and refuses any other, so the leaderboard never mixes
formats it does not know.

Versions:
- 1: the run (config, seed, metrics, stealth, timings, env); `victim`, `artifacts`, `repeat`,
  `reactivation`, `defense_cost` and `benign` were added within it, so version-1 records may lack them.
- 2: the defense protocols (issue 18) are part of the schema: every record carries `reactivation`,
  `defense_cost` and `benign` (null where the run had none), and `victim`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from backdoorbench.fileio import atomic_write_text, write_new_bytes

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
METRIC_KEYS = ("clean_acc", "asr", "ra")
# Fields a record of each version may lack (added within version 1; the older records lack them).
OPTIONAL_FIELDS = {1: {"victim", "artifacts", "repeat", "defense_cost", "benign", "reactivation"},
                   2: {"artifacts", "repeat"}}
# The files of one run beside each other: the record, its artifacts, its epoch log.
RUN_FILE_SUFFIXES = (".json", ".npz", ".epochs.csv")


class RecordError(ValueError):
    """A record file that is unreadable, of another schema version, or malformed."""


@dataclass
class RunRecord:
    run_id: str
    group_id: str  # same for runs that differ only in seed: the leaderboard's row key
    created_at: str
    dataset: dict[str, Any]
    model: dict[str, Any]
    attack: dict[str, Any]
    defense: dict[str, Any]
    seed: int
    metrics: dict[str, Any]
    stealth: dict[str, Any] | None
    timings_s: dict[str, float]
    env: dict[str, Any]
    config: dict[str, Any]
    overrides: list[str] = field(default_factory=list)
    # where the attacked model came from: {"cache": "hit"|"miss"|"off", "key": ..., "train_s": ...}
    victim: dict[str, Any] | None = None
    # File name (beside the record) of the run's .npz artifacts for figures; absent in older records.
    artifacts: str | None = None
    # The same config run again (another machine, another thread count) keeps its own record beside
    # the first: repeat n >= 2 is `<run_id>.<n>.json`. The leaderboard counts the highest repeat.
    repeat: int = 1
    # Post-purification robustness (eval.reactivation, backdoorbench.metrics.reactivation): the
    # retuning curves {"steps", "asr", "ca", "probe"} of the "defended" (or "attacked") model and the
    # budget; null when the stage was off. Absent in older records.
    reactivation: dict[str, Any] | None = None
    # The defense's compute (metrics/cost.py): seconds, forward/backward images, passes per
    # training image, FLOPs; null without a defense and in older records.
    defense_cost: dict[str, Any] | None = None
    # On a clean victim (attack=none), what a detector flags anyway (defenses/runner.py
    # benign_false_positives): {measure, false_positive in [0, 1], ca_drop, ...}; else null.
    benign: dict[str, Any] | None = None
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {"schema_version": data.pop("schema_version"), **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunRecord":
        validate_record(data)
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def _check_fraction(where: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= 1:
        raise RecordError(f"{where} must be a number in [0, 1], got {value!r}")


def _check_metrics(where: str, block: Any) -> None:
    if not isinstance(block, dict):
        raise RecordError(f"{where} must be an object with {', '.join(METRIC_KEYS)}")
    for key in METRIC_KEYS:
        if key not in block:
            raise RecordError(f"{where}.{key} is missing")
        _check_fraction(f"{where}.{key}", block[key])


def validate_record(data: Any) -> None:
    """Raise RecordError naming the first field that breaks the schema."""
    if not isinstance(data, dict):
        raise RecordError("a record must be a JSON object")
    version = data.get("schema_version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        readable = ", ".join(str(v) for v in READABLE_VERSIONS)
        raise RecordError(f"schema_version is {version!r}; this backdoorbench reads versions {readable}")
    required = {f.name for f in fields(RunRecord)} - OPTIONAL_FIELDS[version]
    missing = sorted(required - data.keys())
    if missing:
        raise RecordError(f"missing fields: {', '.join(missing)}")
    for key in ("run_id", "group_id", "created_at"):
        if not isinstance(data[key], str) or not data[key]:
            raise RecordError(f"{key} must be a non-empty string")
    for key in ("dataset", "model", "attack", "defense", "metrics", "timings_s", "env", "config"):
        if not isinstance(data[key], dict):
            raise RecordError(f"{key} must be an object")
    if isinstance(data["seed"], bool) or not isinstance(data["seed"], int):
        raise RecordError(f"seed must be an integer, got {data['seed']!r}")
    for key in ("name", "target_mode", "poison_rate", "n_poisoned", "poisoned_indices_sha256"):
        if key not in data["attack"]:
            raise RecordError(f"attack.{key} is missing")
    if not isinstance(data["defense"].get("name"), str):
        raise RecordError("defense.name must be a string")
    metrics = data["metrics"]
    _check_metrics("metrics.attacked", metrics.get("attacked"))
    defended, der = metrics.get("defended"), metrics.get("der")
    if (defended is None) != (der is None):
        raise RecordError("metrics.defended and metrics.der must both be present or both null")
    if defended is not None:
        _check_metrics("metrics.defended", defended)
        _check_fraction("metrics.der", der)
    if data["stealth"] is not None and not isinstance(data["stealth"], dict):
        raise RecordError("stealth must be an object or null")
    for key, value in data["timings_s"].items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise RecordError(f"timings_s.{key} must be a number >= 0, got {value!r}")
    repeat = data.get("repeat", 1)
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise RecordError(f"repeat must be an integer >= 1, got {repeat!r}")
    _check_reactivation(data.get("reactivation"))
    cost = data.get("defense_cost")
    if cost is not None:
        if not isinstance(cost, dict):
            raise RecordError("defense_cost must be an object or null")
        for key, value in cost.items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value < 0):
                raise RecordError(f"defense_cost.{key} must be a number >= 0 or null, got {value!r}")
    benign = data.get("benign")
    if benign is not None:
        if not isinstance(benign, dict):
            raise RecordError("benign must be an object or null")
        _check_fraction("benign.false_positive", benign.get("false_positive"))
    artifacts = data.get("artifacts")
    if artifacts is not None and (not isinstance(artifacts, str) or not artifacts.endswith(".npz")
                                  or Path(artifacts).name != artifacts or artifacts.startswith(".")):
        raise RecordError(f"artifacts must be null or the name of an .npz file beside the record, got {artifacts!r}")


def _check_reactivation(block: Any) -> None:
    if block is None:
        return
    if not isinstance(block, dict):
        raise RecordError("reactivation must be an object or null")
    for model in ("defended", "attacked"):
        curve = block.get(model)
        if curve is None:
            continue
        if not isinstance(curve, dict) or not all(isinstance(curve.get(k), list) for k in ("steps", "asr", "ca")):
            raise RecordError(f"reactivation.{model} must be an object with the lists steps, asr, ca")
        if not len(curve["steps"]) == len(curve["asr"]) == len(curve["ca"]) or not curve["steps"]:
            raise RecordError(f"reactivation.{model}: steps, asr and ca must be non-empty and of one length")
        for key in ("asr", "ca"):
            for i, value in enumerate(curve[key]):
                _check_fraction(f"reactivation.{model}.{key}[{i}]", value)
        for key, value in (curve.get("probe") or {}).items():
            _check_fraction(f"reactivation.{model}.probe.{key}", value)


def save_record(record: RunRecord, path: str | Path, *, exclusive: bool = False) -> Path:
    """Validate, then write atomically (temp file + rename); `exclusive`: FileExistsError rather
    than replace an existing file."""
    data = record.to_dict()
    validate_record(data)
    text = json.dumps(data, indent=2, sort_keys=False, allow_nan=False) + "\n"
    return write_new_bytes(path, text.encode("utf-8")) if exclusive else atomic_write_text(path, text)


def repeat_path(folder: str | Path, run_id: str, repeat: int) -> Path:
    """Where repeat `repeat` of run `run_id` keeps its record: `<run_id>.json`, then `<run_id>.<n>.json`."""
    return Path(folder) / (f"{run_id}.json" if repeat == 1 else f"{run_id}.{repeat}.json")


def next_repeat(folder: str | Path, run_id: str) -> int:
    """The first repeat of `run_id` whose files (record, artifacts, epoch log) are all absent in `folder`."""
    repeat = 1
    while any(repeat_path(folder, run_id, repeat).with_suffix(suffix).exists() for suffix in RUN_FILE_SUFFIXES):
        repeat += 1
    return repeat


def latest_repeats(records: list[tuple[RunRecord, Path]]) -> list[tuple[RunRecord, Path]]:
    """Of the records of one run id (the same config and seed, run again), the highest repeat only,
    so a table counts each seed once and shows the most recent measurement; order kept."""
    latest: dict[str, tuple[int, Path]] = {}
    for record, path in records:
        key = record.run_id
        if key not in latest or (record.repeat, str(path)) > (latest[key][0], str(latest[key][1])):
            latest[key] = (record.repeat, path)
    return [(record, path) for record, path in records if latest[record.run_id][1] == path]


def artifacts_path(record: RunRecord, record_path: str | Path) -> Path | None:
    """Where the record's artifacts file lies (beside the record), or None if it has none."""
    return Path(record_path).with_name(record.artifacts) if record.artifacts else None


def load_record(path: str | Path) -> RunRecord:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RecordError(f"{path}: not a readable JSON record ({exc})") from exc
    try:
        return RunRecord.from_dict(data)
    except RecordError as exc:
        raise RecordError(f"{path}: {exc}") from exc
