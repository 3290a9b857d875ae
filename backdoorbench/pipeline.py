"""One run: dataset -> attack -> victim training -> defense -> evaluation -> record."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import platform
import re
import shutil
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager, nullcontext, suppress
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

import backdoorbench
from backdoorbench import checks, distributed, interrupts
from backdoorbench.artifacts import example_artifacts, write_beside_record
from backdoorbench.attacks.base import Attack
from backdoorbench.cache import VictimCache, victim_key
from backdoorbench.config import NON_RESULT_KEYS, inert_trainer_keys, protocol_name
from backdoorbench.datasets.base import ImageDataset
from backdoorbench.datasets.spec import dataset_spec
from backdoorbench.defenses.base import Defense, DefenseContext, clean_subset_indices
from backdoorbench.defenses.runner import benign_false_positives, run_defense
from backdoorbench.errors import ConfigError, DataError, StorageError, UserError
from backdoorbench.precision import bf16_warning
from backdoorbench.fileio import atomic_torch_save, ensure_writable_dir, torch_load
from backdoorbench.metrics import defense_effectiveness_rating, evaluate
from backdoorbench.metrics.reactivation import ProbeBudget, RetuningBudget, measure_reactivation
from backdoorbench.metrics.robustness import check_settings, eps_list, masking_suspects, robustness_curve, transfer_accuracy
from backdoorbench.metrics.stealth import stealth_metrics
from backdoorbench.models.base import Normalized
from backdoorbench.records import RunRecord, next_repeat, repeat_path, save_record

log = logging.getLogger(__name__)

# Each random stream gets its own generator so that, e.g., changing the defense never changes
# which samples were poisoned.
STREAMS = {"poison": 1, "train": 2, "clean_subset": 3, "defense": 4, "defense_train": 5, "attack": 6, "reactivation": 7}


def stream(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + STREAMS[name])


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


def validate_config(cfg: DictConfig) -> None:
    """Every check that needs no data: run by the command line before Hydra writes anything, and
    again at the start of a run, before any data loads or any model trains. Beyond the ranges
    here, the attack, defense, trainer and model are built once as a dry run against what the
    dataset's config says about its data (classes, image shape, class counts: datasets/spec.py),
    so their own checks (names, ranges, files, timm model names, attack x dataset) refuse now."""
    checks.integer("", "seed", cfg.seed, 0)
    checks.integer("trainer", "epochs", cfg.trainer.epochs, 0)
    if cfg.attack.get("poison_rate") is not None:  # absent: the attack has no poison rate
        checks.number("attack", "poison_rate", cfg.attack.poison_rate, 0, 1, low_open=True)
    target = cfg.attack.get("target")
    # The dry build below checks the upper bound, where the dataset's number of classes is known.
    if target is not None and (not checks.is_integer(target) or target < 0):
        raise ConfigError(f"attack.target={target!r} is out of range; use an integer class index >= 0")
    checks.integer("eval", "stealth_images", cfg.eval.stealth_images, 0, hint="0 = skip")
    _check_pgd(cfg.eval.pgd)
    _check_reactivation(cfg)
    _check_device(cfg.device)
    _dry_build(cfg)
    ensure_writable_dir(cfg.results_dir)  # last: it makes the folder, which a refused run must not


def _check_pgd(pgd: DictConfig) -> None:
    """The PGD settings, checked even while PGD is off (turning it on later must not fail late)."""
    check_settings(eps=pgd.eps, steps=pgd.steps, step_size=pgd.step_size, rel_step_size=pgd.get("rel_step_size"),
                   losses=pgd.get("losses", ["ce"]), transfer_from=pgd.get("transfer_from"))
    checks.integer("eval.pgd", "images", pgd.images, 1)
    checks.integer("eval.pgd", "seed", pgd.seed, 0)


def reactivation_budgets(node: DictConfig) -> tuple[RetuningBudget, ProbeBudget]:
    """The `eval.reactivation` settings as the two budgets; each bad value is one ConfigError line."""
    settings = OmegaConf.to_container(node, resolve=True)
    probe = settings.pop("probe")
    for key in ("enabled", "reference"):
        settings.pop(key)
    return RetuningBudget(**settings), ProbeBudget(**probe)


def _check_reactivation(cfg: DictConfig) -> None:
    """The reactivation settings, checked even while off (as PGD's), and, where the dataset's config
    says how many training samples there are, whether the retuning set can hold its poison."""
    budget, _ = reactivation_budgets(cfg.eval.reactivation)
    spec = dataset_spec(cfg.dataset)
    labels = spec.train_labels() if spec is not None else None
    if labels is not None:
        budget.set_size(len(labels))


def run_config_hash(config: dict[str, Any], drop: tuple[str, ...] = ()) -> str:
    """The run id's hash: `config_hash` without the non-result keys, and without `eval.reactivation`
    while it is off (and trainer keys at their inert defaults), so that a run without the stage keeps
    the id it had before the stage existed."""
    reactivation = (config.get("eval") or {}).get("reactivation") or {}
    off = () if reactivation.get("enabled") else ("eval.reactivation",)
    return config_hash(config, NON_RESULT_KEYS + off + inert_trainer_keys(config) + drop)


def _check_device(device: str) -> None:
    """The device's spelling only: whether a GPU is visible is checked where the run executes (a
    Slurm job's node, not the login node that submits it)."""
    if device == "auto":
        return
    try:
        torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"device={device!r} is not a device; use auto, cpu, cuda or cuda:N") from exc


