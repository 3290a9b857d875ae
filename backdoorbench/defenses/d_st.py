"""D-ST: secure training from scratch, the samples most sensitive to transformations kept out of supervision."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.datasets.base import to_float
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.defenses.contrastive_views import supcon_view
from backdoorbench.defenses.sensitivity_split import (DEFAULT_TRANSFORMS, SensitivitySplit, check_features,
                                                      features_of, labelled_split)
from backdoorbench.errors import ConfigError
from backdoorbench.train.batches import batch_bounds
from backdoorbench.train.recipes import recipe, sgd

BASE_TEMPERATURE = 0.07  # SupConLoss_Consistency's default, which the official call leaves


def semi_supervised_contrastive_loss(features: Tensor, labels: Tensor, flags: Tensor, temperature: float,
                                     base_temperature: float = BASE_TEMPERATURE) -> Tensor:
    """The official SS-CTL loss (`SupConLoss_Consistency`) of B samples' two views, `features`
    (B, 2, D) L2-normalised: every one of the 2B views is an anchor; an anchor's positives are the
    other view of its sample and, for a sample flagged clean (flag 0), every view of the samples
    sharing its label; the other samples (uncertain 1, poisoned 2) have their other view alone.
    Loss = -(temperature / base_temperature) x the mean over anchors of the mean log-softmax (over
    all other views, at `temperature`) of its positives."""
    batch = features.shape[0]
    device = features.device
    positives = torch.eq(labels[:, None], labels[None, :]).float()
    unlabelled = flags != 0
    positives[unlabelled] = 0  # a non-clean sample's row: no label-mates ...
    positives[unlabelled, unlabelled.nonzero().flatten()] = 1  # ... its own sample only
    views = torch.cat(features.unbind(1), 0)  # (2B, D): first views, then second views
    logits = views @ views.T / temperature
    logits = logits - logits.max(1, keepdim=True).values.detach()
    not_self = 1 - torch.eye(2 * batch, device=device)
    positives = positives.repeat(2, 2) * not_self
    log_prob = logits - torch.log((logits.exp() * not_self).sum(1, keepdim=True))
    mean_positive = (positives * log_prob).sum(1) / positives.sum(1)
    return -(temperature / base_temperature) * mean_positive.mean()


class ProjectionHead(nn.Module):
    """SupConResNet's `mlp` head on the penultimate features: Linear(d, d), ReLU, Linear(d, 128), L2-normalised."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(dim_in, dim_in), nn.ReLU(inplace=True), nn.Linear(dim_in, dim_out))

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(self.layers(x), dim=1)


def supcon_lr(base: float, epoch: int, epochs: int, decay_rate: float = 0.1) -> float:
    """The official `adjust_learning_rate` with `--cosine`: epoch 1..epochs down to base x decay_rate^3."""
    eta_min = base * decay_rate**3
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * epoch / epochs)) / 2


