"""Anti-Backdoor Learning: isolate the fastest-learned samples with LGA, train on, then unlearn them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.errors import ConfigError
from backdoorbench.train import cross_entropy_step, recipe
from backdoorbench.train.recipes import sgd


def lga_step(gamma: float):
    """Local gradient ascent: sign(CE - gamma) * CE on the batch mean, so the loss is held near
    gamma (descent above it, ascent below) and only samples learned far faster than the rest,
    the backdoored ones, end up with a much lower loss."""

    def step(model: nn.Module, x: Tensor, y: Tensor):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        return torch.sign(loss.detach() - gamma) * loss, logits, y

    return step


def cutout(x: Tensor, length: int, generator: torch.Generator) -> Tensor:
    """One hole per image as the official `Cutout(1, length)`: a centre drawn uniformly over the
    image (rows, then columns), rows and columns [centre - length // 2, centre + length // 2)
    clipped to the image, set to 0 in every channel. The integer halving makes a length-3 hole
    2x2 pixels (fewer at the border). Draws on the CPU `generator`; `x` float, (B, C, H, W)."""
    batch, _, height, width = x.shape
    rows = torch.randint(height, (batch, 1), generator=generator).to(x.device)
    cols = torch.randint(width, (batch, 1), generator=generator).to(x.device)
    half = length // 2
    r, c = torch.arange(height, device=x.device), torch.arange(width, device=x.device)
    in_rows = (r >= rows - half) & (r < rows + half)  # (B, H)
    in_cols = (c >= cols - half) & (c < cols + half)  # (B, W)
    return x.masked_fill((in_rows[:, :, None] & in_cols[:, None, :])[:, None], 0.0)


def cutout_step(length: int, generator: torch.Generator):
    """Cross-entropy on the batch after `cutout`: the official training on the rest applies it
    after its crop and flip, as here (the trainer's augmentation comes first)."""

    def step(model: nn.Module, x: Tensor, y: Tensor):
        logits = model(cutout(x, length, generator))
        return F.cross_entropy(logits, y), logits, y

    return step


def unlearning_step(model: nn.Module, x: Tensor, y: Tensor):
    """Gradient ascent on the isolated samples: minimize -CE."""
    logits = model(x)
    return -F.cross_entropy(logits, y), logits, y


@torch.no_grad()
def per_sample_loss(model: nn.Module, split: Split, device: torch.device, batch_size: int = 1024) -> Tensor:
    """Cross-entropy of every sample of `split` (model in eval mode, no augmentation), on the CPU."""
    model.eval()
    losses = []
    for start in range(0, len(split), batch_size):
        x = to_float(split.images[start : start + batch_size].to(device))
        y = split.labels[start : start + batch_size].to(device)
        losses.append(F.cross_entropy(model(x).float(), y, reduction="none").cpu())
    return torch.cat(losses) if losses else torch.zeros(0)


def isolate_lowest_loss(losses: Tensor, ratio: float) -> Tensor:
    """Sorted indices of the round(ratio * N) (at least 1) samples with the lowest loss."""
    count = max(1, round(ratio * len(losses)))
    return torch.argsort(losses, stable=True)[:count].sort().values


class AntiBackdoorLearning(Defense):
    """Anti-Backdoor Learning (Li, Lyu, Koren, Lyu, Li, Ma, "Anti-Backdoor Learning: Training Clean
    Models on Poisoned Data", NeurIPS 2021).

    Backdoored samples are learned much faster than clean ones. A fresh model is trained on the
    poisoned training set with the LGA loss (gamma 0.5) for `isolation_epochs`; the 1% samples
    with the lowest loss are isolated; training continues on the other 99% with plain CE for
    `finetune_epochs`, and ends with `unlearn_epochs` of gradient ascent on the isolated samples.
    Ledger: docs/fidelity.md#abl. Every phase uses the official code's recipe (SGD, momentum 0.9,
    Nesterov, weight decay 1e-4, batch 128): isolation at a constant lr 0.1 without augmentation;
    training on the rest at lr 0.1, 0.01 from epoch 40, with crop/flip and then Cutout (one hole,
    `cutout_length` 3, which the official integer halving makes 2x2 px; 0 turns it off);
    unlearning at a constant lr 5e-4 without augmentation. Budgets: `official` (default) 10
    isolation, 60 training and 4 unlearning epochs; `cpu` 5, the trainer's epochs, and 4.
    `unlearn_epochs` counts epochs of gradient ascent: the official loop runs
    `unlearning_epochs 5`, but its epoch 0 only evaluates (`backdoor_unlearning.py:197-205`), so
    it ascends 4 times (before, ours ascended 5 times: `unlearn_epochs=5`). The lowest-loss
    samples are isolated, as the paper states and the official isolation script does (it sorts
    the losses ascending, `backdoor_isolation.py:37,59`). As the official loaders, isolation reads
    the training set in one fixed order every epoch (`shuffle=False`): a seeded permutation drawn
    once, since the official CIFAR-10 files are in no class order and a split sorted by class (as
    mnist5k's) read in its stored order would train class by class; `isolation_shuffle=true` draws
    a new order each epoch, as this class did before. Training on the rest and
    unlearning share one SGD optimizer, whose momentum carries into the ascent
    (`share_optimizer=false` gives each phase a fresh one, as before). Flips follow the dataset's
    protocol. LGA is
    applied to the batch-mean loss as in the official code (the paper writes it per sample).
    Threat model: ABL trains on the poisoned training set. A training-controlled attack leaves the
    stored split clean; WaNet and Input-aware export the poisoned set they trained on (as
    BackdoorBench saves bd_train), which ABL then trains on; against LIRA and WB, which export
    none, it is recorded as not applicable (`not_applicable`).
    Detection: the isolation is ABL's detector. Its per-sample loss after the isolation epochs,
    negated (higher = more suspicious: the lowest loss is isolated), and the isolated set are the
    result's `sample_scores` and `flagged`; the runner scores them against the true poisoned indices
    (TPR, FPR, F1, AUROC in `metrics.detection`) and saves them, neither changes the training. With
    `ctx.detection_only` (`eval.detection_only=true`) ABL stops after the isolation.
    """

    name = "abl"
    family = "unlearning"
    sensitivity = ("isolation_ratio",)  # swept by conf/experiment/sensitivity_abl.yaml
    aliases = ("anti_backdoor_learning",)
    stage = "in_train"
    detects = True  # the isolation: sample_scores and flagged, scored by the runner
    needs_clean_data = False
    meets_training_controlled_attacks = False
    BUDGETS = {"official": {"isolation_epochs": 10, "finetune_epochs": 60, "unlearn_epochs": 4},
               "cpu": {"isolation_epochs": 5, "finetune_epochs": None, "unlearn_epochs": 4}}

    def __init__(
        self,
        *,
        budget: str = "official",
        isolation_epochs: int | None = None,
        isolation_ratio: float = 0.01,
        gamma: float = 0.5,
        finetune_epochs: int | None = None,
        unlearn_epochs: int | None = None,
        lr: float = 0.1,
        finetune_lr_drop_epoch: int = 40,
        cutout_length: int = 3,
        unlearn_lr: float = 5e-4,
        weight_decay: float = 1e-4,
        batch_size: int = 128,
        isolation_shuffle: bool = False,
        share_optimizer: bool = True,
        clean_fraction: float = 0.0,
    ) -> None:
        super().__init__(clean_fraction=clean_fraction)
        epochs = self.resolve_budget(budget, isolation_epochs=isolation_epochs, finetune_epochs=finetune_epochs,
                                     unlearn_epochs=unlearn_epochs)
        isolation_epochs, finetune_epochs, unlearn_epochs = (
            epochs["isolation_epochs"], epochs["finetune_epochs"], epochs["unlearn_epochs"])
        checks.integer("defense", "isolation_epochs", isolation_epochs, 1)
        checks.integer("defense", "unlearn_epochs", unlearn_epochs, 0)
        checks.integer("defense", "finetune_epochs", finetune_epochs, 0, allow_none=True, hint="null = the trainer's")
        checks.integer("defense", "finetune_lr_drop_epoch", finetune_lr_drop_epoch, 0)
        checks.integer("defense", "cutout_length", cutout_length, 0, hint="0 = no Cutout; the official code uses 3")
        checks.integer("defense", "batch_size", batch_size, 1)
        checks.number("defense", "isolation_ratio", isolation_ratio, 0, 1, low_open=True, high_open=True)
        checks.number("defense", "gamma", gamma, 0)
        checks.number("defense", "weight_decay", weight_decay, 0)
        for key, value in (("lr", lr), ("unlearn_lr", unlearn_lr)):
            checks.number("defense", key, value, 0, low_open=True)
        self.isolation_epochs = isolation_epochs
        self.isolation_ratio = float(isolation_ratio)
        self.gamma = float(gamma)
        self.finetune_epochs = finetune_epochs
        self.unlearn_epochs = unlearn_epochs
        self.lr = float(lr)
        self.finetune_lr_drop_epoch = finetune_lr_drop_epoch
        self.cutout_length = cutout_length
        self.unlearn_lr = float(unlearn_lr)
        self.weight_decay = float(weight_decay)
        self.batch_size = batch_size
        for key, value in (("isolation_shuffle", isolation_shuffle), ("share_optimizer", share_optimizer)):
            if not isinstance(value, bool):
                raise ConfigError(f"defense.{key}={value!r} is invalid; use true or false")
        self.isolation_shuffle = isolation_shuffle
        self.share_optimizer = share_optimizer

    def _recipe(self, trainer, epochs: int, *, augment: bool, boundaries=(), factors=(1.0,), shuffle=None,
                optimizer=None):
        return recipe(trainer, epochs=epochs, boundaries=boundaries, factors=factors, momentum=0.9,
                      weight_decay=self.weight_decay, nesterov=True, augment=augment, batch_size=self.batch_size,
                      shuffle=shuffle, optimizer=optimizer)

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        if ctx.build_model is None:
            raise ConfigError("defense abl trains a fresh model and needs ctx.build_model")
        trainer, train = ctx.trainer, ctx.poisoned_train
        model = ctx.build_model()
        # The official isolation loader keeps one order (shuffle=False) over CIFAR-10's files, whose order
        # has no class structure; our splits may be sorted by class (mnist5k's is), which would train
        # class by class. So the fixed order is one seeded permutation, drawn once.
        fixed = None if self.isolation_shuffle else torch.randperm(len(train), generator=ctx.generator)
        isolation = self._recipe(trainer, self.isolation_epochs, augment=False, shuffle=self.isolation_shuffle).fit(
            model, train if fixed is None else train.subset(fixed), generator=ctx.generator, epochs=self.isolation_epochs, lr=self.lr,
            step=lga_step(self.gamma), desc="abl isolation")
        losses = per_sample_loss(model, train, trainer.device, trainer.eval_batch_size)
        isolated = isolate_lowest_loss(losses, self.isolation_ratio)
        keep = torch.ones(len(train), dtype=torch.bool)
        keep[isolated] = False
        extras = {
            "n_isolated": int(len(isolated)),
            "isolated_per_class": torch.bincount(train.labels[isolated], minlength=ctx.num_classes).tolist(),
            "isolation_final_loss": isolation[-1]["loss"],
        }
        detected = dict(sample_scores=-losses, flagged=~keep)  # the lowest loss is the most suspicious
        if ctx.detection_only:  # the detection is all that is wanted: no training on the rest, no unlearning
            return DefenseResult(extras=extras, **detected)
        finetune_epochs = trainer.epochs if self.finetune_epochs is None else self.finetune_epochs
        # One optimizer for training on the rest and unlearning, as the official unlearning script
        # (`backdoor_unlearning.py`: one SGD for both loops); None = a fresh one per phase.
        shared = (sgd((p for p in model.parameters() if p.requires_grad), momentum=0.9,
                      weight_decay=self.weight_decay, nesterov=True) if self.share_optimizer else None)
        if finetune_epochs > 0:
            finetuner = self._recipe(trainer, finetune_epochs, augment=trainer.augment,
                                     boundaries=[self.finetune_lr_drop_epoch], factors=[1.0, 0.1], optimizer=shared)
            step = cross_entropy_step
            if self.cutout_length > 0:  # the holes get a stream of their own, seeded from the defense's
                holes = torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=ctx.generator)))
                step = cutout_step(self.cutout_length, holes)
            history = finetuner.fit(model, train.subset(torch.nonzero(keep).flatten()), generator=ctx.generator,
                                    epochs=finetune_epochs, lr=self.lr, step=step, desc="abl train")
            extras["finetune_final_loss"] = history[-1]["loss"]
        if self.unlearn_epochs > 0:
            history = self._recipe(trainer, self.unlearn_epochs, augment=False, optimizer=shared).fit(
                model, train.subset(isolated), generator=ctx.generator, epochs=self.unlearn_epochs,
                lr=self.unlearn_lr, step=unlearning_step, desc="abl unlearn")
            extras["unlearn_final_loss"] = history[-1]["loss"]  # -CE on the isolated samples
            extras["unlearn_lr_per_epoch"] = [row["lr"] for row in history]
        return DefenseResult(model=model, extras=extras, **detected)

    def describe(self) -> dict:
        return {**super().describe(), "budget": self.budget, "isolation_epochs": self.isolation_epochs,
                "isolation_ratio": self.isolation_ratio, "gamma": self.gamma, "finetune_epochs": self.finetune_epochs,
                "unlearn_epochs": self.unlearn_epochs, "lr": self.lr, "finetune_lr_drop_epoch": self.finetune_lr_drop_epoch,
                "cutout_length": self.cutout_length, "isolation_shuffle": self.isolation_shuffle,
                "share_optimizer": self.share_optimizer,
                "unlearn_lr": self.unlearn_lr, "weight_decay": self.weight_decay, "batch_size": self.batch_size}