def _dry_build(cfg: DictConfig) -> None:
    """Build attack, defense, trainer and model from `cfg` without data, and check how many samples
    the attack may poison when the dataset's class counts are known; the objects are discarded.
    Nothing is drawn from the global random state (the run's streams stay as without this)."""
    spec = dataset_spec(cfg.dataset)
    if spec is None:  # a loader we know nothing about: its data answers these checks later
        return
    with torch.random.fork_rng(devices=[]):
        attack = build(cfg.attack, num_classes=spec.num_classes, image_shape=spec.image_shape)
        labels = spec.train_labels()
        if labels is not None:
            attack.poison_indices(labels, torch.Generator().manual_seed(0))
        if cfg.defense is not None:
            build(cfg.defense)
        if distributed.launched_world_size() <= 1:
            # Under torchrun building a Trainer joins the process group, with the run's device only.
            build(cfg.trainer, device="cpu", crop_padding=cfg.dataset.get("crop_padding", 0), hflip=False,
                  min_precision=attack.min_precision)
        channels, height, _ = spec.image_shape
        with torch.device("meta"), warnings.catch_warnings():  # shapes and names only: no memory, no init
            # model.weights are read and checked against the shapes; copying them into meta tensors
            # does nothing, and torch says so once per tensor
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")
            build(cfg.model, in_channels=channels, num_classes=spec.num_classes, image_size=height)


@contextmanager
def timed(timings: dict[str, float], stage: str):
    start = time.perf_counter()
    yield
    timings[stage] = round(time.perf_counter() - start, 4)


@functools.lru_cache(maxsize=1)
def git_commit() -> dict[str, Any]:
    """The commit (and dirtiness) of the code when this process first asked: a multirun keeps
    running the modules it imported, so a commit made meanwhile must not be credited with its runs."""
    root = Path(backdoorbench.__file__).resolve().parent.parent
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit, "git_dirty": bool(status) if status is not None else None}


def _program() -> str:
    name = Path(sys.argv[0]).name
    return "python -m backdoorbench" if name == "__main__.py" else name


