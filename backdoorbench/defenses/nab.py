"""Non-Adversarial Backdoor (NAB): detect suspected poisoned samples, poison them back with a
defensive stamp and pseudo-labels, train on that set, and stamp every input at test time."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.datasets.base import Split
from backdoorbench.defenses.abl import cutout_step, isolate_lowest_loss, lga_step, per_sample_loss
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.errors import ConfigError
from backdoorbench.models.base import Normalized
from backdoorbench.train import cross_entropy_step, recipe

# The verified-data (VD) classifier's lr steps: 0.01, 0.001 from epoch 20, 0.0001 from epoch 60 of
# 100 (`pseudo_label_vd.py`'s CIFAR-10 `adjust_lr`); at other epoch counts the same fractions.
VD_BOUNDARIES = (0.2, 0.6)
VD_FACTORS = (1.0, 0.1, 0.01)
# The LGA schedule's cosine runs over the epochs plus 80 (`backdoor_detection_lga.py`'s `adjust_lr`).
LGA_COSINE_EXTRA = 80


def stamp(x: Tensor, value: Tensor | float, size: int) -> Tensor:
    """The defensive stamp: the top-left `size` x `size` pixels of every channel set to `value` (a
    float, or one per channel, shape (C,)); `x` float (B, C, H, W) in [0, 1]; a new tensor."""
    out = x.clone()
    value = torch.as_tensor(value, dtype=x.dtype, device=x.device)
    out[:, :, :size, :size] = value.view(1, -1, 1, 1) if value.dim() else value
    return out


def stamp_value(model: nn.Module, value: str | float) -> Tensor:
    """The stamp's pixel value per channel: `mean` is the model's normalisation mean, i.e. 0 in the
    model's normalised input, where the official code writes its 0 (after `Normalize`)."""
    if value == "mean":
        if not isinstance(model, Normalized):
            raise ConfigError(f"defense.stamp_value=mean reads the model's normalisation; {type(model).__name__} "
                              f"has none: give defense.stamp_value a number in [0, 1]")
        return model.mean.detach().flatten().float().cpu()
    return torch.tensor([float(value)])


class Stamped(Normalized):
    """The defended system NAB deploys: the trained classifier, every input stamped first.

    A `Normalized` sharing the trained model's network and normalisation, whose `normalize` puts the
    stamp on the [0, 1] image before normalising: its forward, `features` and everything that
    measures it (CA, ASR, RA, PGD, reactivation) see stamped inputs, clean and triggered alike."""

    def __init__(self, model: Normalized, value: Tensor, size: int) -> None:
        super().__init__(model.net, tuple(model.mean.flatten().tolist()), tuple(model.std.flatten().tolist()))
        self.to(model.mean.device)
        self.size = size
        # not in the state dict: a saved defended model loads into a plain Normalized
        self.register_buffer("stamp_value", value.float().flatten().to(model.mean.device), persistent=False)

    def normalize(self, x: Tensor) -> Tensor:
        return super().normalize(stamp(x, self.stamp_value, self.size))


def relabel(labels: Tensor, flagged: Tensor, pseudo: Tensor) -> tuple[Tensor, Tensor]:
    """The official poisoning of the flagged samples: (new labels, stamped). Every flagged sample takes
    its pseudo-label; the stamp goes on those whose pseudo-label differs from their label
    (`train_nab.py`: `add_stamp = (label != pseudo_label) & replace`)."""
    flagged = flagged.bool()
    stamped = flagged & (pseudo != labels)
    return torch.where(flagged, pseudo, labels), stamped


def encode(labels: Tensor, stamped: Tensor, num_classes: int) -> Tensor:
    """Labels carrying the stamp bit through the trainer (label + num_classes where stamped), so that
    the step stamps a sample after the batch's augmentation, as the official on-the-fly stamping."""
    return labels + num_classes * stamped.long()


