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
from backdoorbench.metrics.cost import attack_cost
from backdoorbench.models.base import Normalized
from backdoorbench.provenance import git_commit
from backdoorbench.stages import stream, timed
from backdoorbench.train.passes import CallCounter

log = logging.getLogger(__name__)


def remove_checkpoints(folder: Path) -> None:
    """Per-epoch checkpoints exist only to resume an unfinished training; drop them once safe."""
    shutil.rmtree(folder, ignore_errors=True)
    with suppress(OSError):
        folder.parent.rmdir()  # when no other run is unfinished


PREPARE_FORMAT = "backdoorbench.prepare_checkpoint.v1"


def prepare_attack(attack: Attack, checkpoint: Path, *, trainer, train, generator: torch.Generator, build_model,
                   clean_model: Callable[[], tuple[Any, dict[str, Any]]] | None = None,
                   counter: CallCounter | None = None) -> None:
    """`attack.prepare(...)`, or its result restored from `checkpoint` when a killed run already
    computed it (e.g. Input-aware's mask pre-training). What prepare leaves behind (its result,
    the global RNG state that the victim's initialization draws from next, its logged epochs) is
    saved there when the attack has a `prepare_state`, so the resumed run goes on exactly.
    `clean_model` (the run's clean control and its cache block) goes to an attack that
    `uses_clean_control` (an attack's network cache came earlier, with `bind_run`). `counter`: the poison
    stage's pass counter; the cost it counted in prepare is saved with the checkpoint, and added back when
    the preparation is restored."""
    where = f"checkpoint {str(checkpoint)!r}"
    if checkpoint.exists():
        try:
            state = torch_load(checkpoint, map_location="cpu")
        except Exception as exc:  # a truncated zip, a foreign pickle, ...: torch raises many types
            raise DataError(f"{where} cannot be read ({type(exc).__name__}); delete it to train from scratch") from exc
        if not isinstance(state, dict) or state.get("format") != PREPARE_FORMAT or state.get("attack_name") != attack.name:
            raise DataError(f"{where} is not {attack.name}'s saved preparation; delete it or give another path")
        attack.load_prepare_state(state["attack"])
        if counter is not None and isinstance(state.get("cost"), dict):  # a checkpoint of before costs: none
            counter.add(**state["cost"])
        torch.set_rng_state(state["torch_rng"])
        generator.set_state(state["generator"])
        for row in state["attack"].get("history", []):
            if trainer.on_epoch is not None:
                trainer.on_epoch(row)  # the killed run's logger never wrote them
        log.info("%s: preparation restored from %s", attack.name, checkpoint)
        return
    extra = {"clean_model": clean_model} if clean_model is not None and attack.uses_clean_control else {}
    attack.prepare(trainer=trainer, train=train, generator=generator, build_model=build_model, **extra)
    prepared = attack.prepare_state()
    if prepared is not None and distributed.is_main():
        atomic_torch_save({"format": PREPARE_FORMAT, "attack_name": attack.name, "attack": prepared,
                           "torch_rng": torch.get_rng_state(), "generator": generator.get_state(),
                           **({"cost": counter.snapshot()} if counter is not None else {})}, checkpoint)