def _cpu_model() -> str:
    """The processor's model name (Linux /proc/cpuinfo; elsewhere platform.processor()), or ""."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def environment(device: torch.device) -> dict[str, Any]:
    import numpy
    import torchvision

    name = str(device)
    if device.type == "cuda":
        name = f"{device} ({torch.cuda.get_device_name(device)})"
    return {
        "backdoorbench": backdoorbench.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "numpy": numpy.__version__,
        **dict(git_commit()),
        "device": name,
        "torch_threads": torch.get_num_threads(),
        # the vector ISA torch's CPU kernels use (ATEN_CPU_CAPABILITY can lower it) and the processor:
        # CPU numbers repeat to the bit on the same ISA; another one rounds differently, and a chaotic
        # defense (NAD) then moves by points at the same seed (docs/fidelity.md#reproducibility)
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": _cpu_model(),
        "world_size": distributed.world_size(),  # processes of a torchrun (DDP) run, else 1
        "platform": platform.platform(),
        "command": " ".join([_program(), *sys.argv[1:]]),
    }


def build(node: Any, **kwargs: Any) -> Any:
    """hydra.utils.instantiate, but a UserError raised by the target surfaces as itself, so the
    command line can print its one line instead of Hydra's wrapped traceback."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__
        while cause is not None and not isinstance(cause, UserError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        unknown = re.search(r"unexpected keyword argument '(\w+)'", str(exc.__cause__))
        if isinstance(exc.__cause__, TypeError) and unknown and OmegaConf.is_config(node) and unknown[1] in node:
            key = f"{node._get_full_key(None)}.{unknown[1]}"  # e.g. added with +trainer.foo=1
            raise ConfigError(f"{key} is not a setting of {node._target_}; remove it "
                              "(`python -m backdoorbench --cfg job` lists the settings)") from None
        raise


def build_attack(node: DictConfig, data: ImageDataset) -> Attack:
    """The attack for `data`: its classes, image shape and name (Input-aware's normaliser is per dataset)."""
    return build(node, num_classes=data.num_classes, image_shape=data.image_shape, dataset=data.name)


def build_model(cfg: DictConfig, data: ImageDataset, **overrides: Any) -> Normalized:
    """A fresh model of the configured architecture; `overrides` go to its constructor."""
    channels, height, _ = data.image_shape
    net = build(cfg.model, in_channels=channels, num_classes=data.num_classes, image_size=height, **overrides)
    return Normalized(net, data.mean, data.std)


def _pgd_images(data: ImageDataset, pgd_cfg: DictConfig):
    """`pgd_cfg.images` test images: all of them when there are no more, else a seeded choice
    (not the first N: mnist5k's test split is sorted by class, so its first 50 are all zeros)."""
    count = min(pgd_cfg.images, len(data.test))
    if count == len(data.test):
        pick = torch.arange(count)
    else:
        pick = torch.randperm(len(data.test), generator=torch.Generator().manual_seed(pgd_cfg.seed))[:count].sort().values
    test = data.test.subset(pick)
    return test.float_images(), test.labels


def measure_pgd(model, data: ImageDataset, pgd_cfg: DictConfig, device: torch.device, *, keep_examples: bool = False):
    """L_inf PGD on `pgd_cfg.images` clean test images (`_pgd_images`), at every eps and loss of
    `pgd_cfg`: the metrics to record (`pgd`: a row per loss and eps; `pgd_acc` too when eps is
    one number and ce is among the losses, as before eps lists) and the adversarial images
    (with `keep_examples`, for a transfer attack)."""
    images, labels = _pgd_images(data, pgd_cfg)
    rows, examples = robustness_curve(
        model, images, labels, eps=eps_list(pgd_cfg.eps), losses=list(pgd_cfg.get("losses", ["ce"])),
        steps=pgd_cfg.steps, step_size=pgd_cfg.step_size, rel_step_size=pgd_cfg.get("rel_step_size"),
        random_start=pgd_cfg.get("random_start", True), seed=pgd_cfg.seed, device=device, keep_examples=keep_examples)
    for row in masking_suspects(rows):
        log.warning("PGD (%s) leaves %.1f%% accuracy at eps %g: at that radius a working attack leaves ~0; "
                    "suspect gradient masking, not robustness", row["loss"], 100 * row["acc"], row["eps"])
    metrics: dict[str, Any] = {"pgd": rows}
    single = [r["acc"] for r in rows if r["loss"] == "ce"]
    if checks.is_number(pgd_cfg.eps) and single:
        metrics["pgd_acc"] = single[0]
    return metrics, examples


PGD_MEMO_FORMAT = "backdoorbench-pgd-memo-1"


def pgd_memo_path(victim: dict[str, Any], pgd_cfg: DictConfig, device: torch.device, keep_examples: bool) -> Path | None:
    """Where the attacked model's PGD results are kept beside its victim-cache entry
    (`<key>.pgd-<digest>.pt`, the digest over eval.pgd and the device type), or None without a cache."""
    if not victim.get("path"):
        return None
    material = {"format": PGD_MEMO_FORMAT, "pgd": OmegaConf.to_container(pgd_cfg, resolve=True),
                "keep_examples": bool(keep_examples), "device": device.type}
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]
    entry = Path(victim["path"])
    return entry.with_name(f"{entry.stem}.pgd-{digest}.pt")


