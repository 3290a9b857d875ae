"""The attack contract: a target rule, a poison rate, a test-time trigger and seeded poisoning."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.attacks.targets import make_target_rule
from backdoorbench.datasets.base import Split, to_float, to_uint8
from backdoorbench.errors import ConfigError
from backdoorbench.train import cross_entropy_step


@dataclass
class PoisonedData:
    """A training split after poisoning, with the indices that were rewritten (for scoring only)."""

    split: Split
    indices: Tensor  # sorted int64 indices into the training split
    # Samples altered but keeping their label (WaNet's noise mode, Input-aware's cross triggers) in a
    # training-controlled attack's exported set: not backdoor carriers, so not in `indices`.
    cover: Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))

    @property
    def indices_sha256(self) -> str:
        return indices_sha256(self.indices)


def indices_sha256(indices: Tensor) -> str:
    """Hash of a sorted index set, so two records can show they poisoned the same samples."""
    data = indices.sort().values.to(torch.int64).cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def choose_unpoisoned(poisoned: Tensor, n: int, rate: float, key: str, what: str,
                      generator: torch.Generator) -> Tensor:
    """A seeded random choice of round(rate * n) training indices outside `poisoned`, sorted: the
    extra label-keeping samples some attacks add (BPP's negatives, Adaptive-Blend's cover)."""
    wanted = round(rate * n)
    others = torch.ones(n, dtype=torch.bool)
    others[poisoned] = False
    candidates = torch.nonzero(others).flatten()
    if wanted > len(candidates):
        raise ConfigError(
            f"attack.{key}={rate} asks for {wanted} {what} but only {len(candidates)} images are not "
            f"poisoned; use attack.{key} <= {len(candidates) / n:.4f}"
        )
    return candidates[torch.randperm(len(candidates), generator=generator)[:wanted]].sort().values


StepFn = Callable[[nn.Module, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
StepWrapper = Callable[[StepFn], StepFn]


class Attack:
    """Base of every attack. Data-poisoning attacks implement `apply_trigger` only.

    `poison_rate` is the fraction of the whole training set that is poisoned, or, for clean-label
    attacks, of the target class (see `poison_count`). Images enter
    `apply_trigger` as float in [0, 1], shape (B, C, H, W), and leave in the same range and shape.
    """

    name: ClassVar[str] = "attack"
    clean_label: ClassVar[bool] = False  # clean-label attacks poison target-class samples, labels kept
    # The declaration the registry lists (backdoorbench/registry.py): how the attack poisons, the kind
    # of trigger (patch, blend, warping, ...), and the short names people use for it (`attack=iad`).
    kind: ClassVar[str] = "data_poisoning"
    family: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    # True where the trigger is optimised against a model before or while the victim trains (a trigger
    # generator, a surrogate's adversarial perturbation, a patch fitted to chosen neurons): such an
    # attack trains networks of its own, which is most of its cost.
    learned_trigger: ClassVar[bool] = False
    # The lowest precision whose rounding leaves the trigger's effect intact: trainer.precision=auto
    # runs the whole run in it on CUDA (backdoorbench/precision.py). bf16 keeps 8 significant bits.
    min_precision: ClassVar[str] = "bf16"
    # True where `prepare` takes `clean_model=`: a callable returning the run's clean control (the
    # `attack=none` victim of the same setting, from the victim cache) and its cache block, for an
    # attack that crafts its trigger on a clean model (LF), as BackdoorBench's pre-made triggers are.
    uses_clean_control: ClassVar[bool] = False
    # Where an attack that trains networks of its own for its trigger keeps them, under its name
    # (`network_folder()`: `<network_cache>/<name>/<key>.pt`): the run's, from `bind_run`; None: the cache is off.
    network_cache: Path | None = None

    def __init__(
        self,
        *,
        num_classes: int,
        image_shape: tuple[int, int, int],
        target_mode: str = "all2one",
        target: int = 0,
        poison_rate: float = 0.1,
        dataset: str | None = None,
    ) -> None:
        checks.number("attack", "poison_rate", poison_rate, 0, 1, low_open=True)
        # The dataset's name (ImageDataset.name), passed by the pipeline like num_classes: for values
        # an official code sets per dataset (Input-aware's normaliser). None: not known (a dry build).
        self.dataset = dataset
        self.num_classes = num_classes
        self.image_shape = tuple(image_shape)
        self.target_rule = make_target_rule(target_mode, target, num_classes)
        self.target_mode = target_mode
        self.target = target if target_mode == "all2one" else None
        self.poison_rate = float(poison_rate)

    def apply_trigger(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def eligible(self, y: Tensor) -> Tensor:
        """Mask of samples this attack may poison: every sample (dirty-label), or those already of
        the target class (clean-label).

        Dirty-label attacks draw from all classes, target class included, as BackdoorBench
        (`utils/backdoor_generate_poison_index.py`: all2one "no need to avoid target class img") and
        backdoor-toolbox do; a chosen target-class image keeps its label and still carries the
        trigger. See docs/fidelity.md, shared rules."""
        if self.clean_label:
            return self.target_rule(y) == y
        return torch.ones_like(y, dtype=torch.bool)

    def poison_count(self, y: Tensor) -> int:
        """How many training samples are poisoned: round(poison_rate * N) of the whole set for
        dirty-label attacks, round(poison_rate * N_target) of the target class for clean-label ones
        (the papers' convention: a share of the whole set could exceed the target class on
        many-class data). Cheap, so attacks that train a surrogate call it before training."""
        eligible = int(self.eligible(y).sum())
        pool, of = (eligible, "target-class") if self.clean_label else (len(y), "training")
        wanted = round(self.poison_rate * pool)
        if wanted > eligible:
            raise ConfigError(
                f"attack.poison_rate={self.poison_rate} asks for {wanted} poisoned samples but only "
                f"{eligible} of {len(y)} are eligible; use attack.poison_rate <= {eligible / len(y):.4f}"
            )
        if wanted == 0:
            raise ConfigError(
                f"attack.poison_rate={self.poison_rate} poisons no sample of the {pool} {of} images; "
                f"use a rate >= {1 / max(pool, 1):.2g}"
            )
        return wanted

    def poison_indices(self, y: Tensor, generator: torch.Generator) -> Tensor:
        """A seeded random choice of `poison_count(y)` eligible training indices, sorted."""
        wanted = self.poison_count(y)
        candidates = torch.nonzero(self.eligible(y)).flatten()
        chosen = candidates[torch.randperm(len(candidates), generator=generator)[:wanted]]
        return chosen.sort().values

    def poison_dataset(self, train: Split, generator: torch.Generator, batch_size: int = 1024) -> PoisonedData:
        """Rewrite the chosen images (and labels, unless clean-label) once, before training.

        Poisoned images are stored back as uint8, as an attacker handing over image files would.
        """
        indices = self.poison_indices(train.labels, generator)
        images = train.images.clone()
        labels = train.labels.clone()
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            images[chunk] = to_uint8(self.apply_trigger(to_float(images[chunk])))
        if not self.clean_label:
            labels[indices] = self.target_rule(labels[indices])
        return PoisonedData(Split(images, labels), indices)

    def bind_run(self, *, data, network_cache: Path | None) -> None:
        """Called by the pipeline once the data has loaded, before the preparation or a victim-cache
        load: the run's dataset (for a trigger that looks up pre-made images of it, SSBA's resource)
        and the folder where an attack that trains networks of its own keeps them content-hashed
        (SSBA's encoder, Poison Ink's networks, each under its own name; None: the cache is off), kept
        as `network_cache`."""
        self.network_cache = network_cache

    def network_folder(self) -> Path | None:
        """`<network_cache>/<name>`, the folder of this attack's own networks; None: the cache is off."""
        return self.network_cache / self.name if self.network_cache is not None else None

    def prepare(
        self, *, trainer, train: Split, generator: torch.Generator, build_model: Callable[..., nn.Module]
    ) -> None:
        """Work before poisoning, called once per run: e.g. training a clean surrogate
        (`build_model()` gives a fresh model of the run's architecture) for Label-Consistent or
        TrojanNN, or Input-aware's mask pre-training. An attack with `uses_clean_control` also gets
        `clean_model=` where the pipeline offers one. Nothing by default."""

    def train_victim(
        self,
        trainer,
        model: nn.Module,
        train: Split,
        generator: torch.Generator,
        wrap_step: StepWrapper | None = None,
        checkpoint: str | None = None,
    ) -> None:
        """Train the victim on the (already poisoned) split. `wrap_step` lets an in-training
        defense add to the loss of every step the attack takes (e.g. a weight penalty);
        `checkpoint` is the trainer's per-epoch file to resume from after a crash."""
        step = wrap_step(cross_entropy_step) if wrap_step is not None else cross_entropy_step
        trainer.fit(model, train, generator=generator, step=step, desc="victim", checkpoint=checkpoint)

    def state_dict(self) -> dict[str, Any]:
        """What must be saved with the victim to poison new inputs later (learned triggers)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def prepare_state(self) -> dict[str, Any] | None:
        """What `prepare` computed, saved so that a killed run does not compute it again (with
        `history`: the epoch rows it logged); None (the default): nothing worth saving."""
        return None

    def load_prepare_state(self, state: dict[str, Any]) -> None:
        """Restore what `prepare_state` returned, in place of running `prepare`."""
        raise NotImplementedError

    def describe(self) -> dict:
        """The attack's identity for the record."""
        return {
            "name": self.name,
            "target_mode": self.target_mode,
            "target": self.target,
            "poison_rate": self.poison_rate,
            "clean_label": self.clean_label,
            **({"poison_rate_of": "target_class"} if self.clean_label else {}),
        }