def decode(y: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """(labels, stamped) of `encode`d labels."""
    stamped = y >= num_classes
    return torch.where(stamped, y - num_classes, y), stamped


def defensive_step(num_classes: int, value: Tensor, size: int):
    """The wrap_step of NAB's training: the batch's stamp bits are read off its labels, the stamp is put
    on those (augmented) images, and the attacker's own step trains on the result."""

    def wrap(step):
        def run(model: nn.Module, x: Tensor, y: Tensor):
            labels, stamped = decode(y, num_classes)
            if stamped.any():
                x = torch.where(stamped.view(-1, 1, 1, 1), stamp(x, value, size), x)
            return step(model, x, labels)

        return run

    return wrap


def lga_schedule(epochs: int):
    """The official LGA lr factor of an epoch: 1 in epoch 0, then 0.5 (1 + cos(pi (e - 1) / (epochs + 80)))
    (the official loop sets the lr after each epoch)."""

    def factor(progress: float) -> float:
        epoch = round(progress * max(epochs, 1))
        return 1.0 if epoch == 0 else 0.5 * (1 + math.cos(math.pi * (epoch - 1) / (epochs + LGA_COSINE_EXTRA)))

    return factor


class NonAdversarialBackdoor(Defense):
    """Non-Adversarial Backdoor (Liu, Sangiovanni-Vincentelli, Yue, "Beating Backdoor Attack at Its
    Own Game", ICCV 2023).

    A defender's backdoor against the attacker's: a small set of suspected poisoned samples is
    detected, each takes a pseudo-label and (where that differs from its label) a defensive stamp,
    the model trains on the processed set, and at test time every input is stamped, which triggers
    the defensive backdoor: a poisoned input goes to its pseudo-label, not the attack's target.
    Ledger: docs/fidelity.md#nab. The official pipeline (damianliumin/non-adversarial_backdoor):
    - detection, LGA (`backdoor_detection_lga.py`, the ABL isolation): a fresh model trained
      `lga_epochs` (20) on the poisoned set with the LGA loss (gamma 0.5; the official
      |CE - gamma| + gamma has LGA's gradient), SGD lr 0.1, momentum 0.9, weight decay 1e-4, batch
      64, shuffled, no augmentation, the lr on a cosine over 100 epochs; the `isolation_ratio` (5%)
      with the lowest loss are flagged (the official default `isolation/..._0.05_lga`);
    - pseudo-labels, VD (`pseudo_label_vd.py`): a fresh model trained on the verified clean data (the
      defender's clean subset, 5% as the official `clean_lite`) for `vd_epochs` (100), SGD lr 0.01
      (x0.1 from epoch 20, x0.01 from 60), momentum 0.9, weight decay 1e-4, batch 64, crop/flip then
      Cutout(1, 3); its predictions on the stamped training images are the pseudo-labels;
    - training (`train_nab.py`): every flagged sample takes its pseudo-label, and those whose
      pseudo-label differs get the stamp, the top-left 2x2 pixels set to 0 in the normalised input,
      after the batch's augmentation; the test inputs all get the stamp.
    Departures: the stamp's value is the model's normalisation mean (`stamp_value=mean`), the pixel
    the model sees as 0, as the official stamp is 0 after `Normalize`. The final training is the
    attacker's own, as the pipeline retrains after every pre-training detector (spectral, AC), so
    the defended model is comparable with the victim; the official `train_nab.py` is a plain
    CIFAR-10 recipe (100 epochs, SGD 0.1 cosine, batch 64, Cutout). The stamp bit travels through
    the trainer as label + num_classes (`encode`), so the stamp goes on after the augmentation as in
    the official on-the-fly code. At other epoch counts, VD's lr steps keep their fractions (20%,
    60%). Not included: the paper's optional test-data filtering (`evaluate_filter.py`), and the
    nearest-centre (NC) pseudo-labels on a self-supervised model that BackdoorBench uses (its NAB:
    SimCLR features, isolation 10%); VD is the official default. The returned model is `Stamped`
    (the network inside a `Normalized` that stamps every input), so every measure of the pipeline
    sees the defended system as deployed. Stage: the paper's NAB is data preprocessing, but the
    pipeline's `pre_train` stage retrains on the unflagged samples only, so NAB is `in_train` (as ABL,
    which also detects and then trains): it trains its model on the processed set with
    `ctx.train_victim` and returns it stamped; no hook beyond the contract is needed. Threat model: NAB reads the stored training split (as
    ABL): against WaNet and Input-aware it gets their exported poisoned set, against LIRA and WB it
    does not apply. Detection: the LGA isolation, its negated loss as `sample_scores`.
    """

    name = "nab"
    family = "defensive_backdoor"
    sensitivity = ("isolation_ratio",)  # swept by conf/experiment/sensitivity_nab.yaml
    aliases = ("non_adversarial_backdoor",)
    stage = "in_train"
    detects = True  # the LGA isolation: sample_scores and flagged, scored by the runner
    needs_clean_data = True  # VD's verified data
    meets_training_controlled_attacks = False
    BUDGETS = {"official": {"lga_epochs": 20, "vd_epochs": 100},
               "cpu": {"lga_epochs": 10, "vd_epochs": 50}}

    def __init__(
        self,
        *,
        budget: str = "official",
        lga_epochs: int | None = None,
        vd_epochs: int | None = None,
        isolation_ratio: float = 0.05,
        gamma: float = 0.5,
        lga_lr: float = 0.1,
        vd_lr: float = 0.01,
        weight_decay: float = 1e-4,
        batch_size: int = 64,
        cutout_length: int = 3,
        stamp_size: int = 2,
        stamp_value: Any = "mean",
        clean_fraction: float = 0.05,
    ) -> None:
        super().__init__(clean_fraction=clean_fraction)
        epochs = self.resolve_budget(budget, lga_epochs=lga_epochs, vd_epochs=vd_epochs)
        self.lga_epochs = checks.integer("defense", "lga_epochs", epochs["lga_epochs"], 1)
        self.vd_epochs = checks.integer("defense", "vd_epochs", epochs["vd_epochs"], 1)
        checks.number("defense", "isolation_ratio", isolation_ratio, 0, 1, low_open=True, high_open=True,
                      hint="the share of the training set flagged; the official code: 0.05")
        checks.number("defense", "gamma", gamma, 0)
        for key, value in (("lga_lr", lga_lr), ("vd_lr", vd_lr)):
            checks.number("defense", key, value, 0, low_open=True)
        checks.number("defense", "weight_decay", weight_decay, 0)
        self.batch_size = checks.integer("defense", "batch_size", batch_size, 1)
        self.cutout_length = checks.integer("defense", "cutout_length", cutout_length, 0,
                                            hint="0 = no Cutout; the official code uses 3")
        self.stamp_size = checks.integer("defense", "stamp_size", stamp_size, 1, hint="pixels; the official stamp is 2x2")
        if stamp_value != "mean":
            if isinstance(stamp_value, bool) or not isinstance(stamp_value, (int, float)):
                raise ConfigError(f"defense.stamp_value={stamp_value!r} is invalid; use mean (the model's "
                                  f"normalisation mean: 0 in its normalised input, as the official stamp) "
                                  f"or a number in [0, 1]")
            checks.number("defense", "stamp_value", stamp_value, 0, 1)
            stamp_value = float(stamp_value)
        self.stamp_value = stamp_value
        self.isolation_ratio = float(isolation_ratio)
        self.gamma = float(gamma)
        self.lga_lr = float(lga_lr)
        self.vd_lr = float(vd_lr)
        self.weight_decay = float(weight_decay)

    def _recipe(self, trainer, epochs: int, *, augment: bool, shuffle: bool = True, boundaries=(), factors=(1.0,)):
        return recipe(trainer, epochs=epochs, boundaries=boundaries, factors=factors, momentum=0.9,
                      weight_decay=self.weight_decay, augment=augment, batch_size=self.batch_size, shuffle=shuffle)

    def detect(self, ctx: DefenseContext) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """LGA: (per-sample loss of the LGA model, flagged, extras); the lowest losses are flagged."""
        trainer, train = ctx.trainer, ctx.poisoned_train
        model = ctx.build_model()
        lga = self._recipe(trainer, self.lga_epochs, augment=False)
        lga.schedule = lga_schedule(self.lga_epochs)
        history = lga.fit(model, train, generator=ctx.generator, epochs=self.lga_epochs, lr=self.lga_lr,
                          step=lga_step(self.gamma), desc="nab lga")
        losses = per_sample_loss(model, train, trainer.device, trainer.eval_batch_size)
        flagged = torch.zeros(len(train), dtype=torch.bool)
        flagged[isolate_lowest_loss(losses, self.isolation_ratio)] = True
        return losses, flagged, {"lga_final_loss": history[-1]["loss"]}

    def pseudo_labels(self, ctx: DefenseContext, images: Tensor, value: Tensor) -> tuple[Tensor, dict[str, Any]]:
        """VD: a fresh model trained on the clean subset predicts the stamped `images` (uint8)."""
        trainer = ctx.trainer
        if len(ctx.clean_subset) == 0:
            raise ConfigError("defense nab labels with a model trained on clean data; use defense.clean_fraction > 0")
        model = ctx.build_model()
        boundaries = [round(b * self.vd_epochs) for b in VD_BOUNDARIES]
        vd = self._recipe(trainer, self.vd_epochs, augment=trainer.augment, boundaries=boundaries, factors=VD_FACTORS)
        holes = torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=ctx.generator)))
        step = cutout_step(self.cutout_length, holes) if self.cutout_length > 0 else cross_entropy_step
        history = vd.fit(model, ctx.clean_subset, generator=ctx.generator, epochs=self.vd_epochs, lr=self.vd_lr,
                         step=step, desc="nab verified data")
        pseudo = trainer.predict(model, images, transform=lambda x: stamp(x, value, self.stamp_size))
        return pseudo, {"vd_final_loss": history[-1]["loss"]}

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        if ctx.build_model is None or ctx.train_victim is None:
            raise ConfigError("defense nab trains fresh models and needs ctx.build_model and ctx.train_victim")
        height, width = ctx.poisoned_train.images.shape[-2:]
        if self.stamp_size > min(height, width):
            raise ConfigError(f"defense.stamp_size={self.stamp_size} is larger than the {height}x{width} images; "
                              f"use at most {min(height, width)}")
        losses, flagged, extras = self.detect(ctx)
        detected = dict(sample_scores=-losses, flagged=flagged)  # the lowest loss is the most suspicious
        extras["n_flagged"] = int(flagged.sum())
        if ctx.detection_only:
            return DefenseResult(extras=extras, **detected)
        model, more = self.train_defended(ctx, flagged)
        return DefenseResult(model=model, extras={**extras, **more}, **detected)

    def train_defended(self, ctx: DefenseContext, flagged: Tensor) -> tuple[Stamped, dict[str, Any]]:
        """The flagged samples poisoned back (VD pseudo-labels, the stamp where those differ), a fresh
        model trained on the processed set the attacker's way, returned stamping every input."""
        train: Split = ctx.poisoned_train
        model = ctx.build_model()
        value = stamp_value(model, self.stamp_value)
        pseudo, extras = self.pseudo_labels(ctx, train.images, value)
        labels, stamped = relabel(train.labels, flagged.cpu(), pseudo.to(train.labels.device))
        extras.update(n_stamped=int(stamped.sum()), n_relabelled=int((labels != train.labels).sum()))
        processed = Split(train.images, encode(labels, stamped, ctx.num_classes))
        ctx.train_victim(model, wrap_step=defensive_step(ctx.num_classes, value, self.stamp_size), train=processed)
        return Stamped(model, value, self.stamp_size), extras

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "budget": self.budget, "lga_epochs": self.lga_epochs, "vd_epochs": self.vd_epochs,
                "isolation_ratio": self.isolation_ratio, "gamma": self.gamma, "lga_lr": self.lga_lr,
                "vd_lr": self.vd_lr, "weight_decay": self.weight_decay, "batch_size": self.batch_size,
                "cutout_length": self.cutout_length, "stamp_size": self.stamp_size, "stamp_value": self.stamp_value}
