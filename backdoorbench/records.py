"""The run record: one JSON per run, validated on load, written atomically.

Numbers are JSON numbers (never strings); metrics are fractions in [0, 1]. Records are written
in SCHEMA_VERSION; `load_record` reads every version in READABLE_VERSIONS and `upgrade`s an older
one in memory, a step per version, so every loaded record is of the current schema (the file
itself is never rewritten); any other version is refused, so no reader meets a format it does
not know.

Versions:
- 1: the run (config, seed, metrics, stealth, timings, env); `victim`, `artifacts`, `repeat`,
  `reactivation`, `defense_cost` and `benign` were added within it, so version-1 records may lack them.
- 2: the defense protocols are part of the schema: every record carries `reactivation`,
  `defense_cost` and `benign` (null where the run had none), and `victim`.
- 3: `report`, what reporting reads, decided by the run (run_facts.py): its protocol, whether the
  defense met the attack, which values are at their protocol's defaults, the canonical key and the
  method's own setting; the config holds every key the run's code read (`upgrade` gives an older
  config the keys added since, at the values its code ran with, `eval.detection_only` too, which
  was added within version 3). A detection-only run (`eval.detection_only`) has `metrics.defended`
  and `der` null and says why in `metrics.defended_reason`. `attack_cost` (metrics/cost.py) was
  added within version 3: a record made before lacks it and loads with it null.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from backdoorbench.run_keys import detection_only, protocol_name
from backdoorbench.fileio import atomic_write_text, write_new_bytes

SCHEMA_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
METRIC_KEYS = ("clean_acc", "asr", "ra")
# Fields a record of each version may lack (added within that version or later; the older records lack them).
OPTIONAL_FIELDS = {1: {"victim", "artifacts", "repeat", "defense_cost", "benign", "reactivation", "report",
                       "attack_cost"},
                   2: {"artifacts", "repeat", "report", "attack_cost"}, 3: {"artifacts", "repeat", "attack_cost"}}
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
    # What reporting reads (REPORT_KEYS), decided by the run (run_facts.py); for a record older than
    # version 3, by `upgrade` from the record and the facts frozen for it (records_v2_facts.json).
    report: dict[str, Any] | None = None
    # What mounting the attack cost per training image, seconds and network passes (metrics/cost.py
    # attack_cost); null in records made before it was kept.
    attack_cost: dict[str, Any] | None = None
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {"schema_version": data.pop("schema_version"), **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunRecord:
        """The record `data` holds, of any readable version, upgraded to the current schema."""
        data = upgrade(data)
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
    for key in ("dataset", "model", "defense"):
        if not isinstance(data[key].get("name"), str):
            raise RecordError(f"{key}.name must be a string")
    metrics = data["metrics"]
    _check_metrics("metrics.attacked", metrics.get("attacked"))
    defended, der = metrics.get("defended"), metrics.get("der")
    if (defended is None) != (der is None):
        raise RecordError("metrics.defended and metrics.der must both be present or both null")
    if defended is not None:
        _check_metrics("metrics.defended", defended)
        _check_fraction("metrics.der", der)
    reason = metrics.get("defended_reason")  # a detection-only run: why there is no defended model
    if reason is not None and (defended is not None or not isinstance(reason, str) or not reason):
        raise RecordError("metrics.defended_reason must be a non-empty string, and only where metrics.defended is null")
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
    _check_attack_cost(data.get("attack_cost"))
    benign = data.get("benign")
    if benign is not None:
        if not isinstance(benign, dict):
            raise RecordError("benign must be an object or null")
        if benign.get("false_positive") is None and "false_positive" in benign:  # unmeasurable: the reason says why
            if not isinstance(benign.get("reason"), str) or not benign["reason"]:
                raise RecordError("benign.false_positive is null without a benign.reason saying why")
        else:
            _check_fraction("benign.false_positive", benign.get("false_positive"))
    artifacts = data.get("artifacts")
    if artifacts is not None and (not isinstance(artifacts, str) or not artifacts.endswith(".npz")
                                  or Path(artifacts).name != artifacts or artifacts.startswith(".")):
        raise RecordError(f"artifacts must be null or the name of an .npz file beside the record, got {artifacts!r}")
    if version >= 3:
        _check_report(data["report"])


# The `report` block: key -> the types its value may have (reporting reads exactly these keys).
REPORT_KEYS: dict[str, tuple[type, ...]] = {
    "protocol": (str,), "applicable": (bool,), "not_applicable": (str, type(None)),
    "defense_at_defaults": (bool, type(None)), "attack_at_defaults": (bool,), "sensitivity_keys": (list,),
    "clean_budget": (bool,), "canonical_key": (str,), "setting": (dict,),
}
CANONICAL_KEY_PARTS = ("table", "dataset", "protocol", "model", "attack", "target_mode", "defense")


def _check_report(block: Any) -> None:
    if not isinstance(block, dict):
        raise RecordError(f"report must be an object with {', '.join(REPORT_KEYS)}")
    missing = [key for key in REPORT_KEYS if key not in block]
    if missing:
        raise RecordError(f"report lacks {', '.join(missing)}")
    for key, types in REPORT_KEYS.items():
        if not isinstance(block[key], types):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise RecordError(f"report.{key} must be {names}, got {block[key]!r}")
    if block["applicable"] == (block["not_applicable"] is not None):
        raise RecordError("report.not_applicable must be the reason exactly when report.applicable is false")
    if not all(isinstance(key, str) for key in block["sensitivity_keys"]):
        raise RecordError(f"report.sensitivity_keys must be a list of strings, got {block['sensitivity_keys']!r}")
    if len(block["canonical_key"].split("|")) != len(CANONICAL_KEY_PARTS):
        raise RecordError(f"report.canonical_key must be {'|'.join(f'<{p}>' for p in CANONICAL_KEY_PARTS)}, "
                          f"got {block['canonical_key']!r}")
    setting = block["setting"]
    if sorted(setting) != ["attack", "defense"] or not all(isinstance(v, dict) for v in setting.values()):
        raise RecordError(f"report.setting must be an object with the objects attack and defense, got {setting!r}")


def _check_attack_cost(block: Any, where: str = "attack_cost") -> None:
    """Null, or an object of numbers >= 0, nulls, strings, the flag `cached` and objects alike (passes, ...)."""
    if block is None:
        return
    if not isinstance(block, dict):
        raise RecordError(f"{where} must be an object or null")
    for key, value in block.items():
        if isinstance(value, dict):
            _check_attack_cost(value, f"{where}.{key}")
        elif not (value is None or isinstance(value, str) or (key == "cached" and isinstance(value, bool))) and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0):
            raise RecordError(f"{where}.{key} must be a number >= 0 or null, got {value!r}")


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


def record_table(data: dict[str, Any]) -> str:
    """The table a record (as a dict) is a row of: `attacks` without a defense, `detections` for a
    detection-only run (`eval.detection_only`: no defended model, never a repair result), else `defenses`."""
    if data["defense"]["name"] == "none":
        return "attacks"
    return "detections" if detection_only(data["config"]) else "defenses"


def canonical_key(data: dict[str, Any]) -> str:
    """`<table>|<dataset>|<protocol>|<model>|<attack>|<target_mode>|<defense>` of a record (as a dict):
    the records that share it are the settings of one cell, of which one is canonical."""
    attack, defense = data["attack"], data["defense"]["name"]
    target = attack.get("target")
    mode = attack["target_mode"] + (f"({target})" if target is not None and attack["target_mode"] == "all2one" else "")
    return "|".join([record_table(data), data["dataset"]["name"], protocol_name(data["config"]), data["model"]["name"],
                     attack["name"], mode, defense])


# Keys of a method's config that are not its setting: the class, and the target mode (a column of its own).
NOT_SETTING_KEYS = ("_target_", "target_mode")


def own_setting(config: dict[str, Any] | None, defaults: dict[str, Any]) -> dict[str, Any]:
    """A method's config values that differ from its defaults, in its own key names; a key the
    defaults lack counts as differing, a key the config lacks (an older record) as default."""
    return {key: copy.deepcopy(value) for key, value in (config or {}).items()
            if key not in NOT_SETTING_KEYS and (key not in defaults or defaults[key] != value)}


def resolve_defaults(defaults: dict[str, Any], protocol: dict[str, Any] | None) -> dict[str, Any]:
    """A method's defaults with the values its protocol sets (`${oc.select:protocol.methods...}`)
    read from `protocol` (a record's `config.protocol`), their fallbacks where it names none."""
    text = json.dumps(defaults, sort_keys=True)
    return _resolved(text, json.dumps(protocol or {}, sort_keys=True)) if "${" in text else defaults


@functools.lru_cache(maxsize=1024)
def _resolved(defaults: str, protocol: str) -> dict[str, Any]:
    node = OmegaConf.create({"method": json.loads(defaults), "protocol": json.loads(protocol)})
    return OmegaConf.to_container(node, resolve=True)["method"]


def attack_at_defaults(config: dict[str, Any] | None, defaults: dict[str, Any]) -> bool:
    """Whether an attack's config holds every default of its (resolved) `defaults` it has."""
    return bool(defaults) and config is not None and all(
        config.get(key, value) == value for key, value in defaults.items() if key not in NOT_SETTING_KEYS)


def defense_at_defaults(config: dict[str, Any] | None, defaults: dict[str, Any], keys: list[str]) -> bool | None:
    """Whether a defense's config holds the default of every key its sensitivity sweep varies;
    None for a defense that sweeps none."""
    if not keys:
        return None
    return config is not None and all(key in defaults and config.get(key) == defaults[key] for key in keys)


FROZEN_FACTS = "records_v2_facts.json"  # beside this module; written by benchmarks/freeze_record_facts.py


@functools.lru_cache(maxsize=1)
def frozen_facts() -> dict[str, Any]:
    """What the code of the last version-2 commit knew of its methods, for records made before version 3:
    defaults per attack and defense, sensitivity keys, the clean-budget defenses, the excluded pairs."""
    return json.loads(resources.files("backdoorbench").joinpath(FROZEN_FACTS).read_text(encoding="utf-8"))


def _frozen_applicability(data: dict[str, Any], facts: dict[str, Any]) -> str | None:
    """Why the record's defense never met its attack, or None: the record says so since the pipeline
    asks the defense; before, the frozen judgement of the classes its config names."""
    defense = data["defense"]
    if defense.get("applicable") is False:
        return str(defense.get("not_applicable", ""))
    if "applicable" in defense or defense["name"] == "none":
        return None
    config = data["config"]
    pair = "|".join([(config.get("defense") or {}).get("_target_", ""), data["attack"]["name"],
                     (config.get("attack") or {}).get("_target_", "")])
    return facts["not_applicable"].get(pair)


def frozen_report(data: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
    """The `report` of a record made before version 3, from the record itself and `facts`
    (`frozen_facts()`): what its run would have written had it been made at the freeze."""
    config = data["config"]
    attack, defense = data["attack"]["name"], data["defense"]["name"]
    attack_defaults = resolve_defaults(facts["attack_defaults"].get(attack, {}), config.get("protocol"))
    defense_defaults = facts["defense_defaults"].get(defense, {})
    keys = list(facts["sensitivity"].get(defense, [])) if defense != "none" else []
    excluded = _frozen_applicability(data, facts)
    return {
        "protocol": protocol_name(config),
        "applicable": excluded is None,
        "not_applicable": excluded,
        "defense_at_defaults": defense_at_defaults(config.get("defense"), defense_defaults, keys),
        "attack_at_defaults": attack_at_defaults(config.get("attack"), attack_defaults),
        "sensitivity_keys": keys,
        "clean_budget": defense in facts["clean_budget"],
        "canonical_key": canonical_key(data),
        "setting": {"attack": own_setting(config.get("attack"), attack_defaults),
                    "defense": own_setting(config.get("defense"), defense_defaults)},
    }


# Config keys added after records were written, with the value that ran before each existed (a
# record without the key trained and measured as if it had this value); see `git log -p` of
# conf/config.yaml and conf/trainer/default.yaml.
_TRAINER_KEYS_ADDED = {"rotation": 0.0, "rotation_p": 0.5,  # 14c1279: no rotation before
                       "schedule_period": None, "plateau_patience": 10}  # e325bc0: cosine over the run, no plateau
# `victim_trainer` (the victim-only trainer keys, set by conf/protocol_attack/), all unset: the victim trained with `trainer`
_VICTIM_TRAINER_UNSET = {"epochs": None, "batch_size": None, "schedule": None, "milestones": [], "gamma": None,
                         "schedule_period": None, "plateau_patience": None, "augment": None, "rotation": None,
                         "rotation_p": None}
_PGD_KEYS_ADDED = {"rel_step_size": None, "random_start": True, "losses": ["ce"], "transfer_from": None}  # ad8fc6d
_REACTIVATION_OFF = {  # 34a87ab added the stage with these settings; a record made before never ran it
    "enabled": False, "clean_fraction": 0.02, "poison_count": 5, "epochs": 5, "lr": 0.01, "batch_size": 128,
    "eval_every": 1, "reference": True,
    "probe": {"enabled": True, "eps": 0.06274509803921569, "epochs": 50, "alpha": 0.2, "clean_count": 500,
              "poison_count": 500, "lr": 0.1, "batch_size": 128, "hidden": 1024}}


def _with_defaults(block: dict[str, Any], added: dict[str, Any]) -> dict[str, Any]:
    """`block` with the keys of `added` it lacks (copies), after its own."""
    return {**block, **{key: copy.deepcopy(value) for key, value in added.items() if key not in block}}


def _filled_config(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An older record's config and env (new objects where changed) with the keys added since, at the
    values its code ran with; `eval.lpips_weights` becomes `eval.lpips`; the retired `trainer.amp` becomes `trainer.precision` (cb37ec1: amp was
    bf16 autocast on CUDA, nothing on the CPU, which is what `auto` does there), and `env.precision`
    the precision it computed in."""
    config, env = dict(data["config"]), dict(data["env"])
    if isinstance(config.get("trainer"), dict):
        trainer = config["trainer"] = _with_defaults(config["trainer"], _TRAINER_KEYS_ADDED)
        if "precision" not in trainer:
            amp, cuda = bool(trainer.pop("amp", False)), str(env.get("device", "cpu")).startswith("cuda")
            trainer["precision"] = ("bf16" if cuda else "auto") if amp else "fp32"
            env.setdefault("precision", "bf16" if amp and cuda else "fp32")
    if isinstance(config.get("trainer"), dict) and "victim_trainer" not in config:
        config["victim_trainer"] = copy.deepcopy(_VICTIM_TRAINER_UNSET)
    if isinstance(config.get("eval"), dict):
        evaluation = config["eval"] = _with_defaults(config["eval"], {"reactivation": _REACTIVATION_OFF})
        if isinstance(evaluation.get("pgd"), dict):
            evaluation["pgd"] = _with_defaults(evaluation["pgd"], _PGD_KEYS_ADDED)
        if "lpips_weights" in evaluation and "lpips" not in evaluation:
            # c79dc24 renamed it: a path stays that path; null (torch hub's cache when the file was
            # there, never a download) is the nearest of the new values, `auto`
            weights = evaluation.pop("lpips_weights")
            evaluation["lpips"] = "auto" if weights is None else weights
    return config, env


def _v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    """Version 1 -> 2: the fields added within version 1, null where an older record lacks them."""
    return {**dict.fromkeys(("victim", "reactivation", "defense_cost", "benign")), **data, "schema_version": 2}


def _v2_to_v3(data: dict[str, Any]) -> dict[str, Any]:
    """Version 2 -> 3: `report` from the record and the frozen facts; every field present; the
    config keys added since, at the values the record's code ran with."""
    data = {"artifacts": None, "repeat": 1, **data}
    report = frozen_report(data, frozen_facts())  # from the record as it was written
    config, env = _filled_config(data)
    return {**data, "config": config, "env": env, "report": report, "schema_version": 3}


UPGRADES = {1: _v1_to_v2, 2: _v2_to_v3}  # version -> the step to the next


def upgrade(data: Any) -> dict[str, Any]:
    """A record (a dict of any readable version), validated and upgraded to SCHEMA_VERSION, one
    step per version; `data` itself is left as it was. RecordError on an unknown version or a
    malformed record."""
    validate_record(data)
    if data["schema_version"] < SCHEMA_VERSION:
        data = dict(data)  # each step replaces what it changes: the caller's objects stay as they were
        while data["schema_version"] < SCHEMA_VERSION:
            data = UPGRADES[data["schema_version"]](data)
        validate_record(data)
    return _with_eval_keys_added(data)


# `eval` keys added within the current version, at the value every record made before them ran with.
_EVAL_KEYS_ADDED = {"detection_only": False}  # the whole defense ran: no detection-only run existed


def _with_eval_keys_added(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with the `eval` keys its config lacks of those added since it was made (a new object
    where it changed; `data` itself where nothing is missing), so every loaded config has the keys
    a fresh run's has."""
    evaluation = data["config"].get("eval")
    if not isinstance(evaluation, dict) or _EVAL_KEYS_ADDED.keys() <= evaluation.keys():
        return data
    return {**data, "config": {**data["config"], "eval": _with_defaults(evaluation, _EVAL_KEYS_ADDED)}}


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