class SurrogateCrafted:
    """`prepare_state` / `load_prepare_state` of an attack that crafts its trigger on a surrogate in
    `prepare` (TrojanNN, LF): the crafted trigger (its `state_dict`), what the record says of it
    (`stats`) and the surrogate's epoch rows (`_surrogate_history`), so that a killed run crafts
    nothing again. Put it before `Attack` in the bases."""

    stats: dict[str, Any]
    _surrogate_history: list[dict[str, Any]]

    def prepare_state(self) -> dict[str, Any]:
        return {**self.state_dict(), "stats": dict(self.stats), "history": list(self._surrogate_history)}

    def load_prepare_state(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state)
        self.stats = dict(state.get("stats", {}))
        self._surrogate_history = list(state.get("history", []))


class TrainingAttack(Attack):
    """Base of training-controlled attacks (WaNet, Input-aware, LIRA, WB): they leave the training
    set clean and poison a `poison_rate` fraction of every batch inside their own training step.

    Subclasses implement `apply_trigger`, `training_step` and `training_state`/
    `load_training_state` (what the step keeps between batches, saved in each epoch checkpoint);
    those with a trigger generator override `prepare` (e.g. mask pre-training, with
    `prepare_state`), `train_victim` (e.g. LIRA's two stages; it is called again when a defense
    retrains a model the attacker's way) and `state_dict`/`load_state_dict` (saved with the victim).
    """

    kind = "training_controlled"

    def poison_indices(self, y: Tensor, generator: torch.Generator) -> Tensor:
        return torch.empty(0, dtype=torch.int64)

    def poison_dataset(self, train: Split, generator: torch.Generator, batch_size: int = 1024) -> PoisonedData:
        return PoisonedData(train, self.poison_indices(train.labels, generator))

    def training_step(self, model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def train_victim(
        self,
        trainer,
        model: nn.Module,
        train: Split,
        generator: torch.Generator,
        wrap_step: StepWrapper | None = None,
        checkpoint: str | Path | None = None,
    ) -> None:
        step = wrap_step(self.training_step) if wrap_step is not None else self.training_step
        trainer.fit(model, train, generator=generator, step=step, desc="victim", checkpoint=checkpoint, companion=self)

    # Whether the attack hands over the poisoned training set it trained on, as BackdoorBench saves
    # one after WaNet and Input-aware (its `bd_train`) for the defenses that read only the stored
    # split (ABL, AC, spectral); LIRA and WB save none (`bd_train=None`) and stay out of their reach.
    exports_poisoned_set: ClassVar[bool] = False

    @torch.no_grad()
    def export_poisoned_set(self, train: Split, generator: torch.Generator, batch_size: int,
                            device: torch.device | str = "cpu") -> PoisonedData:
        """The poisoned training set as the attacker would hand it over after training: one pass of
        the trained trigger over the training split in batches of `batch_size` (a seeded shuffle, no
        augmentation), each batch poisoned as a training batch is (`export_batch`). Images are stored
        as uint8. `indices` are the relabelled trigger samples, `cover` the altered ones that keep
        their label. Deterministic given the attack's state and `generator`."""
        if not self.exports_poisoned_set:
            raise NotImplementedError(f"{self.name} exports no poisoned training set")
        order = torch.randperm(len(train), generator=generator)
        images, labels = train.images.clone(), train.labels.clone()
        poisoned, cover = [], []
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            x = to_float(train.images[rows].to(device))
            y = train.labels[rows].to(device)
            out, targets, attack_rows, cover_rows = self.export_batch(x, y, generator)
            changed = torch.cat([attack_rows, cover_rows]).cpu()
            images[rows[changed]] = to_uint8(out[changed.to(out.device)].cpu())
            labels[rows[changed]] = targets[changed.to(targets.device)].cpu()
            poisoned.append(rows[attack_rows.cpu()])
            cover.append(rows[cover_rows.cpu()])
        return PoisonedData(Split(images, labels), torch.cat(poisoned).sort().values, torch.cat(cover).sort().values)

    def export_batch(self, x: Tensor, y: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One exported batch: (images, labels, rows relabelled with the trigger, rows altered with
        labels kept), the rows drawn from `generator` as a training batch draws them."""
        raise NotImplementedError

    def training_state(self) -> dict[str, Any]:
        """What the training step keeps outside the model (generator weights, its optimizer, the
        per-batch random stream): saved in every epoch checkpoint, so a killed run resumes exactly."""
        raise NotImplementedError

    def load_training_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError
