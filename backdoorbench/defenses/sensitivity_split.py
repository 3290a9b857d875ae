"""The sample-distinguishment (SD) module D-BR and D-ST share (Chen, Wu, Wang, NeurIPS 2022): a model
trained on the poisoned set scores each training sample by its feature consistency towards
transformations (FCT), and the scores split the set into likely-clean, likely-poisoned and uncertain
parts at the official ratios. Ledger: docs/fidelity.md#d-br and #d-st.

Poisoned samples are the SENSITIVE ones: the features of a triggered image move more under a
rotation and a translation (which displace or crop the trigger) than those of a clean image, so the
highest FCT are taken as poisoned and the lowest as clean (`calculate_gamma.py`, `separate_samples.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.errors import ConfigError, DataError
from backdoorbench.train.augment import apply_augmentation
from backdoorbench.train.recipes import recipe, sgd

# The transformations the official `get_transform` offers as trans1/trans2 that act on geometry alone
# (its blur and erase are not offered here); the default pair is the official one.
TRANSFORMS = ("rotate", "affine", "flip", "crop")
DEFAULT_TRANSFORMS = ("rotate", "affine")
ROTATION_DEGREES = 180.0  # RandomRotation(180)
TRANSLATE = 0.2  # RandomAffine(degrees=0, translate=(0.2, 0.2))
CROP_PADDING = 4  # RandomCrop(size, padding=4)


def rotate_nearest(x: Tensor, angles: Tensor) -> Tensor:
    """Each image of `x` (float, (B, C, H, W)) rotated counter-clockwise by its angle in degrees about
    its centre, nearest neighbour, zeros outside: PIL's `rotate` as torchvision's RandomRotation calls
    it (no expand). An angle of 90 is torch.rot90(x, 1, (2, 3)) on square images."""
    batch, channels, height, width = x.shape
    radians = angles.to(x.device, torch.float64) * (math.pi / 180)
    cos, sin = radians.cos(), radians.sin()
    # Output pixel -> input pixel about the centre, in affine_grid's [-1, 1] units per axis
    # (align_corners=False: +-1 are the outer pixel edges, as PIL's continuous coordinates).
    theta = torch.stack([torch.stack([cos, -sin * height / width, torch.zeros_like(cos)], 1),
                         torch.stack([sin * width / height, cos, torch.zeros_like(cos)], 1)], 1)
    grid = F.affine_grid(theta, [batch, channels, height, width], align_corners=False)
    with torch.autocast(x.device.type, enabled=False):
        return F.grid_sample(x.float(), grid.float(), mode="nearest", padding_mode="zeros", align_corners=False).to(x.dtype)


def translate(x: Tensor, shifts: Tensor) -> Tensor:
    """Each image shifted by its whole-pixel (dy, dx) (down, right), zeros shifted in: RandomAffine's
    translation, whose draws are whole pixels."""
    pad = int(shifts.abs().max()) if len(shifts) else 0
    if pad == 0:
        return x
    return apply_augmentation(x, pad - shifts.to(torch.long), None, pad)


def transform_batch(x: Tensor, transforms: Sequence[str], generator: torch.Generator) -> Tensor:
    """`x` (float in [0, 1], (B, C, H, W)) through the named random transformations in order, each
    image with its own draw (on the CPU `generator`):
    rotate: an angle uniform in [-180, 180] (RandomRotation(180));
    affine: a shift uniform in +-20% of the width and the height, rounded to whole pixels
    (RandomAffine(degrees=0, translate=(0.2, 0.2)));
    flip: a horizontal flip (RandomHorizontalFlip(p=1));
    crop: a random crop after zero padding by 4 px (RandomCrop(size, padding=4))."""
    batch, _, height, width = x.shape
    for name in transforms:
        if name == "rotate":
            angles = (torch.rand(batch, generator=generator, dtype=torch.float64) * 2 - 1) * ROTATION_DEGREES
            x = rotate_nearest(x, angles)
        elif name == "affine":
            limits = torch.tensor([TRANSLATE * height, TRANSLATE * width], dtype=torch.float64)
            shifts = torch.round((torch.rand(batch, 2, generator=generator, dtype=torch.float64) * 2 - 1) * limits)
            x = translate(x, shifts.long())
        elif name == "flip":
            x = x.flip(3)
        elif name == "crop":
            offsets = torch.randint(2 * CROP_PADDING + 1, (batch, 2), generator=generator)
            x = apply_augmentation(x, offsets, None, CROP_PADDING)
        else:
            raise ConfigError(f"transformation {name!r} is unknown; choose from: {', '.join(TRANSFORMS)}")
    return x


def features_of(model: nn.Module, x: Tensor) -> Tensor:
    """The penultimate features (`model.features`), one flat row per image."""
    return model.features(x).flatten(1)


@torch.no_grad()
def feature_consistency(model: nn.Module, images: Tensor, transforms: Sequence[str], generator: torch.Generator,
                        device: torch.device, batch_size: int = 1024) -> Tensor:
    """FCT of each uint8 image (N, C, H, W): the mean over the feature dimensions of the squared
    difference between the penultimate features of the image and of its transformed copy, the model
    in eval mode (the official `torch.mean((features1 - features2)**2, dim=1)`). Float32, on the CPU."""
    model.eval()
    out = []
    for start in range(0, len(images), batch_size):
        x = to_float(images[start : start + batch_size].to(device))
        moved = transform_batch(x, transforms, generator)
        out.append((features_of(model, x).float() - features_of(model, moved).float()).pow(2).mean(1).cpu())
    return torch.cat(out) if out else torch.empty(0)


def center_similarity(features: Tensor, labels: Tensor) -> Tensor:
    """The official L_intra of one batch: the mean, over all K x K entries (the diagonal counted as
    0), of the cosine similarities between the centres of the K classes present in the batch.
    Minimising it pushes the class centres apart."""
    classes, members = torch.unique(labels, return_inverse=True)
    onehot = F.one_hot(members, len(classes)).to(features.dtype)
    centers = F.normalize((onehot.T @ features) / onehot.sum(0)[:, None], dim=1)
    similarity = centers @ centers.T
    return (similarity * (1 - torch.eye(len(classes), device=features.device, dtype=features.dtype))).mean()


def center_similarity_step(model: nn.Module, x: Tensor, y: Tensor):
    """The L_intra fine-tuning step on the penultimate features; the logits of the detached features
    only fill the trainer's accuracy column."""
    features = features_of(model, x)
    return center_similarity(features.float(), y), model.classifier(features.detach()), y


