"""The attacked model of a run: from the victim cache when an identical one was trained before, else
prepared, poisoned and trained here (resuming a killed run's preparation and epochs) and cached."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from contextlib import nullcontext, suppress
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from backdoorbench import distributed
from backdoorbench.attacks.base import Attack, PoisonedData, TrainingAttack
from backdoorbench.cache import VictimCache, victim_key
from backdoorbench.datasets.base import ImageDataset
from backdoorbench.errors import DataError
from backdoorbench.factory import build_model
from backdoorbench.fileio import atomic_torch_save, torch_load
from backdoorbench.models.base import Normalized
from backdoorbench.provenance import git_commit
from backdoorbench.stages import stream, timed

log = logging.getLogger(__name__)


def remove_checkpoints(folder: Path) -> None:
    """Per-epoch checkpoints exist only to resume an unfinished training; drop them once safe."""
    shutil.rmtree(folder, ignore_errors=True)
    with suppress(OSError):
        folder.parent.rmdir()  # when no other run is unfinished


PREPARE_FORMAT = "backdoorbench.prepare_checkpoint.v1"


def prepare_attack(attack: Attack, checkpoint: Path, *, trainer, train, generator: torch.Generator, build_model,
                   clean_model: Callable[[], tuple[Any, dict[str, Any]]] | None = None,
                   network_cache: Path | None = None) -> None:
    """`attack.prepare(...)`, or its result restored from `checkpoint` when a killed run already
    computed it (e.g. Input-aware's mask pre-training). What prepare leaves behind (its result,
    the global RNG state that the victim's initialization draws from next, its logged epochs) is
    saved there when the attack has a `prepare_state`, so the resumed run goes on exactly.
    `clean_model` (the run's clean control and its cache block) goes to an attack that
    `uses_clean_control`; `network_cache` (the run's cache folder, None when the cache is off) to one
    that `uses_network_cache`."""
    where = f"checkpoint {str(checkpoint)!r}"
    if checkpoint.exists():
        try:
            state = torch_load(checkpoint, map_location="cpu")
        except Exception as exc:  # a truncated zip, a foreign pickle, ...: torch raises many types
            raise DataError(f"{where} cannot be read ({type(exc).__name__}); delete it to train from scratch") from exc
        if not isinstance(state, dict) or state.get("format") != PREPARE_FORMAT or state.get("attack_name") != attack.name:
            raise DataError(f"{where} is not {attack.name}'s saved preparation; delete it or give another path")
        attack.load_prepare_state(state["attack"])
        torch.set_rng_state(state["torch_rng"])
        generator.set_state(state["generator"])
        for row in state["attack"].get("history", []):
            if trainer.on_epoch is not None:
                trainer.on_epoch(row)  # the killed run's logger never wrote them
        log.info("%s: preparation restored from %s", attack.name, checkpoint)
        return
    extra = {"clean_model": clean_model} if clean_model is not None and attack.uses_clean_control else {}
    if attack.uses_network_cache:
        extra["cache_dir"] = network_cache
    attack.prepare(trainer=trainer, train=train, generator=generator, build_model=build_model, **extra)
    prepared = attack.prepare_state()
    if prepared is not None and distributed.is_main():
        atomic_torch_save({"format": PREPARE_FORMAT, "attack_name": attack.name, "attack": prepared,
                           "torch_rng": torch.get_rng_state(), "generator": generator.get_state()}, checkpoint)


def obtain_victim(cfg: DictConfig, config: dict[str, Any], run_id: str, data: ImageDataset, attack: Attack,
                  trainer, timings: dict[str, float], results_dir: Path,
                  clean_model: Callable[[], tuple[Any, dict[str, Any]]] | None = None) -> tuple[dict[str, Any], Any, Normalized]:
    """The attacked model: from the victim cache when an identical one was trained before (the
    attack's state restored with it), else prepared, poisoned and trained here (and cached).
    `clean_model`: the run's clean control, for an attack whose preparation reads it (LF).
    Returns (the record's `victim` block, the poisoned training data, the model)."""
    seed = cfg.seed
    key = victim_key(config, trainer.device)
    cache = VictimCache(Path(cfg.cache_dir).expanduser() if cfg.cache_dir else results_dir / "cache" / "victims", key) \
        if cfg.cache else None
    # Under torchrun the run's processes are one user of the cache: rank 0 alone locks, looks and
    # writes; the others read the entry only once rank 0 found it (a lock per process would
    # deadlock them against the training's collectives).
    attack.bind_run(data=data, network_cache=cache.root / "networks" if cache is not None else None)
    with cache.locked() if cache is not None and distributed.is_main() else nullcontext():
        if cache is not None:
            rng = torch.get_rng_state()
            model = build_model(cfg, data)
            started = time.perf_counter()
            hit = cache.load(model, attack, data.train) if distributed.is_main() else None
            if distributed.rank_0_says(hit is not None) and hit is None:
                hit = cache.load(model, attack, data.train)
            if hit is not None:
                timings["victim_cache_load"] = round(time.perf_counter() - started, 4)
                timings["poison"] = timings["train"] = 0.0
                log.info("victim %s from the cache (%s); it took %.1f s to train", key, cache.path, hit.train_s)
                return ({"cache": "hit", "key": key, "path": str(cache.path), "train_s": hit.train_s,
                         "poison_s": hit.poison_s, "trained_by": hit.trained_by}, hit.poisoned, model)
            torch.set_rng_state(rng)  # a miss draws exactly what a run without the cache draws
        checkpoints = results_dir / "checkpoints" / (key if cache is not None else run_id)
        with timed(timings, "poison"):
            prepare_attack(attack, checkpoints / "prepare.pt", trainer=trainer, train=data.train,
                           generator=stream(seed, "attack"), build_model=lambda **kwargs: build_model(cfg, data, **kwargs),
                           clean_model=clean_model, network_cache=cache.root if cache is not None else None)
            poisoned = attack.poison_dataset(data.train, stream(seed, "poison"))
        model = build_model(cfg, data)  # after prepare, as without a cache: the same global RNG draws
        with timed(timings, "train"):
            attack.train_victim(trainer, model, poisoned.split, stream(seed, "train"), checkpoint=checkpoints / "victim.pt")
        if cache is None:
            return {"cache": "off", "key": key}, poisoned, model
        if distributed.is_main():
            cache.save(model, attack, data.train, poisoned, train_s=timings["train"], poison_s=timings["poison"],
                       trained_by=dict(git_commit()))
            remove_checkpoints(checkpoints)
        return ({"cache": "miss", "key": key, "path": str(cache.path), "train_s": timings["train"],
                 "poison_s": timings["poison"]}, poisoned, model)


def exported_training_set(attack: TrainingAttack, train, trainer, seed: int) -> PoisonedData:
    """The poisoned training set a training-controlled attack hands over after training its victim
    (`TrainingAttack.export_poisoned_set`), for the defenses that read only the stored split. Not
    stored in the victim cache: it is made again from the trained trigger (saved with the victim)
    and the run's seeded `export` stream, so a cached victim gives the same set. Batches of the
    victim trainer's size, as the attack trained (BackdoorBench exports with its training batch)."""
    return attack.export_poisoned_set(train, stream(seed, "export"), trainer.batch_size, trainer.device)