def obtain_victim(cfg: DictConfig, config: dict[str, Any], run_id: str, data: ImageDataset, attack: Attack,
                  trainer, timings: dict[str, float], results_dir: Path,
                  clean_model: Callable[[], tuple[Any, dict[str, Any]]] | None = None
                  ) -> tuple[dict[str, Any], Any, Normalized, dict[str, Any]]:
    """The attacked model: from the victim cache when an identical one was trained before (the
    attack's state restored with it), else prepared, poisoned and trained here (and cached).
    `clean_model`: the run's clean control, for an attack whose preparation reads it (LF).
    Returns (the record's `victim` block, the poisoned training data, the model, the record's
    `attack_cost`: as counted here, or as counted when the cached victim was made)."""
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
                cost = hit.attack_cost or attack_cost({"seconds": hit.poison_s}, len(data.train))  # an older entry
                return ({"cache": "hit", "key": key, "path": str(cache.path), "train_s": hit.train_s,
                         "poison_s": hit.poison_s, "trained_by": hit.trained_by}, hit.poisoned, model, cost)
            torch.set_rng_state(rng)  # a miss draws exactly what a run without the cache draws
        checkpoints = results_dir / "checkpoints" / (key if cache is not None else run_id)
        counter, control = CallCounter(), {}
        with timed(timings, "poison"), counter.counting():
            prepare_attack(attack, checkpoints / "prepare.pt", trainer=trainer, train=data.train,
                           generator=stream(seed, "attack"), build_model=lambda **kwargs: build_model(cfg, data, **kwargs),
                           clean_model=_not_counted(clean_model, counter, control), counter=counter)
            cached, source = _prepare_cost_recorded(attack, counter)
            poisoned = attack.poison_dataset(data.train, stream(seed, "poison"))
        model = build_model(cfg, data)  # after prepare, as without a cache: the same global RNG draws
        training = CallCounter() if attack.kind == "training_controlled" else None
        with timed(timings, "train"), training.counting() if training is not None else nullcontext():
            attack.train_victim(trainer, model, poisoned.split, stream(seed, "train"), checkpoint=checkpoints / "victim.pt")
        if training is not None and distributed.active():  # each process counted its share of every batch
            shares = distributed.all_reduce_sum(torch.tensor([training.forward_images, training.backward_images],
                                                             dtype=torch.float64, device=trainer.device))
            training.forward_images, training.backward_images = (int(v) for v in shares.tolist())
        cost = attack_cost(counter, len(data.train), cached=cached, prepare_cost=source,
                           clean_control_s=control.get("train_s"), training=training)
        if cache is None:
            return {"cache": "off", "key": key}, poisoned, model, cost
        if distributed.is_main():
            cache.save(model, attack, data.train, poisoned, train_s=timings["train"], poison_s=timings["poison"],
                       trained_by=dict(git_commit()), attack_cost=cost)
            remove_checkpoints(checkpoints)
        return ({"cache": "miss", "key": key, "path": str(cache.path), "train_s": timings["train"],
                 "poison_s": timings["poison"]}, poisoned, model, cost)


def _not_counted(clean_model: Callable[[], tuple[Any, dict[str, Any]]] | None, counter: CallCounter,
                 control: dict[str, Any]) -> Callable[[], tuple[Any, dict[str, Any]]] | None:
    """`clean_model` with the counter paused while it runs: the clean control (the `attack=none`
    victim, from the cache or trained) is the run's clean baseline, whose cost its own record
    holds, not the attack's; `control["train_s"]` gets the seconds it took to train."""
    if clean_model is None:
        return None

    def fetch() -> tuple[Any, dict[str, Any]]:
        with counter.paused():
            model, block = clean_model()
        control["train_s"] = block.get("train_s")
        return model, block
    return fetch


def _prepare_cost_recorded(attack: Attack, counter: CallCounter) -> tuple[bool, str]:
    """(cached, attack_cost.prepare_cost) after `prepare`: an attack whose prepare result came from
    its own cache says so in describe()'s `prepare_cost` ({"cached": true, "seconds",
    "forward_images", "backward_images"}: what making it cost, recorded then); that cost joins the
    counter. Without the three numbers the cost is unknown and the counter keeps this run's share."""
    recorded = attack.describe().get("prepare_cost")
    if not isinstance(recorded, dict) or not recorded.get("cached"):
        return False, "measured"
    parts = {name: recorded.get(name) for name in ("seconds", "forward_images", "backward_images")}
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in parts.values()):
        return True, "unknown"
    counter.add(**parts)
    return True, "recorded"


def exported_training_set(attack: TrainingAttack, train, trainer, seed: int) -> PoisonedData:
    """The poisoned training set a training-controlled attack hands over after training its victim
    (`TrainingAttack.export_poisoned_set`), for the defenses that read only the stored split. Not
    stored in the victim cache: it is made again from the trained trigger (saved with the victim)
    and the run's seeded `export` stream, so a cached victim gives the same set. Batches of the
    victim trainer's size, as the attack trained (BackdoorBench exports with its training batch)."""
    return attack.export_poisoned_set(train, stream(seed, "export"), trainer.batch_size, trainer.device)