@dataclass
class Separation:
    """The SD module's verdict on the N training samples."""

    scores: Tensor  # FCT per sample, float32 (higher = more sensitive = more likely poisoned)
    clean: Tensor  # indices of the likely-clean part (FCT <= gamma_low)
    poisoned: Tensor  # indices of the likely-poisoned part (FCT >= gamma_high)
    uncertain: Tensor  # the rest
    gamma_low: float
    gamma_high: float

    def flags(self) -> Tensor:
        """Per sample: 0 clean, 1 uncertain, 2 poisoned (the official flags)."""
        flags = torch.ones(len(self.scores), dtype=torch.long)
        flags[self.clean], flags[self.poisoned] = 0, 2
        return flags


def separate(scores: Tensor, clean_ratio: float, poison_ratio: float) -> Separation:
    """The official thresholds and split: with s the FCT sorted ascending, gamma_low = s[int(N *
    clean_ratio)] and gamma_high = s[N - int(N * poison_ratio)] (`calculate_gamma.py`); FCT <=
    gamma_low is clean (int(N * clean_ratio) + 1 samples without ties), else FCT >= gamma_high is
    poisoned (int(N * poison_ratio)), the rest uncertain (`separate_samples.py`)."""
    n = len(scores)
    n_clean, n_poisoned = int(n * clean_ratio), int(n * poison_ratio)
    if n_poisoned < 1:
        raise DataError(f"defense.poison_ratio={poison_ratio} of {n} training samples takes none as poisoned; "
                        f"use defense.poison_ratio >= {1 / max(n, 1):.3g}")
    if n_clean >= n:
        raise DataError(f"defense.clean_ratio={clean_ratio} leaves no threshold among {n} training samples")
    ordered = torch.sort(scores.double()).values
    gamma_low, gamma_high = float(ordered[n_clean]), float(ordered[n - n_poisoned])
    is_clean = scores.double() <= gamma_low
    is_poisoned = (scores.double() >= gamma_high) & ~is_clean  # the official if/elif: clean first
    rest = ~(is_clean | is_poisoned)
    return Separation(scores=scores.float(), clean=torch.nonzero(is_clean).flatten(),
                      poisoned=torch.nonzero(is_poisoned).flatten(), uncertain=torch.nonzero(rest).flatten(),
                      gamma_low=gamma_low, gamma_high=gamma_high)


def cosine_from(offset: int, period: int):
    """The trainer's lr factor of a fit that goes on with a CosineAnnealingLR(T_max=period) already
    stepped `offset` epochs (the official fine-tuning resumes the training's scheduler)."""

    def factor(progress: float, epochs: int) -> float:
        return 0.5 * (1 + math.cos(math.pi * (offset + round(progress * epochs)) / period))

    return factor