def attacked_pgd(model, data: ImageDataset, pgd_cfg: DictConfig, device: torch.device, victim: dict[str, Any], *,
                 keep_examples: bool = False) -> tuple[dict[str, Any], dict, str]:
    """`measure_pgd` on the attacked model, memoised beside its victim-cache entry: a sweep over
    defenses (or over a defense's settings) attacks one cached victim once, not once per run. PGD
    draws its random starts from eval.pgd.seed, so a recomputation on the same weights gives the
    same numbers on the CPU. Returns (metrics, adversarial images, memo state: "off" without the
    victim cache, "hit" when read, "saved" when computed and kept)."""
    path = pgd_memo_path(victim, pgd_cfg, device, keep_examples) if distributed.is_main() else None
    if path is not None and victim.get("cache") == "hit" and path.exists():
        try:
            entry = torch_load(path, map_location="cpu")
            if not isinstance(entry, dict) or entry.get("format") != PGD_MEMO_FORMAT:
                raise ValueError(f"not a {PGD_MEMO_FORMAT} file")
            examples = {(str(loss), float(eps)): images for loss, eps, images in entry["examples"]}
            log.info("PGD on the attacked model from %s (computed with its victim)", path)
            return json.loads(entry["metrics"]), examples, "hit"
        except Exception as exc:  # truncated or foreign file: compute again and overwrite it
            log.warning("PGD memo %s is unusable (%s); attacking the model again", path, type(exc).__name__)
    metrics, examples = measure_pgd(model, data, pgd_cfg, device, keep_examples=keep_examples)
    if path is None:
        return metrics, examples, "off"
    atomic_torch_save({"format": PGD_MEMO_FORMAT, "metrics": json.dumps(metrics),
                       "examples": [(loss, eps, images) for (loss, eps), images in examples.items()]}, path)
    return metrics, examples, "saved"


@torch.no_grad()
def measure_stealth(attack: Attack, data: ImageDataset, eval_cfg: DictConfig, device: torch.device):
    """Stealth metrics of `apply_trigger` on a fixed, seeded set of test images, and a few
    clean/poisoned pairs for the logger's image grid."""
    count = min(eval_cfg.stealth_images, len(data.test))
    if count < 1 or getattr(attack, "triggerless", False):  # attack=none: nothing to measure
        return None, None
    pick = torch.randperm(len(data.test), generator=torch.Generator().manual_seed(eval_cfg.stealth_seed))[:count]
    clean = data.test.subset(pick.sort().values).float_images()
    poisoned = torch.cat([attack.apply_trigger(chunk.to(device)).cpu() for chunk in clean.split(1024)])
    stealth = stealth_metrics(clean, poisoned, lpips_weights=eval_cfg.lpips_weights, device=device)
    # the examples (logger grid, gallery, GradCAM): one test image of each class but the first target
    # in turn, in the seeded order, so the poisoned versions can show the backdoor's effect
    labels = data.test.labels[pick]
    target = getattr(attack, "target", None)
    examples, seen = [], set()
    for position, label in enumerate(labels.tolist()):
        if label != target and label not in seen:
            examples.append(position)
            seen.add(label)
        if len(examples) == 8:
            break
    for position in range(len(labels)):  # too few classes among the picks: fill up to 8 in order
        if len(examples) >= min(8, count):
            break
        if position not in examples:
            examples.append(position)
    rank = torch.argsort(pick.sort().indices)  # position in `pick` -> row of the sorted `clean`
    rows = rank[torch.tensor(examples, dtype=torch.long)] if examples else torch.arange(min(8, count))
    return stealth, torch.cat([clean[rows], poisoned[rows]])


def remove_checkpoints(folder: Path) -> None:
    """Per-epoch checkpoints exist only to resume an unfinished training; drop them once safe."""
    shutil.rmtree(folder, ignore_errors=True)
    with suppress(OSError):
        folder.parent.rmdir()  # when no other run is unfinished


PREPARE_FORMAT = "backdoorbench.prepare_checkpoint.v1"


def prepare_attack(attack: Attack, checkpoint: Path, *, trainer, train, generator: torch.Generator, build_model) -> None:
    """`attack.prepare(...)`, or its result restored from `checkpoint` when a killed run already
    computed it (e.g. Input-aware's mask pre-training). What prepare leaves behind (its result,
    the global RNG state that the victim's initialization draws from next, its logged epochs) is
    saved there when the attack has a `prepare_state`, so the resumed run goes on exactly."""
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
    attack.prepare(trainer=trainer, train=train, generator=generator, build_model=build_model)
    prepared = attack.prepare_state()
    if prepared is not None and distributed.is_main():
        atomic_torch_save({"format": PREPARE_FORMAT, "attack_name": attack.name, "attack": prepared,
                           "torch_rng": torch.get_rng_state(), "generator": generator.get_state()}, checkpoint)


def obtain_victim(cfg: DictConfig, config: dict[str, Any], run_id: str, data: ImageDataset, attack: Attack,
                  trainer, timings: dict[str, float], results_dir: Path) -> tuple[dict[str, Any], Any, Normalized]:
    """The attacked model: from the victim cache when an identical one was trained before (the
    attack's state restored with it), else prepared, poisoned and trained here (and cached).
    Returns (the record's `victim` block, the poisoned training data, the model)."""
    seed = cfg.seed
    key = victim_key(config, trainer.device)
    cache = VictimCache(Path(cfg.cache_dir).expanduser() if cfg.cache_dir else results_dir / "cache" / "victims", key) \
        if cfg.cache else None
    # Under torchrun the run's processes are one user of the cache: rank 0 alone locks, looks and
    # writes; the others read the entry only once rank 0 found it (a lock per process would
    # deadlock them against the training's collectives).
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
                           generator=stream(seed, "attack"), build_model=lambda **kwargs: build_model(cfg, data, **kwargs))
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


