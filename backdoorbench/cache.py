"""The attacked-model cache: train each victim once, reuse it for every defense and metric.

A victim is fully determined by the dataset, model, attack and trainer configs, the seed, the
device type and the code that trains it, so its entry lives under a key that hashes exactly those
(plus CACHE_VERSION, bumped whenever what an entry holds or how a victim is trained changes).
A sweep of N defenses over one attack then trains it once.

An entry is one `torch.save` file, read back with `weights_only=True` (tensors, numbers, strings
only), holding what the rest of the run needs to continue exactly as if it had just trained:
the victim's weights, the attack's state (`Attack.state_dict()`, e.g. LIRA's generator) and its
random generators and stats, the poisoned training rows (only those that differ from the clean
split: a few percent of it), the global RNG state after training and what mounting the attack
cost (the record's `attack_cost`; an entry written before it was kept gives its `poison_s` only).
So a run from the cache gives the same record as the run that filled it, but for `victim.cache` and
the timings.

Two processes that need the same victim take an exclusive `flock` on `<key>.lock`: the first
trains and writes (temp file + fsync + rename), the second waits, then loads. A corrupt or foreign
entry is reported in one warning and retrained over.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor, nn

import backdoorbench
from backdoorbench import distributed
from backdoorbench.attacks.base import Attack, PoisonedData
from backdoorbench.config import inert_keys
from backdoorbench.datasets.base import Split
from backdoorbench.fileio import atomic_torch_save, torch_load

log = logging.getLogger(__name__)

CACHE_VERSION = 3  # 2: a clean-label poison_rate became a share of the target class (same key, other victim);
#                  3: dirty-label poison is drawn from all classes, target class included
ENTRY_FORMAT = "backdoorbench.victim_cache.v1"
# Config keys that determine the victim; anything else (defense, eval, logger, paths) does not.
VICTIM_CONFIG_KEYS = ("dataset", "model", "attack", "trainer", "victim_trainer", "seed")  # an empty victim_trainer is dropped
VICTIM_IGNORED = ("trainer.progress",)


def victim_key_material(config: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """What the key hashes: the victim-determining config, the device type and the code versions."""
    material = {key: json.loads(json.dumps(config.get(key))) for key in VICTIM_CONFIG_KEYS}
    for dotted in VICTIM_IGNORED + inert_keys(config):
        node = material
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    material["device_type"] = torch.device(device).type
    if distributed.world_size() > 1:  # a torchrun victim (batch norm per process) is another victim
        material["world_size"] = distributed.world_size()
    material["cache_version"] = CACHE_VERSION
    material["backdoorbench"] = backdoorbench.__version__
    material["torch"] = torch.__version__
    return material


def victim_key(config: dict[str, Any], device: torch.device) -> str:
    text = json.dumps(victim_key_material(config, device), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass
class CachedVictim:
    """What a cache hit gives back; `train_s`/`poison_s` are the seconds the victim first cost."""

    poisoned: PoisonedData
    train_s: float
    poison_s: float
    trained_by: dict[str, Any] | None = None  # git commit / dirty flag of the code that trained it
    attack_cost: dict[str, Any] | None = None  # the record's attack_cost when it was made; None in older entries


def _attack_generators(attack: Attack) -> dict[str, torch.Generator]:
    return {name: value for name, value in vars(attack).items() if isinstance(value, torch.Generator)}


def _attack_stats(attack: Attack) -> str:
    return json.dumps(getattr(attack, "stats", None))


class VictimCache:
    """Entries `<root>/<key>.pt`, locks `<root>/<key>.lock`."""

    def __init__(self, root: str | Path, key: str) -> None:
        self.root = Path(root).expanduser()
        self.key = key
        self.path = self.root / f"{key}.pt"
        self.lock_path = self.root / f"{key}.lock"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the key's exclusive lock: while one process trains this victim, others wait."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # not POSIX (Windows): no cross-process lock, say so once
            log.warning("victim cache: no fcntl on this platform; concurrent runs of one victim may both train it")
            yield
            return
        with open(self.lock_path, "a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("victim cache: another process is training victim %s; waiting for it", self.key)
                started = time.perf_counter()
                fcntl.flock(handle, fcntl.LOCK_EX)
                log.info("victim cache: waited %.1f s for victim %s", time.perf_counter() - started, self.key)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def load(self, model: nn.Module, attack: Attack, train: Split) -> CachedVictim | None:
        """Restore the entry into `model` and `attack`; None when absent or unusable (warned)."""
        if not self.path.exists():
            return None
        try:
            entry = torch_load(self.path, map_location="cpu")
            if not isinstance(entry, dict) or entry.get("format") != ENTRY_FORMAT or entry.get("key") != self.key:
                raise ValueError(f"not a {ENTRY_FORMAT} entry for key {self.key}")
            model.load_state_dict(entry["model"])
            attack.load_state_dict(entry["attack"])
            generators = _attack_generators(attack)
            for name, state in entry["attack_generators"].items():
                generators[name].set_state(state)
            stats = json.loads(entry["attack_stats"])
            if stats is not None:
                attack.stats = stats
            poisoned = _rebuild_poisoned(train, entry["poisoned"])
            torch.set_rng_state(entry["torch_rng"])
            if entry["cuda_rng"] and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(entry["cuda_rng"])
        except Exception as exc:  # truncated zip, foreign pickle, other architecture: retrain over it
            reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            log.warning("victim cache: entry %s is unusable (%s: %s); retraining it", self.path, type(exc).__name__, reason)
            return None
        trained_by = json.loads(entry["trained_by"]) if isinstance(entry.get("trained_by"), str) else None
        cost = json.loads(entry["attack_cost"]) if isinstance(entry.get("attack_cost"), str) else None
        return CachedVictim(poisoned=poisoned, train_s=float(entry["train_s"]), poison_s=float(entry["poison_s"]),
                            trained_by=trained_by, attack_cost=cost)

    def save(self, model: nn.Module, attack: Attack, train: Split, poisoned: PoisonedData,
             train_s: float, poison_s: float, trained_by: dict[str, Any] | None = None,
             attack_cost: dict[str, Any] | None = None) -> None:
        changed = _changed_rows(train, poisoned)
        entry = {
            "format": ENTRY_FORMAT,
            "key": self.key,
            "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "attack": attack.state_dict(),
            "attack_generators": {name: gen.get_state() for name, gen in _attack_generators(attack).items()},
            "attack_stats": _attack_stats(attack),
            "poisoned": {
                "indices": poisoned.indices.cpu(),
                "rows": changed,
                "images": poisoned.split.images[changed].cpu(),
                "labels": poisoned.split.labels[changed].cpu(),
                "n": len(poisoned.split),
            },
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
            "train_s": float(train_s),
            "trained_by": json.dumps(trained_by),
            "poison_s": float(poison_s),
            "attack_cost": json.dumps(attack_cost),  # a string: entries load with weights_only
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        atomic_torch_save(entry, self.path)


def _changed_rows(train: Split, poisoned: PoisonedData) -> Tensor:
    """Rows of the poisoned split that differ from the clean one (image or label)."""
    if poisoned.split is train or (poisoned.split.images is train.images and poisoned.split.labels is train.labels):
        return torch.empty(0, dtype=torch.long)
    differ = (poisoned.split.images != train.images).flatten(1).any(1) | (poisoned.split.labels != train.labels)
    return differ.nonzero().flatten()


def _rebuild_poisoned(train: Split, saved: dict[str, Any]) -> PoisonedData:
    if int(saved["n"]) != len(train):
        raise ValueError(f"entry has {saved['n']} training samples, this dataset {len(train)}")
    rows = saved["rows"]
    if len(rows) == 0:  # training-time attacks poison inside their step: the split stays clean
        return PoisonedData(train, saved["indices"])
    images, labels = train.images.clone(), train.labels.clone()
    images[rows] = saved["images"].to(images.dtype)
    labels[rows] = saved["labels"].to(labels.dtype)
    return PoisonedData(Split(images, labels), saved["indices"])

