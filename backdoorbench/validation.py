"""The checks of a run's config that need no data: run by the command line before Hydra writes
anything, and again at the start of a run, before any data loads or any model trains."""

from __future__ import annotations

import warnings

import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from backdoorbench import checks, distributed, registry
from backdoorbench.datasets.spec import dataset_spec
from backdoorbench.config import victim_overrides, victim_trainer_node
from backdoorbench.errors import ConfigError
from backdoorbench.factory import build
from backdoorbench.fileio import ensure_writable_dir
from backdoorbench.metrics.lpips_weights import check_lpips_setting
from backdoorbench.metrics.reactivation import ProbeBudget, RetuningBudget
from backdoorbench.metrics.robustness import check_settings


def validate_config(cfg: DictConfig) -> None:
    """Every check that needs no data: run by the command line before Hydra writes anything, and
    again at the start of a run, before any data loads or any model trains. Beyond the ranges
    here, the attack, defense, trainer and model are built once as a dry run against what the
    dataset's config says about its data (classes, image shape, class counts: datasets/spec.py),
    so their own checks (names, ranges, files, timm model names, attack x dataset) refuse now."""
    checks.integer("", "seed", cfg.seed, 0)
    checks.integer("trainer", "epochs", cfg.trainer.epochs, 0)
    _check_victim_trainer(cfg)
    if cfg.attack.get("poison_rate") is not None:  # absent: the attack has no poison rate
        checks.number("attack", "poison_rate", cfg.attack.poison_rate, 0, 1, low_open=True)
    target = cfg.attack.get("target")
    # The dry build below checks the upper bound, where the dataset's number of classes is known.
    if target is not None and (not checks.is_integer(target) or target < 0):
        raise ConfigError(f"attack.target={target!r} is out of range; use an integer class index >= 0")
    checks.integer("eval", "stealth_images", cfg.eval.stealth_images, 0, hint="0 = skip")
    check_lpips_setting(cfg.eval.lpips)
    _check_detection_only(cfg)
    _check_pgd(cfg.eval.pgd)
    _check_reactivation(cfg)
    _check_device(cfg.device)
    _dry_build(cfg)
    ensure_writable_dir(cfg.results_dir)  # last: it makes the folder, which a refused run must not


def _check_victim_trainer(cfg: DictConfig) -> None:
    """`victim_trainer.epochs`, when set, as `trainer.epochs` (the schema admits trainer keys only)."""
    epochs = victim_overrides(cfg).get("epochs")
    if epochs is not None:
        checks.integer("victim_trainer", "epochs", epochs, 0)


def _check_detection_only(cfg: DictConfig) -> None:
    """`eval.detection_only=true` needs a defense that detects (its class says so: `is_detector`)."""
    if not cfg.eval.get("detection_only", False):
        return
    detectors = ", ".join(name for name, cls in registry.classes("defense").items() if cls.is_detector())
    if cfg.defense is None:
        raise ConfigError(f"eval.detection_only=true needs a detecting defense, and defense is none; choose one of: "
                          f"{detectors}")
    defense = get_class(cfg.defense._target_)
    if not defense.is_detector():
        raise ConfigError(f"eval.detection_only=true needs a detecting defense; defense={defense.name} "
                          f"({defense.stage.replace('_', '-')}) repairs and detects nothing; choose one of: {detectors}")


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
        defense = build(cfg.defense) if cfg.defense is not None else None
        if distributed.launched_world_size() <= 1:
            # Under torchrun building a Trainer joins the process group, with the run's device only.
            for node in (cfg.trainer, victim_trainer_node(cfg)) if victim_overrides(cfg) else (cfg.trainer,):
                build(node, device="cpu", crop_padding=cfg.dataset.get("crop_padding", 0), hflip=False,
                      min_precision=attack.min_precision)
        channels, height, _ = spec.image_shape
        with torch.device("meta"), warnings.catch_warnings():  # shapes and names only: no memory, no init
            # model.weights are read and checked against the shapes; copying them into meta tensors
            # does nothing, and torch says so once per tensor
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter")
            model = build(cfg.model, in_channels=channels, num_classes=spec.num_classes, image_size=height)
            if defense is not None:
                defense.check_model(model)  # e.g. a pruning defense that needs batch norm