def run(cfg: DictConfig, overrides: list[str] | None = None) -> tuple[RunRecord, Path | None]:
    """Run one resolved config end to end; return the record and the path it was written to.
    Under torchrun every process runs it, and only rank 0 writes (the others get path None)."""
    validate_config(cfg)
    git_commit()  # read now: the commit this process's code came from, even if HEAD moves later
    config = OmegaConf.to_container(cfg, resolve=True)
    run_id = run_config_hash(config)
    group_id = run_config_hash(config, ("seed",))
    results_dir = Path(cfg.results_dir).expanduser()
    seed = cfg.seed
    timings: dict[str, float] = {}
    started = time.perf_counter()
    torch.manual_seed(seed)
    with timed(timings, "data"):
        data: ImageDataset = build(cfg.dataset)
    attack = build_attack(cfg.attack, data)
    defense: Defense | None = build(cfg.defense) if cfg.defense is not None else None
    trainer = build(cfg.trainer, device=cfg.device, crop_padding=data.crop_padding, hflip=data.hflip,
                    min_precision=attack.min_precision)
    # The logger starts (and may write, e.g. wandb's folder) once everything that can refuse the
    # run without training has.
    logger = build(cfg.logger) if cfg.logger is not None and distributed.is_main() else None
    if logger is not None:
        logger.start(run_id=run_id, group_id=group_id, config=config, results_dir=results_dir)
    trainer.on_epoch = logger.log_epoch if logger is not None else None
    if warning := bf16_warning(attack.name, trainer.precision, attack.min_precision, getattr(attack, "test_eps", None)):
        log.warning("%s", warning)  # once, in one line
    excluded = defense.not_applicable(attack) if defense is not None else None  # the threat models' pairing
    protocol = protocol_name(cfg)
    log.info("run %s: %s on %s, attack %s (%s), defense %s, device %s, precision %s, protocol %s, %d epochs", run_id,
             cfg.model._target_.rsplit(".", 1)[-1], data.name, attack.name, attack.target_mode,
             defense.name if defense else "none", trainer.device, trainer.precision, protocol, trainer.epochs)

    victim, poisoned, model = obtain_victim(cfg, config, run_id, data, attack, trainer, timings, results_dir)
    with timed(timings, "eval_attacked"):
        attacked = evaluate(model, trainer, attack, data.test)
    adversarial: dict = {}  # the attacked model's PGD images, kept for eval.pgd.transfer_from=attacked
    if cfg.eval.pgd.enabled:
        with timed(timings, "pgd_attacked"):
            pgd_metrics, adversarial, victim["pgd_memo"] = attacked_pgd(
                model, data, cfg.eval.pgd, trainer.device, victim,
                keep_examples=cfg.eval.pgd.get("transfer_from") == "attacked")
            attacked.update(pgd_metrics)
    with timed(timings, "stealth"):
        stealth, examples = measure_stealth(attack, data, cfg.eval, trainer.device)
    if logger is not None and examples is not None:
        logger.log_images("clean_vs_poisoned", examples)
    artifacts = example_artifacts(model, examples, trainer) if examples is not None else {}  # figures' data

    defended = der = detection = benign = defense_cost = None
    defense_info: dict[str, Any] = {"name": "none"}
    victim_attack = attack  # the attack as the victim was trained (an in-training defense may retrain its trigger)
    if defense is not None and excluded is not None:  # decided before any defense work: nothing is run
        log.info("defense %s does not apply to %s: %s", defense.name, attack.name, excluded)
        defense_info = {**defense.describe(), "applicable": False, "not_applicable": excluded}
    elif defense is not None:
        if defense.needs_clean_data or defense.clean_fraction > 0:
            subset = clean_subset_indices(len(data.train), poisoned.indices, defense.clean_fraction, stream(seed, "clean_subset"))
        else:  # data-free defenses (CLP) run with no clean sample at all
            subset = torch.zeros(0, dtype=torch.long)

        def train_victim(net, wrap_step=None, train=None):
            attack.train_victim(trainer, net, poisoned.split if train is None else train,
                                stream(seed, "defense_train"), wrap_step=wrap_step)

        ctx = DefenseContext(
            model=model,
            poisoned_train=poisoned.split,
            poisoned_indices=poisoned.indices,
            clean_subset=poisoned.split.subset(subset),
            trainer=trainer,
            num_classes=data.num_classes,
            generator=stream(seed, "defense"),
            build_model=lambda **kwargs: build_model(cfg, data, **kwargs),
            train_victim=train_victim,
        )
        # an in-training defense retrains the attack's learned trigger (Input-aware, LIRA, WB) with its
        # model: the reactivation stage retunes the victim with the trigger the victim was trained with
        if cfg.eval.reactivation.enabled and defense.stage == "in_train":
            victim_attack = copy.deepcopy(attack)
        with timed(timings, "defense"):
            outcome = run_defense(defense, ctx, attack, data.test)
        defended, detection = outcome.defended, outcome.detection
        artifacts.update(outcome.artifacts)
        repaired = outcome.model
        if cfg.eval.pgd.enabled and repaired is not None:
            with timed(timings, "pgd_defended"):
                pgd_metrics, _ = measure_pgd(repaired, data, cfg.eval.pgd, trainer.device)
                if adversarial:  # transfer: the attacked model's adversarial images, on the defended model
                    images, labels = _pgd_images(data, cfg.eval.pgd)
                    pgd_metrics["pgd"] += transfer_accuracy(repaired, images, labels, adversarial, source="attacked",
                                                            device=trainer.device)
                defended.update(pgd_metrics)
        der = defense_effectiveness_rating(attacked, defended)
        defense_cost = outcome.cost
        if getattr(attack, "triggerless", False):  # attack=none: whatever a detector flags is a false positive
            benign = benign_false_positives(defense, outcome, len(poisoned.split))
            if benign is not None:
                benign["ca_drop"] = attacked["clean_acc"] - defended["clean_acc"]
        defense_info = {**defense.describe(), "applicable": True, "clean_subset_size": int(len(subset)),
                        "extras": outcome.extras}
    reactivation = None
    if cfg.eval.reactivation.enabled:
        with timed(timings, "reactivation"):
            reactivation = run_reactivation(cfg, config, run_id, data, attack, trainer, results_dir, model,
                                            repaired if defended is not None else None,
                                            defense_info if defense is not None else None, victim_attack)
    timings["total"] = round(time.perf_counter() - started, 4)

    record = RunRecord(
        run_id=run_id,
        group_id=group_id,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        dataset={
            "name": data.name,
            "num_classes": data.num_classes,
            "image_shape": list(data.image_shape),
            "n_train": len(data.train),
            "n_test": len(data.test),
        },
        model={"name": model.name, "n_params": sum(p.numel() for p in model.parameters())},
        attack={
            **attack.describe(),
            "n_poisoned": int(len(poisoned.indices)),
            "poisoned_indices_sha256": poisoned.indices_sha256,
        },
        defense=defense_info,
        seed=seed,
        metrics={"attacked": attacked, "defended": defended, "der": der, "detection": detection},
        stealth=stealth,
        victim=victim,
        timings_s=timings,
        env={**environment(trainer.device), "precision": trainer.precision},
        config=config,
        overrides=list(overrides or []),
        reactivation=reactivation,
        defense_cost=defense_cost,
        benign=benign,
    )
    if not distributed.is_main():
        return record, None
    # A requeue signal held during the record's write, or arriving after it, finds the run finished:
    # acting on it would run the job again into a second record.
    with interrupts.held():
        path = write_new_record(record, artifacts, results_dir / "runs" / data.name / f"{attack.name}_{attack.target_mode}")
        interrupts.finished()
    remove_checkpoints(results_dir / "checkpoints" / run_id)  # cache off: kept until the record is safe
    if logger is not None:
        logger.log_summary(record.to_dict())
        logger.finish(path)
    return record, path


