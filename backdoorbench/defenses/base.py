"""The defense contract: one of four stages, one `apply(ctx)`; the pipeline scores the result."""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.attacks.base import Attack, TrainingAttack
from backdoorbench.datasets.base import Split
from backdoorbench.errors import ConfigError

Stage = Literal["pre_train", "in_train", "post_train", "input"]


@dataclass
class DefenseContext:
    """What every defense is given. `poisoned_indices` is for scoring only: a defense never reads it.

    `build_model(**kwargs)` makes a fresh, untrained model of the run's architecture (kwargs go to
    its constructor, e.g. `head=`); `train_victim(model, wrap_step=None, train=None)` trains it the
    way the attacker trains the victim (the attack's own steps, on `train` or the poisoned split),
    with `wrap_step` adding the defense's term to every step: in-training defenses use both.
    `detection_only` (`eval.detection_only`): only the detection is wanted; an in-training detector
    (`detects = True`) returns its `sample_scores` and `flagged` without training its model.
    """

    model: nn.Module
    poisoned_train: Split
    poisoned_indices: Tensor
    clean_subset: Split
    trainer: Any
    num_classes: int
    generator: torch.Generator
    build_model: Callable[..., nn.Module] | None = None
    train_victim: Callable[..., None] | None = None
    detection_only: bool = False


@dataclass
class DefenseResult:
    model: nn.Module | None = None  # a repaired model (post-training) or one trained with the defense
    # Suspicion per training sample, higher = more suspicious (a pre-training detector; an in-training
    # one that isolates samples, e.g. ABL's negated loss), and its verdict, bool per sample: the
    # runner scores them against the true poisoned indices and saves them as artifacts.
    sample_scores: Tensor | None = None
    flagged: Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)  # numbers the record keeps (floats, ints)
    # Arrays for figures (per-class anomaly indices, curves, ...), saved beside the record as .npz.
    artifacts: dict[str, np.ndarray | Tensor] = field(default_factory=dict)


