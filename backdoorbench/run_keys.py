"""The run id and the keys it leaves out, and the names of the detection arrays a run saves: plain
functions of a resolved config (a dict) and constants, without Hydra or OmegaConf, so that the
records, the defense runner and the report wing share them without loading either."""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Keys that change where or how a run reports, never what it computes; left out of the run id.
# `protocol` names the recipe and holds per-dataset method values, which reach the run through the
# attack's and trainer's own keys (those are in the id). `eval.lpips` says where LPIPS's weights come
# from; records made before it hold `eval.lpips_weights`, dropped too so that their ids stay.
NON_RESULT_KEYS = ("results_dir", "logger", "trainer.progress", "eval.lpips", "eval.lpips_weights", "cache", "cache_dir",
                   "protocol")


def protocol_name(config: Any) -> str:
    """The training protocol a config (or a record's) ran: `protocol.name`; a config from before
    protocols existed trained with today's quick recipe."""
    protocol = config.get("protocol") or {}
    return str(protocol.get("name") or "quick")


# Attack keys added after records were made, at the value every earlier run had: left out of the
# run id and the victim key at that value. `attack.signal` (SIG's ramp, added 2026-12-05): sinusoid.
INERT_ATTACK_DEFAULTS = {"signal": "sinusoid"}


def detection_only(config: dict[str, Any]) -> bool:
    """Whether the run only scored its detector (`eval.detection_only`): no retraining on the kept
    data, no defended model. A config from before the key existed ran the whole defense."""
    return bool((config.get("eval") or {}).get("detection_only", False))


# The per-item detection arrays every detecting run saves in its artifacts (.npz), whatever the
# detector, oriented so that higher = more suspicious:
# - a dataset-level detector (pre_train, or an in_train defense that isolates samples, ABL): one
#   entry per training sample the defender was given, in its stored order;
# - an input-level detector: the clean test inputs, then the triggered ones.
DETECTION_SCORES = "detection_scores"  # float: the detector's suspicion
DETECTION_TRUTH = "detection_truth"  # bool: truly poisoned / triggered (for the ROC; the detector never saw it)
DETECTION_FLAGGED = "detection_flagged"  # bool: the detector's own verdict (its flags, or score > threshold)
DETECTION_THRESHOLD = "detection_threshold"  # scalar, input detectors: flagged = score > threshold


def inert_keys(config: dict[str, Any]) -> tuple[str, ...]:
    """Keys added later that play no part at their defaults: trainer keys, an empty
    `victim_trainer`, attack keys at the value runs had before the key existed
    (`INERT_ATTACK_DEFAULTS`), and `eval.detection_only` while off. Left out of the run id and the
    victim key, so a run that does not use them keeps the id and the cached victim it had before."""
    trainer = config.get("trainer") or {}
    inert = [] if set_victim_keys(config) else ["victim_trainer"]
    if not detection_only(config):
        inert.append("eval.detection_only")
    if trainer.get("schedule_period") is None:
        inert.append("trainer.schedule_period")
    if trainer.get("schedule") != "plateau":
        inert.append("trainer.plateau_patience")
    attack = config.get("attack") or {}
    inert += [f"attack.{key}" for key, value in INERT_ATTACK_DEFAULTS.items() if attack.get(key) == value]
    return tuple(inert)


def config_hash(config: dict[str, Any], drop: tuple[str, ...]) -> str:
    """sha256 (16 hex) of the canonical JSON of `config` without the dotted keys in `drop`."""
    pruned = json.loads(json.dumps(config))
    for dotted in drop:
        node = pruned
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return hashlib.sha256(json.dumps(pruned, sort_keys=True).encode()).hexdigest()[:16]


def run_config_hash(config: dict[str, Any], drop: tuple[str, ...] = ()) -> str:
    """The run id's hash: `config_hash` without the non-result keys, and without `eval.reactivation`
    while it is off (and trainer keys at their inert defaults), so that a run without the stage keeps
    the id it had before the stage existed."""
    reactivation = (config.get("eval") or {}).get("reactivation") or {}
    off = () if reactivation.get("enabled") else ("eval.reactivation",)
    return config_hash(config, NON_RESULT_KEYS + off + inert_keys(config) + drop)


def set_victim_keys(config: dict[str, Any]) -> dict[str, Any]:
    """The keys a resolved config's `victim_trainer` sets (null and [] leave the trainer's)."""
    return {key: value for key, value in (config.get("victim_trainer") or {}).items() if value not in (None, [])}