class SensitivitySplit:
    """The SD module's settings, checked once, and its run on a defense context (both D-BR and D-ST
    take these keys).

    A fresh model of the run's architecture trains on the poisoned set without augmentation for
    `sd_epochs` (CE), then `sd_finetune_epochs` on L_intra (the same SGD optimizer and one cosine
    schedule of period 100 carried on, as the official scripts resume the training's optimizer and
    scheduler); its FCT splits the training set (`separate`)."""

    KEYS = ("clean_ratio", "poison_ratio", "transforms", "sd_epochs", "sd_finetune_epochs", "sd_lr",
            "sd_batch_size", "sd_weight_decay")

    def __init__(self, *, clean_ratio: float, poison_ratio: float, transforms: Sequence[str], sd_epochs: int,
                 sd_finetune_epochs: int, sd_lr: float, sd_batch_size: int, sd_weight_decay: float,
                 cosine_period: int = 100) -> None:
        self.clean_ratio = checks.number("defense", "clean_ratio", clean_ratio, 0, 1, high_open=True)
        self.poison_ratio = checks.number("defense", "poison_ratio", poison_ratio, 0, 1, low_open=True, high_open=True)
        if self.clean_ratio + self.poison_ratio >= 1:
            raise ConfigError(f"defense.clean_ratio={clean_ratio} and defense.poison_ratio={poison_ratio} leave no "
                              f"uncertain part; use two ratios that sum below 1 (the official 0.2 and 0.05)")
        names = list(transforms) if checks.is_list(transforms) else None
        if not names or any(name not in TRANSFORMS for name in names):
            raise ConfigError(f"defense.transforms={transforms!r} is invalid; use a non-empty list of: "
                              f"{', '.join(TRANSFORMS)} (the official [rotate, affine])")
        self.transforms = tuple(names)
        self.sd_epochs = checks.integer("defense", "sd_epochs", sd_epochs, 0)
        self.sd_finetune_epochs = checks.integer("defense", "sd_finetune_epochs", sd_finetune_epochs, 0)
        self.sd_lr = checks.number("defense", "sd_lr", sd_lr, 0, low_open=True)
        self.sd_batch_size = checks.integer("defense", "sd_batch_size", sd_batch_size, 1)
        self.sd_weight_decay = checks.number("defense", "sd_weight_decay", sd_weight_decay, 0)
        self.cosine_period = cosine_period

    def describe(self) -> dict:
        return {key: list(getattr(self, key)) if key == "transforms" else getattr(self, key) for key in self.KEYS}

    def train_model(self, ctx) -> tuple[nn.Module, dict]:
        """The SD model: `sd_epochs` of CE on the poisoned set, then `sd_finetune_epochs` of L_intra."""
        if ctx.build_model is None:
            raise ConfigError("the sample distinguishment trains a fresh model and needs ctx.build_model")
        model = ctx.build_model()
        shared = sgd((p for p in model.parameters() if p.requires_grad), momentum=0.9,
                     weight_decay=self.sd_weight_decay)
        extras: dict = {}
        done = 0
        for epochs, step, desc in ((self.sd_epochs, None, "sd train"),
                                   (self.sd_finetune_epochs, center_similarity_step, "sd L_intra")):
            if epochs == 0:
                continue
            trainer = recipe(ctx.trainer, epochs=epochs, momentum=0.9, weight_decay=self.sd_weight_decay,
                             augment=False, batch_size=self.sd_batch_size, optimizer=shared)
            factor = cosine_from(done, self.cosine_period)
            trainer.schedule = lambda progress, factor=factor, epochs=epochs: factor(progress, epochs)
            history = trainer.fit(model, ctx.poisoned_train, generator=ctx.generator, epochs=epochs, lr=self.sd_lr,
                                  desc=desc, **({"step": step} if step is not None else {}))
            extras["sd_train_acc" if step is None else "sd_intra_loss"] = (
                history[-1]["train_acc"] if step is None else history[-1]["loss"])
            done += epochs
        return model, extras

    def run(self, ctx) -> tuple[Separation, dict]:
        """Train the SD model, score every training sample by its FCT and split the set."""
        model, extras = self.train_model(ctx)
        scores = feature_consistency(model, ctx.poisoned_train.images, self.transforms, ctx.generator,
                                     ctx.trainer.device, ctx.trainer.eval_batch_size)
        split = separate(scores, self.clean_ratio, self.poison_ratio)
        extras.update({"n_clean": int(len(split.clean)), "n_poisoned": int(len(split.poisoned)),
                       "n_uncertain": int(len(split.uncertain)), "gamma_low": split.gamma_low,
                       "gamma_high": split.gamma_high})
        return split, extras


def check_features(model: nn.Module, name: str) -> None:
    """Both defenses read `model.features` (penultimate) and train `model.classifier`."""
    if not callable(getattr(model, "features", None)) or not isinstance(getattr(model, "classifier", None), nn.Module):
        raise ConfigError(f"defense={name} reads penultimate features: model {getattr(model, 'name', type(model).__name__)!r} "
                          f"has no .features(x) and .classifier; choose a model of the zoo")


def labelled_split(split: Split, flags: Tensor, num_classes: int) -> Split:
    """`split` with each label carrying its sample's flag (label + num_classes * flag), so that a
    trainer step, which sees (images, labels) only, knows which part a sample is in."""
    return Split(split.images, split.labels + num_classes * flags.to(split.labels.dtype))
