"""Typed schema of the top-level config and the trainer, registered with Hydra's ConfigStore.

Hydra checks overrides against these types at composition, so `seed=abc` or
`trainer.epochs=ten` fail before anything runs. Import this module before composing. What of a
resolved config identifies a run (the run id) is `backdoorbench.run_keys`, re-exported here.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from backdoorbench.run_keys import (NON_RESULT_KEYS, config_hash, inert_keys, protocol_name,  # noqa: F401
                                    run_config_hash, set_victim_keys)

GROUPS = ("dataset", "model", "attack", "defense", "trainer", "logger", "protocol", "paper", "experiment")


@dataclass
class TrainerSchema:
    _target_: str = "backdoorbench.train.Trainer"
    epochs: int = 10
    batch_size: int = 128
    eval_batch_size: int = 1024
    optimizer: Any = MISSING
    schedule: str = "cosine"
    milestones: list[float] = field(default_factory=lambda: [0.5, 0.75])
    gamma: float = 0.1  # multistep's factor at each milestone; plateau's factor (ReduceLROnPlateau)
    schedule_period: Optional[int] = None  # cosine's half period in epochs (CosineAnnealingLR T_max); null = the run's
    plateau_patience: int = 10  # plateau: epochs without a lower training loss before the lr drops
    augment: bool = True
    precision: str = "auto"  # auto, bf16, tf32 or fp32 (backdoorbench/precision.py)
    rotation: float = 0.0
    rotation_p: float = 0.5
    channels_last: bool = True
    compile: bool = False
    progress: bool = True


@dataclass
class VictimTrainerSchema:
    """Trainer keys that hold for the victim's training only; null = the trainer's value (and an
    empty `milestones`: a list node, since an interpolation into a null list would resolve while
    Hydra composes; a victim-only schedule without milestones is `schedule: constant`)."""
    epochs: Optional[int] = None
    batch_size: Optional[int] = None
    schedule: Optional[str] = None
    milestones: list[float] = field(default_factory=list)
    gamma: Optional[float] = None
    schedule_period: Optional[int] = None
    plateau_patience: Optional[int] = None
    augment: Optional[bool] = None
    rotation: Optional[float] = None
    rotation_p: Optional[float] = None


@dataclass
class PgdSchema:
    enabled: bool = False  # L_inf PGD robust accuracy of the attacked (and defended) model
    eps: Any = 0.3  # pixel units, one radius or a list; 0.3 is the usual MNIST radius
    steps: int = 40
    step_size: Optional[float] = None  # pixel units; null = rel_step_size * eps
    rel_step_size: Optional[float] = None  # a fraction of eps (foolbox's rel_stepsize); null = 2.5 / steps
    random_start: bool = True  # uniform in the eps-ball
    losses: list[str] = field(default_factory=lambda: ["ce"])  # ce (cross-entropy), cw (Carlini-Wagner margin)
    transfer_from: Optional[str] = None  # attacked: also attack the defended model with the attacked model's examples
    images: int = 1000  # test images: all when there are no more, else a choice seeded by `seed`
    seed: int = 0


@dataclass
class ProbeSchema:
    enabled: bool = True  # the query-based reactivation probe (QRA); needs the attack=none victim (cached)
    eps: float = 0.06274509803921569  # 16/255, L_inf in pixel units
    epochs: int = 50
    alpha: float = 0.2
    clean_count: int = 500
    poison_count: int = 500
    lr: float = 0.1
    batch_size: int = 128
    hidden: int = 1024


@dataclass
class ReactivationSchema:
    enabled: bool = False  # post-purification robustness (Min et al., NeurIPS 2024), record["reactivation"]
    clean_fraction: float = 0.02
    poison_count: int = 5
    epochs: int = 5
    lr: float = 0.01
    batch_size: int = 128
    eval_every: int = 1
    reference: bool = True  # also retune the undefended victim, as the reference curve
    probe: ProbeSchema = field(default_factory=ProbeSchema)


@dataclass
class EvalSchema:
    stealth_images: int = 1000  # test images, a fixed seeded choice, for PSNR/SSIM/LPIPS/L_inf/L_2
    stealth_seed: int = 0  # fixed, not the run seed, so every run is measured on the same images
    lpips: str = "auto"  # LPIPS's AlexNet weights: auto (torch hub's cache, downloaded once), off, or a file's path
    # a detector is scored and nothing else: no retraining on the kept samples, no defended CA/ASR
    # (the record says so); left out of the run id while false
    detection_only: bool = False
    pgd: PgdSchema = field(default_factory=PgdSchema)
    reactivation: ReactivationSchema = field(default_factory=ReactivationSchema)


@dataclass
class RunSchema:
    dataset: Any = MISSING
    model: Any = MISSING
    attack: Any = MISSING
    defense: Any = None
    trainer: TrainerSchema = MISSING
    # Trainer keys that hold for the victim's training only (an attack's own schedule in its official
    # code, set by conf/protocol_attack/): the defenses, the clean control and reactivation train with
    # `trainer` as it is. Empty = the victim trains with `trainer` too.
    victim_trainer: VictimTrainerSchema = field(default_factory=VictimTrainerSchema)
    protocol: Any = None  # the training protocol (conf/protocol/): name, source, per-dataset method values
    logger: Any = None
    eval: EvalSchema = field(default_factory=EvalSchema)
    seed: int = 0
    device: str = "auto"
    results_dir: str = "outputs"  # never the committed results/: those are made with results_dir=results
    cache: bool = True  # reuse a victim trained before with the same dataset/model/attack/trainer/seed
    cache_dir: Optional[str] = None  # null = <results_dir>/cache/victims


def victim_overrides(config: Any) -> dict[str, Any]:
    """The keys `victim_trainer` sets (not null), resolved: what the victim trains with beyond `trainer`."""
    victim = config.get("victim_trainer")
    if victim is None:
        return {}
    if OmegaConf.is_config(victim):
        victim = OmegaConf.to_container(victim, resolve=True)
    return set_victim_keys({"victim_trainer": victim})


def victim_trainer_node(cfg: Any) -> Any:
    """The victim's trainer config: `trainer` with the victim-only keys of `victim_trainer` on top,
    both resolved against the whole config first (their interpolations name `trainer.epochs`)."""
    return OmegaConf.create({**OmegaConf.to_container(cfg.trainer, resolve=True), **victim_overrides(cfg)})


# conf/hydra/launcher/{joblib,submitit_local,submitit_slurm}.yaml carry the plugins' own names on
# purpose, so `hydra/launcher=joblib` means what the plugins document, and Hydra 1.3 still checks
# them against the plugins' schemas of the same name; it warns about that match on every sweep.
# Each file lists every field, so it stands alone once Hydra drops the matching.
def ignore_launcher_schema_match() -> None:
    warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/\w+' is validated against ConfigStore schema",
                            category=UserWarning)


ignore_launcher_schema_match()


def epoch_fractions(milestones: Any, epochs: Any, fallback: Any = None) -> list[float]:
    """`${epoch_fractions:[100,200],${trainer.epochs}}`: milestones given in epochs, as an official
    MultiStepLR states them, as the fractions of the run that `trainer.milestones` holds (a
    milestone at or past the last epoch never steps, as there). A null `epochs` takes `fallback`:
    `${epoch_fractions:[100],${victim_trainer.epochs},${trainer.epochs}}`."""
    epochs = fallback if epochs is None else epochs
    return [float(m) / max(int(epochs), 1) for m in milestones]


if not OmegaConf.has_resolver("epoch_fractions"):
    OmegaConf.register_new_resolver("epoch_fractions", epoch_fractions)

store = ConfigStore.instance()
store.store(name="run_schema", node=RunSchema)
store.store(group="trainer", name="_schema", node=TrainerSchema)