def clean_victim(cfg: DictConfig, config: dict[str, Any], run_id: str, data: ImageDataset, attack: Attack,
                 trainer, results_dir: Path) -> Normalized:
    """The `attack=none` victim of the run's setting (same dataset, model, trainer, seed, target rule):
    from the victim cache, or trained here and cached, as `python -m backdoorbench attack=none` would."""
    clean_attack = {"_target_": "backdoorbench.attacks.none.NoAttack", "target_mode": attack.target_mode,
                    "target": cfg.attack.get("target", 0) if cfg.attack.get("target") is not None else 0,
                    "poison_rate": None}
    clean_config = {**config, "attack": clean_attack}
    clean_cfg = OmegaConf.create(clean_config)
    none = build(clean_cfg.attack, num_classes=data.num_classes, image_shape=data.image_shape)
    on_epoch, trainer.on_epoch = trainer.on_epoch, None  # its epochs are not this run's
    try:
        with torch.random.fork_rng(devices=[]):  # the run's own draws stay as without the probe
            _, _, model = obtain_victim(clean_cfg, clean_config, f"{run_id}-clean", data, none, trainer, {}, results_dir)
    finally:
        trainer.on_epoch = on_epoch
    return model


def run_reactivation(cfg: DictConfig, config: dict[str, Any], run_id: str, data: ImageDataset, attack: Attack, trainer,
                     results_dir: Path, victim: Normalized, repaired, defense_info: dict[str, Any] | None,
                     victim_attack: Attack | None = None) -> dict[str, Any]:
    """The record's `reactivation` block (backdoorbench.metrics.reactivation): RA and QRA on the model
    the defense returned (on the victim when there is no defense), RA on the victim as the reference,
    with `victim_attack`'s trigger (the attack as the victim was trained, before an in-training
    defense retrained it; default `attack`)."""
    budget, probe = reactivation_budgets(cfg.eval.reactivation)
    if getattr(attack, "triggerless", False):  # attack=none: there is no trigger to re-learn
        return {"protocol": "skipped", "skipped": "attack=none has no trigger to reactivate"}
    if defense_info is None:
        subject, subject_is, reference = victim, "attacked", None
    elif repaired is not None:
        subject, subject_is = repaired, "defended"
        reference = victim if cfg.eval.reactivation.reference else None
    else:  # an input-level detector, or a defense that does not apply: the model is the victim itself
        why = defense_info.get("not_applicable") or f"defense {defense_info['name']} returns no model to retune"
        subject, subject_is, reference = victim, "attacked", None
        log.info("reactivation: %s; measured on the undefended victim only", why)
    block = measure_reactivation(
        subject=subject, subject_is=subject_is, reference=reference, trainer=trainer, attack=attack, train=data.train,
        test=data.test, budget=budget, probe=probe, generator=stream(cfg.seed, "reactivation"), reference_attack=victim_attack,
        clean_model=lambda: clean_victim(cfg, config, run_id, data, attack, trainer, results_dir))
    if subject_is == "attacked" and defense_info is not None:
        block["note"] = why
    return block