class DST(Defense):
    """D-ST (Chen, Wu, Wang, "Effective Backdoor Defense by Exploiting Sensitivity of Poisoned
    Samples", NeurIPS 2022): the sample-distinguishment (SD) module, then two-stage secure training
    (ST) of a fresh model of the run's architecture.

    SD: as D-BR's (`sensitivity_split.py`; docs/fidelity.md#d-br): FCT scores, the 20% least
    sensitive flagged clean, the 5% most sensitive poisoned, the rest uncertain. ST 1, semi-supervised
    contrastive learning on the whole training set (`ST/train_extractor.py`): the model's `features`
    with a projection head (d -> d -> 128, L2-normalised) learn from two SupCon views of every image
    (random resized crop at scale 0.2-1, flip, colour jitter 0.4/0.4/0.4/0.1 with p 0.8, grayscale
    with p 0.2) with the SS-CTL loss at temperature 0.1: the labels say who is a positive for the
    samples flagged clean only, a sample flagged poisoned or uncertain has its other view alone (so
    its label never makes it a positive of a label-mate; a clean-flagged anchor does count its
    label-mates of any flag, as the official mask); SGD (momentum 0.9, weight decay 1e-4, batch 512)
    at lr 0.5, a 10-epoch linear warm-up from 0.01, then the official cosine to 5e-4 over
    `contrastive_epochs` (200). ST 2, the mixed cross-entropy (`ST/train_classifier.py`): the
    features frozen (eval mode), the model's `classifier` trains for 10 epochs on the clean and the
    poisoned parts (one SupCon view each) with CE on the clean part minus 0.001 x CE on the poisoned
    part of each batch; SGD at a constant lr 5, momentum 0.9, no weight decay, batch 512.
    Budgets: `official` 200 contrastive epochs (10 warm-up); `cpu` 20 (2 warm-up): a tenth.
    Departures: the official split draws the random transformations twice (see D-BR); we split on
    the scores ranked. The views follow the dataset's flip protocol (the official SupCon transform
    always flips), run on float tensors, and a batch without a poisoned-flagged sample has no
    ascent term (the official CE of an empty batch is NaN). BackdoorBench's port trains at batch 128
    with weight decay 5e-4 and warms the classifier up; we follow the authors' README commands.
    Threat model: D-ST trains on the poisoned training split: against WaNet and Input-aware the set
    they export, n/a against LIRA, WB and Blind. Detection: the FCT (`sample_scores`) and the
    poisoned-flagged part (`flagged`); with `ctx.detection_only` D-ST stops after SD.
    Ledger: docs/fidelity.md#d-st.
    """

    name = "d_st"
    family = "secure_training"
    sensitivity = ("clean_ratio",)  # swept by conf/experiment/sensitivity_d_st.yaml
    aliases = ("dst",)
    stage = "in_train"
    detects = True  # the SD module's split: sample_scores and flagged, scored by the runner
    needs_clean_data = False
    meets_training_controlled_attacks = False
    BUDGETS = {"official": {"contrastive_epochs": 200, "warmup_epochs": 10},
               "cpu": {"contrastive_epochs": 20, "warmup_epochs": 2}}

    def __init__(self, *, budget: str = "official", clean_ratio: float = 0.2, poison_ratio: float = 0.05,
                 transforms: Sequence[str] = DEFAULT_TRANSFORMS, sd_epochs: int = 2, sd_finetune_epochs: int = 10,
                 sd_lr: float = 0.01, sd_batch_size: int = 128, sd_weight_decay: float = 5e-4,
                 contrastive_epochs: int | None = None, warmup_epochs: int | None = None, contrastive_lr: float = 0.5,
                 warmup_from: float = 0.01, temperature: float = 0.1, projection_dim: int = 128,
                 contrastive_batch_size: int = 512, contrastive_weight_decay: float = 1e-4,
                 classifier_epochs: int = 10, classifier_lr: float = 5.0, classifier_batch_size: int = 512,
                 classifier_weight_decay: float = 0.0, poison_weight: float = 0.001,
                 clean_fraction: float = 0.0) -> None:
        super().__init__(clean_fraction=clean_fraction)
        self.split = SensitivitySplit(clean_ratio=clean_ratio, poison_ratio=poison_ratio, transforms=transforms,
                                      sd_epochs=sd_epochs, sd_finetune_epochs=sd_finetune_epochs, sd_lr=sd_lr,
                                      sd_batch_size=sd_batch_size, sd_weight_decay=sd_weight_decay)
        epochs = self.resolve_budget(budget, contrastive_epochs=contrastive_epochs, warmup_epochs=warmup_epochs)
        self.contrastive_epochs = checks.integer("defense", "contrastive_epochs", epochs["contrastive_epochs"], 1)
        self.warmup_epochs = checks.integer("defense", "warmup_epochs", epochs["warmup_epochs"], 0,
                                            self.contrastive_epochs, hint="at most defense.contrastive_epochs")
        self.contrastive_lr = checks.number("defense", "contrastive_lr", contrastive_lr, 0, low_open=True)
        self.warmup_from = checks.number("defense", "warmup_from", warmup_from, 0)
        self.temperature = checks.number("defense", "temperature", temperature, 0, low_open=True)
        self.projection_dim = checks.integer("defense", "projection_dim", projection_dim, 1)
        self.contrastive_batch_size = checks.integer("defense", "contrastive_batch_size", contrastive_batch_size, 2)
        self.contrastive_weight_decay = checks.number("defense", "contrastive_weight_decay", contrastive_weight_decay, 0)
        self.classifier_epochs = checks.integer("defense", "classifier_epochs", classifier_epochs, 1)
        self.classifier_lr = checks.number("defense", "classifier_lr", classifier_lr, 0, low_open=True)
        self.classifier_batch_size = checks.integer("defense", "classifier_batch_size", classifier_batch_size, 1)
        self.classifier_weight_decay = checks.number("defense", "classifier_weight_decay", classifier_weight_decay, 0)
        self.poison_weight = checks.number("defense", "poison_weight", poison_weight, 0)

    def check_model(self, model: nn.Module) -> None:
        check_features(model, self.name)

    def warmup_to(self) -> float:
        """The official warm-up target with the cosine: the cosine's lr at epoch `warmup_epochs`."""
        return supcon_lr(self.contrastive_lr, self.warmup_epochs, self.contrastive_epochs)

    def contrastive_step(self, head: nn.Module, optimizer: torch.optim.Optimizer, batches: int, num_classes: int,
                         hflip: bool, generator: torch.Generator):
        """The SS-CTL step: two views, the features through the head, the loss; the official per-batch
        linear warm-up sets the lr during the first `warmup_epochs`."""
        calls = [0]
        target = self.warmup_to()

        def step(model: nn.Module, x: Tensor, coded: Tensor):
            index = calls[0]
            calls[0] += 1
            epoch = index // batches + 1
            if epoch <= self.warmup_epochs:
                progress = index / (self.warmup_epochs * batches)
                for group in optimizer.param_groups:
                    group["lr"] = self.warmup_from + progress * (target - self.warmup_from)
            labels, flags = coded % num_classes, coded // num_classes
            views = torch.cat([supcon_view(x, generator, hflip), supcon_view(x, generator, hflip)], 0)
            features = features_of(model, views)
            projected = head(features.float())
            loss = semi_supervised_contrastive_loss(torch.stack(projected.chunk(2, 0), 1), labels, flags,
                                                    self.temperature)
            return loss, model.classifier(features[: len(x)].detach()), labels

        return step

    def classifier_step(self, num_classes: int, hflip: bool, generator: torch.Generator):
        """The mixed CE: CE on the clean-flagged samples of the batch minus poison_weight x CE on the
        poisoned-flagged ones, on frozen features (eval mode)."""

        def step(model: nn.Module, x: Tensor, coded: Tensor):
            labels, flags = coded % num_classes, coded // num_classes
            model.eval()
            with torch.no_grad():
                features = features_of(model, supcon_view(x, generator, hflip))
            logits = model.classifier(features)
            clean, poisoned = flags == 0, flags == 2
            loss = F.cross_entropy(logits[clean].float(), labels[clean]) if clean.any() else logits.sum() * 0
            if poisoned.any():
                loss = loss - self.poison_weight * F.cross_entropy(logits[poisoned].float(), labels[poisoned])
            return loss, logits, labels

        return step

    @staticmethod
    @torch.no_grad()
    def feature_sq_norm(model: nn.Module, images: Tensor, device: torch.device) -> float:
        """Mean squared L2 norm of the penultimate features of `images` (uint8), the model in eval mode."""
        model.eval()
        return float(features_of(model, to_float(images.to(device))).float().pow(2).sum(1).mean())

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        separation, extras = self.split.run(ctx)
        detected = dict(sample_scores=separation.scores, flagged=torch.zeros(len(separation.scores), dtype=torch.bool))
        detected["flagged"][separation.poisoned] = True  # the likely-poisoned part: the detection scored
        if ctx.detection_only:
            return DefenseResult(extras=extras, **detected)
        if ctx.build_model is None:
            raise ConfigError("defense d_st trains a fresh model and needs ctx.build_model")
        trainer, classes = ctx.trainer, ctx.num_classes
        hflip = bool(getattr(trainer, "hflip", False))
        coded = labelled_split(ctx.poisoned_train, separation.flags(), classes)
        model = trainer.prepare(ctx.build_model())
        with torch.no_grad():
            model.eval()
            dim = features_of(model, to_float(coded.images[:2].to(trainer.device))).shape[1]
        head = ProjectionHead(dim, self.projection_dim).to(trainer.device)
        # ST 1: the features and the head, on every training sample
        params = [p for p in model.parameters() if p.requires_grad] + list(head.parameters())
        shared = sgd(params, momentum=0.9, weight_decay=self.contrastive_weight_decay)
        contrastive = recipe(trainer, epochs=self.contrastive_epochs, momentum=0.9,
                             weight_decay=self.contrastive_weight_decay, augment=False,
                             batch_size=self.contrastive_batch_size, optimizer=shared)
        epochs = self.contrastive_epochs
        contrastive.schedule = lambda progress: supcon_lr(1.0, round(progress * epochs) + 1, epochs)
        batches = len(batch_bounds(len(coded), self.contrastive_batch_size))
        history = contrastive.fit(model, coded, generator=ctx.generator, epochs=epochs, lr=self.contrastive_lr,
                                  step=self.contrastive_step(head, shared, batches, classes, hflip, ctx.generator),
                                  extra_params=list(head.parameters()), desc="d-st contrastive")
        extras["contrastive_loss"] = history[-1]["loss"]
        # ST 2: the classifier on the clean and the poisoned parts, the features frozen
        kept = torch.cat([separation.clean, separation.poisoned]).sort().values
        # the scale the linear classifier's lr meets: mean squared L2 norm of the frozen features
        extras["feature_sq_norm"] = self.feature_sq_norm(model, coded.images[kept[:1024]], trainer.device)
        trained = {id(p) for p in model.classifier.parameters()}
        held = [p for p in model.parameters() if id(p) not in trained and p.requires_grad]
        for p in held:
            p.requires_grad_(False)
        try:
            tuner = recipe(trainer, epochs=self.classifier_epochs, momentum=0.9,
                           weight_decay=self.classifier_weight_decay, augment=False,
                           batch_size=self.classifier_batch_size)
            history = tuner.fit(model, coded.subset(kept), generator=ctx.generator, epochs=self.classifier_epochs,
                                lr=self.classifier_lr, step=self.classifier_step(classes, hflip, ctx.generator),
                                desc="d-st classifier")
        finally:
            for p in held:
                p.requires_grad_(True)
        extras["classifier_loss"] = history[-1]["loss"]
        extras["classifier_train_acc"] = history[-1]["train_acc"]
        return DefenseResult(model=model.eval(), extras=extras, **detected)

    def describe(self) -> dict:
        return {**super().describe(), "budget": self.budget, **self.split.describe(),
                "contrastive_epochs": self.contrastive_epochs, "warmup_epochs": self.warmup_epochs,
                "contrastive_lr": self.contrastive_lr, "warmup_from": self.warmup_from, "temperature": self.temperature,
                "projection_dim": self.projection_dim, "contrastive_batch_size": self.contrastive_batch_size,
                "contrastive_weight_decay": self.contrastive_weight_decay, "classifier_epochs": self.classifier_epochs,
                "classifier_lr": self.classifier_lr, "classifier_batch_size": self.classifier_batch_size,
                "classifier_weight_decay": self.classifier_weight_decay, "poison_weight": self.poison_weight}
