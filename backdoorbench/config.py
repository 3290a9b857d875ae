"""Typed schema of the top-level config and the trainer, registered with Hydra's ConfigStore.

Hydra checks overrides against these types at composition, so `seed=abc` or
`trainer.epochs=ten` fail before anything runs. Import this module before composing.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from backdoorbench import help_page

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
    lpips_weights: Optional[str] = None  # AlexNet ImageNet weights file; null = torch hub cache
    pgd: PgdSchema = field(default_factory=PgdSchema)
    reactivation: ReactivationSchema = field(default_factory=ReactivationSchema)


@dataclass
class RunSchema:
    dataset: Any = MISSING
    model: Any = MISSING
    attack: Any = MISSING
    defense: Any = None
    trainer: TrainerSchema = MISSING
    protocol: Any = None  # the training protocol (conf/protocol/): name, source, per-dataset method values
    logger: Any = None
    eval: EvalSchema = field(default_factory=EvalSchema)
    seed: int = 0
    device: str = "auto"
    results_dir: str = "outputs"  # never the committed results/: those are made with results_dir=results
    cache: bool = True  # reuse a victim trained before with the same dataset/model/attack/trainer/seed
    cache_dir: Optional[str] = None  # null = <results_dir>/cache/victims


# Keys that change where or how a run reports, never what it computes; left out of the run id.
# `protocol` names the recipe and holds per-dataset method values, which reach the run through the
# attack's and trainer's own keys (those are in the id).
NON_RESULT_KEYS = ("results_dir", "logger", "trainer.progress", "eval.lpips_weights", "cache", "cache_dir", "protocol")


def protocol_name(config: Any) -> str:
    """The training protocol a config (or a record's) ran: `protocol.name`; a config from before
    protocols existed trained with today's quick recipe."""
    protocol = config.get("protocol") or {}
    return str(protocol.get("name") or "quick")


def inert_trainer_keys(config: dict[str, Any]) -> tuple[str, ...]:
    """Trainer keys added later that play no part at their defaults: left out of the run id and the
    victim key, so a run that does not use them keeps the id and the cached victim it had before."""
    trainer = config.get("trainer") or {}
    inert = []
    if trainer.get("schedule_period") is None:
        inert.append("trainer.schedule_period")
    if trainer.get("schedule") != "plateau":
        inert.append("trainer.plateau_patience")
    return tuple(inert)

# conf/hydra/launcher/{joblib,submitit_local,submitit_slurm}.yaml carry the plugins' own names on
# purpose, so `hydra/launcher=joblib` means what the plugins document, and Hydra 1.3 still checks
# them against the plugins' schemas of the same name; it warns about that match on every sweep.
# Each file lists every field, so it stands alone once Hydra drops the matching.
def ignore_launcher_schema_match() -> None:
    warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/\w+' is validated against ConfigStore schema",
                            category=UserWarning)


ignore_launcher_schema_match()
help_page.register()  # the config-group listing of --help (conf/hydra/help/backdoorbench.yaml)


def epoch_fractions(milestones: Any, epochs: Any) -> list[float]:
    """`${epoch_fractions:[100,200],${trainer.epochs}}`: milestones given in epochs, as an official
    MultiStepLR states them, as the fractions of the run that `trainer.milestones` holds (a
    milestone at or past the last epoch never steps, as there)."""
    return [float(m) / max(int(epochs), 1) for m in milestones]


if not OmegaConf.has_resolver("epoch_fractions"):
    OmegaConf.register_new_resolver("epoch_fractions", epoch_fractions)

store = ConfigStore.instance()
store.store(name="run_schema", node=RunSchema)
store.store(group="trainer", name="_schema", node=TrainerSchema)