def write_new_record(record: RunRecord, artifacts: dict[str, Any], folder: Path) -> Path:
    """Write the record (and its artifacts first, so it never names a missing file) under the first
    free repeat of its run id in `folder`; return its path. Nothing of another run is replaced:
    a name taken meanwhile (the same config finishing at the same moment elsewhere) moves this
    run on to the next repeat."""
    while True:
        record.repeat = next_repeat(folder, record.run_id)
        path = repeat_path(folder, record.run_id, record.repeat)
        written = None
        try:
            record.artifacts = written = write_beside_record(path, artifacts)
            return save_record(record, path, exclusive=True)
        except FileExistsError:
            if written is not None:
                (folder / written).unlink(missing_ok=True)  # ours: the record that claimed the name is not
            continue
        except StorageError:  # the disk filled between the artifacts and the record: leave neither
            if written is not None:
                with suppress(OSError):
                    (folder / written).unlink(missing_ok=True)
            raise


def reactivation_lines(block: dict[str, Any] | None) -> list[str]:
    """The summary's lines for the reactivation stage: ASR before and after the retuning attack, per model."""
    if not block:
        return []
    if "skipped" in block:
        return [f"reactivation: skipped ({block['skipped']})"]
    budget = block["budget"]
    lines = [f"reactivation (retuning attack: {budget['poison_count']} poisoned of {budget['set_size']} samples, "
             f"{budget['steps']} steps, lr {budget['lr']:g}):"]
    for name in ("defended", "attacked"):
        curve = block.get(name)
        if curve is None:
            continue
        probe = curve.get("probe")
        extra = f"; query-based probe ASR {probe['asr']:.2%} (clean model {probe['asr_clean_model']:.2%})" if probe else ""
        lines.append(f"  {name}: ASR {curve['asr'][0]:.2%} -> {curve['asr'][-1]:.2%}, CA {curve['ca'][0]:.2%} -> "
                     f"{curve['ca'][-1]:.2%}{extra}")
    return lines


def summary_table(record: RunRecord, path: Path) -> str:
    """The short table printed at the end of a run."""
    rows = [("attacked", record.metrics["attacked"])]
    if record.metrics["defended"] is not None:
        rows.append((f"defended ({record.defense['name']})", record.metrics["defended"]))
    width = max(len(name) for name, _ in rows)
    lines = [f"{'model':<{width}}  {'CA':>7}  {'ASR':>7}  {'RA':>7}"]
    for name, m in rows:
        lines.append(f"{name:<{width}}  {m['clean_acc']:>7.2%}  {m['asr']:>7.2%}  {m['ra']:>7.2%}")
    if record.metrics["der"] is not None:
        lines.append(f"DER {record.metrics['der']:.4f}")
    if record.defense.get("applicable") is False:
        lines.append(f"defense {record.defense['name']}: not applicable ({record.defense['not_applicable']})")
    lines += reactivation_lines(record.reactivation)
    attack = record.attack
    target = f" target {attack['target']}" if attack["target"] is not None else ""
    # Data-poisoning attacks rewrite at least one training sample (a rate that poisons none is an
    # error); training-controlled ones (WaNet, IAD, LIRA, WB) rewrite none and poison a share of
    # each batch; attack=none has rate 0.
    per_batch = attack["n_poisoned"] == 0 and attack["poison_rate"] > 0
    share = "of each batch" if per_batch else f"({attack['n_poisoned']} samples)"
    protocol = protocol_name(record.config)
    lines.insert(0, f"{attack['name']} {attack['target_mode']}{target}, poison rate {attack['poison_rate']} "
                    f"{share} on {record.dataset['name']} / {record.model['name']}, seed {record.seed}, "
                    f"{protocol} protocol, {record.env.get('precision', 'fp32')}")
    victim = record.victim or {}
    if victim.get("cache") == "hit":
        trained = f"victim from the cache, trained before in {victim['train_s']:.1f} s"
    else:
        trained = f"train {record.timings_s['train']:.1f} s"
    lines.append(f"time {record.timings_s['total']:.1f} s ({trained}) on {record.env['device']}")
    lines.append(f"record: {path}")
    return "\n".join(lines)