class Defense:
    """Base of every defense: its stage, and the share of the training set it may hold clean."""

    name: ClassVar[str] = "defense"
    stage: ClassVar[Stage]
    needs_clean_data: ClassVar[bool] = True
    # False for a defense that works only on the stored training split (a pre-training detector,
    # or ABL training its own model with the plain trainer): a training-controlled attack (WaNet,
    # Input-aware, LIRA, WB) stores no poison there and poisons inside its own training step.
    # Such a defense meets the attack only through the poisoned set the attack exports after
    # training (`TrainingAttack.exports_poisoned_set`: WaNet and Input-aware, as BackdoorBench
    # saves their `bd_train`): the pipeline gives it that set as `poisoned_train`, with its
    # poisoned indices, and retrains on its kept part with the plain trainer. Against an attack
    # that exports none (LIRA, WB: BackdoorBench's bd_train=None) its threat model excludes the
    # attack: see `not_applicable`.
    meets_training_controlled_attacks: ClassVar[bool] = True
    # The declaration the registry lists (backdoorbench/registry.py): the kind of repair or detection,
    # the keys (under `defense.`) its sensitivity sweep varies (conf/experiment/sensitivity_<name>.yaml),
    # and the short names people use for it (`defense=nc`).
    family: ClassVar[str] = ""
    sensitivity: ClassVar[tuple[str, ...]] = ()
    aliases: ClassVar[tuple[str, ...]] = ()
    # Whether an in-training defense also detects: it returns `sample_scores` and `flagged` beside its
    # model, and stops after detecting when `ctx.detection_only` (ABL's isolation). Every pre-training
    # and input defense detects by its stage: see `is_detector`.
    detects: ClassVar[bool] = False

    @classmethod
    def is_detector(cls) -> bool:
        """Whether the defense returns a detection the runner scores (TPR, FPR, AUROC, F1), so that
        `eval.detection_only=true` can run it: every pre-training and input defense, and an
        in-training one that declares `detects`."""
        return cls.stage in ("pre_train", "input") or (cls.stage == "in_train" and cls.detects)

    def __init__(self, *, clean_fraction: float = 0.05) -> None:
        self.clean_fraction = checks.number("defense", "clean_fraction", clean_fraction, 0, 1, high_open=True,
                                            low_open=self.needs_clean_data,
                                            hint=f"{self.name} needs clean data" if self.needs_clean_data else "")

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        raise NotImplementedError

    def check_model(self, model: nn.Module) -> None:
        """Refuse a model this defense cannot work on (a ConfigError), before any data loads: the
        preflight calls it with the run's model built on the meta device (its modules and shapes,
        no weights). Nothing by default."""

    def not_applicable(self, attack: Attack) -> str | None:
        """Why this defense's threat model excludes `attack` (one sentence), or None when it applies.
        The pipeline asks before the defense runs; an excluded pair is recorded as `applicable:
        false` with this reason and no defended metrics, and the leaderboard shows it as n/a."""
        return self.excludes(attack.name, type(attack))

    @classmethod
    def excludes(cls, attack_name: str, attack_class: type) -> str | None:
        """`not_applicable` from the classes alone, so that a record made before the pipeline asked
        can be judged from the classes its config names (the leaderboard does)."""
        if cls.reads_exported_set(attack_class) and not attack_class.exports_poisoned_set:
            return (f"{attack_name} controls the victim's training and poisons inside its own training step, "
                    f"leaving the stored training split clean and exporting no poisoned set; {cls.name} "
                    f"({cls.stage.replace('_', '-')}) works on that split only, so it never meets the attack")
        return None

    @classmethod
    def reads_exported_set(cls, attack_class: type) -> bool:
        """Whether, against `attack_class`, this defense is given the poisoned set the attack
        exports in place of the (clean) stored split: a split-only defense against a
        training-controlled attack."""
        return issubclass(attack_class, TrainingAttack) and not cls.meets_training_controlled_attacks

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "stage": self.stage, "clean_fraction": self.clean_fraction}

    # Budget presets of a defense whose official budget a CPU cannot afford: name -> the values of
    # its budget parameters. "official" is the authors' (or BackdoorBench's) budget; "cpu" the cut
    # the committed CPU tables use. A value given explicitly wins over the preset.
    BUDGETS: ClassVar[dict[str, dict[str, Any]]] = {}

    def resolve_budget(self, budget: str, **given: Any) -> dict[str, Any]:
        """`given` with every None replaced by the `budget` preset's value (None there too means
        the trainer's own, e.g. its epochs); sets `self.budget`."""
        if budget not in self.BUDGETS:
            raise ConfigError(f"defense.budget={budget!r} is unknown for {self.name}; choose one of: "
                              f"{', '.join(self.BUDGETS)}")
        self.budget = budget
        preset = self.BUDGETS[budget]
        return {key: preset[key] if value is None else value for key, value in given.items()}

    def test_artifacts(self, ctx: DefenseContext, result: DefenseResult,
                       measure: Callable[[nn.Module], dict[str, float]]) -> dict[str, np.ndarray | Tensor]:
        """Figure data that needs the test set, which `apply` never sees: the runner calls this
        after `apply` with `measure(model)` -> CA/ASR/RA on the test set. None by default."""
        return {}


class InputDefense(Defense):
    """An inference-time detector: `apply(ctx)` calibrates it (e.g. a threshold at a chosen false
    rejection rate on clean data); then `score_inputs` rates inputs, above `threshold` = rejected."""

    stage = "input"
    threshold: float

    def score_inputs(self, model: nn.Module, x: Tensor) -> Tensor:
        """Suspicion per input, higher = more likely triggered; `x` in [0, 1], (B, C, H, W)."""
        raise NotImplementedError

    def score_artifacts(self, clean_scores: Tensor, poisoned_scores: Tensor) -> dict[str, np.ndarray | Tensor]:
        """The detector's own figure data from the scores of the clean and the triggered test inputs
        (e.g. STRIP's entropies); none by default. The runner saves the scores themselves for every
        input detector, under the generic names (run_keys.DETECTION_SCORES, ...)."""
        return {}


def clean_subset_indices(num_samples: int, poisoned: Tensor, fraction: float, generator: torch.Generator) -> Tensor:
    """A seeded choice of round(fraction * N) training indices, none of them poisoned."""
    is_poisoned = torch.zeros(num_samples, dtype=torch.bool)
    is_poisoned[poisoned] = True
    clean = torch.nonzero(~is_poisoned).flatten()
    wanted = round(fraction * num_samples)
    if wanted < 1:
        raise ConfigError(
            f"defense.clean_fraction={fraction} gives the defender no clean sample of {num_samples}; "
            f"use at least {1 / num_samples:.2g}"
        )
    if wanted > len(clean):
        raise ConfigError(
            f"defense.clean_fraction={fraction} asks for {wanted} clean samples but only {len(clean)} are "
            f"unpoisoned; use defense.clean_fraction <= {len(clean) / num_samples:.4f}"
        )
    return clean[torch.randperm(len(clean), generator=generator)[:wanted]].sort().values
