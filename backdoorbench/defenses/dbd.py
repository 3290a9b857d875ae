"""DBD: a fresh model trained in three decoupled stages, self-supervised, linear, semi-supervised."""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.defenses.contrastive_views import supcon_view
from backdoorbench.defenses.sensitivity_split import check_features, features_of
from backdoorbench.errors import ConfigError, DataError
from backdoorbench.progress import bar
from backdoorbench.train.augment import augment_batch
from backdoorbench.train.recipes import recipe, sgd
from backdoorbench.train.trainer import TrainingError

BLUR_P = 0.5
BLUR_SIGMA = (0.1, 2.0)  # px, the official GaussianBlur(sigma=[0.1, 2.0]) at any image size (32 and 224 alike)
log = logging.getLogger(__name__)

RCE_LOG_FLOOR = 1e-4  # RCELoss clamps the one-hot target to [1e-4, 1]: log(0) becomes log(1e-4)


# ------------------------------------------------------------------------------------------- losses


def simclr_loss(features: Tensor, temperature: float) -> Tensor:
    """The official SimCLRLoss of B samples' two views, `features` (B, 2, D) L2-normalised: the
    first views are the anchors, each scored against all 2B views but itself at `temperature`; its
    positive is its sample's second view; the loss is the mean over anchors of -log softmax there."""
    batch = features.shape[0]
    anchors = features[:, 0]
    views = torch.cat(features.unbind(1), 0)
    logits = anchors @ views.T / temperature
    logits = logits - logits.max(1, keepdim=True).values.detach()
    rows = torch.arange(batch, device=features.device)
    not_self = torch.ones_like(logits)
    not_self[rows, rows] = 0
    log_prob = logits - torch.log((logits.exp() * not_self).sum(1, keepdim=True))
    return -log_prob[rows, rows + batch].mean()


def symmetric_cross_entropy(logits: Tensor, target: Tensor, alpha: float, beta: float) -> Tensor:
    """SCE per sample (Wang et al., ICCV 2019), as the official SCELoss: alpha x CE + beta x RCE,
    RCE = -sum_k p_k log(max(onehot_k, 1e-4)), p the softmax clamped to [1e-7, 1]."""
    ce = F.cross_entropy(logits, target, reduction="none")
    prob = F.softmax(logits, dim=1).clamp(min=1e-7, max=1.0)
    one_hot = F.one_hot(target, logits.shape[1]).to(prob.dtype).clamp(min=RCE_LOG_FLOOR, max=1.0)
    rce = -(prob * torch.log(one_hot)).sum(1)
    return alpha * ce + beta * rce


def credible_split(losses: Tensor, epsilon: float) -> Tensor:
    """The official `get_semi_idx`: a bool per sample, True for the int(N epsilon) samples of the
    lowest loss (they keep their labels), False for the rest (their labels are dropped)."""
    keep = torch.zeros(len(losses), dtype=torch.bool)
    keep[torch.argsort(losses, stable=True)[: int(len(losses) * epsilon)]] = True
    return keep


def interleave(chunks: list[Tensor], batch: int) -> list[Tensor]:
    """MixMatch's interleave (YU1ut/MixMatch-pytorch, as the official `semi.py`): swaps slices
    between the first chunk (labelled) and the others, so that each forward pass, and so each
    batch-norm batch, mixes labelled and unlabelled rows; applying it twice restores the order."""
    parts = len(chunks) - 1
    sizes = [batch // (parts + 1)] * (parts + 1)
    for extra in range(batch - sum(sizes)):
        sizes[-extra - 1] += 1
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    pieces = [[v[offsets[p]: offsets[p + 1]] for p in range(parts + 1)] for v in chunks]
    for i in range(1, parts + 1):
        pieces[0][i], pieces[i][i] = pieces[i][i], pieces[0][i]
    return [torch.cat(v, 0) for v in pieces]


# -------------------------------------------------------------------------------------------- views


def gaussian_blur(x: Tensor, sigmas: Tensor) -> Tensor:
    """Each image of `x` (B, C, H, W) blurred by a separable Gaussian of its own std `sigmas` (B,)
    in pixels, the border repeated (PIL's GaussianBlur(radius=sigma) is a Gaussian of that std)."""
    radius = math.ceil(3 * BLUR_SIGMA[1])
    taps = torch.arange(-radius, radius + 1, device=x.device, dtype=torch.float32)
    kernel = torch.exp(-taps[None] ** 2 / (2 * sigmas.to(x.device, torch.float32)[:, None] ** 2))
    kernel = (kernel / kernel.sum(1, keepdim=True)).view(-1, 1, 1, 1, 2 * radius + 1)
    height, width = x.shape[-2:]
    padded = F.pad(x.float(), (radius, radius, 0, 0), mode="replicate")
    x = sum(kernel[..., k] * padded[..., k: k + width] for k in range(2 * radius + 1))
    padded = F.pad(x, (0, 0, radius, radius), mode="replicate")
    return sum(kernel[..., k] * padded[..., k: k + height, :] for k in range(2 * radius + 1))


def simclr_view(x: Tensor, generator: torch.Generator, hflip: bool) -> Tensor:
    """One view of the official SimCLR augmentation: RandomResizedCrop(image size, scale 0.2-1,
    bicubic), a horizontal flip, ColorJitter(0.4, 0.4, 0.4, 0.1) with p 0.8, RandomGrayscale(0.2)
    (the SupCon view's draws, `contrastive_views.py`), then a Gaussian blur of std U[0.1, 2] px with
    p 0.5. Float [0, 1] in and out; every draw on the CPU `generator`."""
    x = supcon_view(x, generator, hflip, mode="bicubic")
    on = torch.rand(len(x), generator=generator) < BLUR_P
    sigmas = torch.empty(len(x)).uniform_(*BLUR_SIGMA, generator=generator)
    if on.any():
        chosen = on.to(x.device)
        x = x.clone()
        x[chosen] = gaussian_blur(x[chosen], sigmas[on]).clamp_(0, 1).to(x.dtype)
    return x


class ProjectionHead(nn.Module):
    """SelfModel's `mlp` head: Linear(d, d), BatchNorm1d(d), ReLU, Linear(d, 128), L2-normalised."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(dim_in, dim_in), nn.BatchNorm1d(dim_in), nn.ReLU(),
                                    nn.Linear(dim_in, dim_out))

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(self.layers(x), dim=1)


# ------------------------------------------------------------------------------------------ defense


class DBD(Defense):
    """DBD (Huang, Li, Wu, Qin, Ren, "Backdoor Defense via Decoupling the Training Process", ICLR
    2022): a fresh model of the run's architecture trained on the poisoned training set in three
    stages (the authors' `simclr.py` and `mixmatch_finetune.py`, their CIFAR-10 configs).

    1. Self-supervised: the backbone (the model's `features`) and a projection head (d -> d, BN,
       ReLU -> 128, L2-normalised) learn from two views of every image by the official SimCLR loss
       at temperature 0.5, never given a label (the stage gets the images alone). Views: random
       resized crop to the image size (scale 0.2-1, bicubic), flip, colour jitter 0.4/0.4/0.4/0.1
       with p 0.8, grayscale with p 0.2, Gaussian blur of std U[0.1, 2] px with p 0.5. SGD (momentum
       0.9, weight decay 1e-4, batch 512) at lr 0.4, cosine annealing of period 1,000 epochs
       stepped per epoch; the fine-tuning loads the checkpoint of epoch 100, so 100 epochs.
    2. Linear warm-up: the backbone frozen (its features computed without gradient, the model in
       train mode as the official loop leaves it, so batch-norm statistics move), the model's
       `classifier` trained 10 epochs with the symmetric cross-entropy (alpha 0.1, beta 1) on the
       whole labelled poisoned set, the run's augmentation, Adam at lr 0.002, batch 128.
    3. Semi-supervised fine-tuning, 190 epochs: at the start of each epoch the per-sample SCE loss
       (eval mode, the run's augmentation, as the official record pass) splits the set: the
       epsilon = 50% of the lowest loss keep their labels, the rest lose them; then 1,024 MixMatch
       iterations (batch 64 of each part, two views of each unlabelled image, sharpening T 0.5,
       mixup alpha 0.75, interleaved batch norm) train the whole model with Lx + lambda_u Lu,
       lambda_u 15 ramped up linearly over 190 epochs counted from the warm-up's start; the same
       Adam optimizer, no EMA.
    Budgets: `official` 100 SimCLR epochs (cosine period 1,000), 10 warm-up, 190 semi epochs of
    1,024 iterations (the backdoorbench protocol: 100, BackdoorBench's `epochs`); `cpu` 10 SimCLR
    epochs (period 100, the same tenth of the cosine), 10 warm-up, 8 semi epochs of 32 iterations
    with the ramp over those 8: about three minutes on mnist5k on one core.
    Departures: the views run batched on float tensors; the flip follows the dataset's protocol (the
    official always flips); stages 2 and 3 take the run's augmentation (zero-padded crop) for the
    official reflect-padded RandomCrop(4) and flip; the classifier is the model's own head. DBD
    trains on the poisoned training split: against WaNet and Input-aware the set they export, n/a
    against LIRA, WB and Blind. Detection: the first split's SCE losses (`sample_scores`) and its
    unlabelled part (`flagged`); with `ctx.detection_only` DBD stops there.
    Ledger: docs/fidelity.md#dbd.
    """

    name = "dbd"
    family = "secure_training"
    sensitivity = ("epsilon",)  # swept by conf/experiment/sensitivity_dbd.yaml
    stage = "in_train"
    detects = True  # the stage-3 split: sample_scores and flagged, scored by the runner
    needs_clean_data = False
    meets_training_controlled_attacks = False
    BUDGETS = {"official": {"simclr_epochs": 100, "simclr_cosine_period": 1000, "warmup_epochs": 10,
                            "semi_epochs": 190, "train_iterations": 1024, "rampup_epochs": 190},
               "cpu": {"simclr_epochs": 10, "simclr_cosine_period": 100, "warmup_epochs": 10,
                       "semi_epochs": 8, "train_iterations": 32, "rampup_epochs": 8}}

    def __init__(self, *, budget: str = "official", simclr_epochs: int | None = None,
                 simclr_cosine_period: int | None = None, simclr_lr: float = 0.4, simclr_batch_size: int = 512,
                 simclr_weight_decay: float = 1e-4, temperature: float = 0.5, projection_dim: int = 128,
                 warmup_epochs: int | None = None, warmup_batch_size: int = 128, sce_alpha: float = 0.1,
                 sce_beta: float = 1.0, lr: float = 0.002, epsilon: float = 0.5, semi_epochs: int | None = None,
                 train_iterations: int | None = None, semi_batch_size: int = 64, sharpen_temperature: float = 0.5,
                 mixup_alpha: float = 0.75, lambda_u: float = 15.0, rampup_epochs: int | None = None,
                 clean_fraction: float = 0.0) -> None:
        super().__init__(clean_fraction=clean_fraction)
        given = self.resolve_budget(budget, simclr_epochs=simclr_epochs, simclr_cosine_period=simclr_cosine_period,
                                    warmup_epochs=warmup_epochs, semi_epochs=semi_epochs,
                                    train_iterations=train_iterations, rampup_epochs=rampup_epochs)
        self.simclr_epochs = checks.integer("defense", "simclr_epochs", given["simclr_epochs"], 1)
        self.simclr_cosine_period = checks.integer("defense", "simclr_cosine_period", given["simclr_cosine_period"], 1)
        self.simclr_lr = checks.number("defense", "simclr_lr", simclr_lr, 0, low_open=True)
        self.simclr_batch_size = checks.integer("defense", "simclr_batch_size", simclr_batch_size, 2)
        self.simclr_weight_decay = checks.number("defense", "simclr_weight_decay", simclr_weight_decay, 0)
        self.temperature = checks.number("defense", "temperature", temperature, 0, low_open=True)
        self.projection_dim = checks.integer("defense", "projection_dim", projection_dim, 1)
        self.warmup_epochs = checks.integer("defense", "warmup_epochs", given["warmup_epochs"], 1)
        self.warmup_batch_size = checks.integer("defense", "warmup_batch_size", warmup_batch_size, 1)
        self.sce_alpha = checks.number("defense", "sce_alpha", sce_alpha, 0)
        self.sce_beta = checks.number("defense", "sce_beta", sce_beta, 0)
        if self.sce_alpha == 0 and self.sce_beta == 0:
            raise ConfigError("defense.sce_alpha=0 and defense.sce_beta=0 leave no loss; make one of them > 0")
        self.lr = checks.number("defense", "lr", lr, 0, low_open=True)
        self.epsilon = checks.number("defense", "epsilon", epsilon, 0, 1, low_open=True, high_open=True)
        self.semi_epochs = checks.integer("defense", "semi_epochs", given["semi_epochs"], 0)
        self.train_iterations = checks.integer("defense", "train_iterations", given["train_iterations"], 1)
        self.semi_batch_size = checks.integer("defense", "semi_batch_size", semi_batch_size, 1)
        self.sharpen_temperature = checks.number("defense", "sharpen_temperature", sharpen_temperature, 0,
                                                 low_open=True)
        self.mixup_alpha = checks.number("defense", "mixup_alpha", mixup_alpha, 0, low_open=True)
        self.lambda_u = checks.number("defense", "lambda_u", lambda_u, 0)
        self.rampup_epochs = checks.integer("defense", "rampup_epochs", given["rampup_epochs"], 0)

    def check_model(self, model: nn.Module) -> None:
        check_features(model, self.name)

    # ---- stage 1 ------------------------------------------------------------------------------

    def simclr_lr_factor(self, epoch: int) -> float:
        """CosineAnnealingLR(T_max=simclr_cosine_period, eta_min 0) at 0-based epoch `epoch`."""
        return 0.5 * (1 + math.cos(math.pi * epoch / self.simclr_cosine_period))

    def self_supervised(self, model: nn.Module, head: nn.Module, images: Tensor, trainer, generator: torch.Generator,
                        hflip: bool) -> list[dict]:
        """Stage 1 on `images` (uint8, N x C x H x W) alone: no label reaches it (the trainer is
        given zeros, which the step never reads). The step's accuracy is the instance
        discrimination's: an anchor's nearest view is its own second view."""
        unlabelled = Split(images, torch.zeros(len(images), dtype=torch.long))
        params = [p for p in model.parameters() if p.requires_grad] + list(head.parameters())
        optimizer = sgd(params, momentum=0.9, weight_decay=self.simclr_weight_decay)
        tuner = recipe(trainer, epochs=self.simclr_epochs, momentum=0.9, weight_decay=self.simclr_weight_decay,
                       augment=False, batch_size=self.simclr_batch_size, optimizer=optimizer)
        epochs = self.simclr_epochs
        tuner.schedule = lambda progress: self.simclr_lr_factor(round(progress * epochs))

        def step(net: nn.Module, x: Tensor, _unread: Tensor):
            both = torch.cat([simclr_view(x, generator, hflip), simclr_view(x, generator, hflip)], 0)
            projected = head(features_of(net, both).float())
            pairs = torch.stack(projected.chunk(2, 0), 1)
            loss = simclr_loss(pairs, self.temperature)
            with torch.no_grad():
                scores = pairs[:, 0] @ pairs[:, 1].T
            return loss, scores, torch.arange(len(x), device=x.device)

        return tuner.fit(model, unlabelled, generator=generator, epochs=epochs, lr=self.simclr_lr, step=step,
                         extra_params=list(head.parameters()), desc="dbd simclr")

    # ---- stage 2 ------------------------------------------------------------------------------

    def linear_warmup(self, model: nn.Module, train: Split, trainer, optimizer: torch.optim.Optimizer,
                      generator: torch.Generator) -> list[dict]:
        """Stage 2: the classifier by SCE on the backbone's features, computed without gradient,
        so no backbone weight moves (Adam skips a parameter without a gradient)."""
        tuner = recipe(trainer, epochs=self.warmup_epochs, batch_size=self.warmup_batch_size, optimizer=optimizer)

        def step(net: nn.Module, x: Tensor, y: Tensor):
            with torch.no_grad():
                features = features_of(net, x)
            logits = net.classifier(features)
            return symmetric_cross_entropy(logits.float(), y, self.sce_alpha, self.sce_beta).mean(), logits, y

        return tuner.fit(model, train, generator=generator, epochs=self.warmup_epochs, lr=self.lr, step=step,
                         desc="dbd warm-up")

    # ---- stage 3 ------------------------------------------------------------------------------

    def augment(self, x: Tensor, trainer, generator: torch.Generator) -> Tensor:
        """The run's training augmentation of float images (the official `train` transform's place)."""
        if not getattr(trainer, "augment", False):
            return x
        return augment_batch(x, generator, trainer.crop_padding, bool(getattr(trainer, "hflip", False)),
                             float(getattr(trainer, "rotation", 0.0)), float(getattr(trainer, "rotation_p", 0.5)))

    @torch.no_grad()
    def sample_losses(self, model: nn.Module, train: Split, trainer, generator: torch.Generator) -> Tensor:
        """Per-sample SCE of the whole model in eval mode on augmented images (the official record
        pass reads the training set through its train transform). Float32 on the CPU."""
        model.eval()
        out = []
        for start in range(0, len(train), trainer.eval_batch_size):
            x = to_float(train.images[start: start + trainer.eval_batch_size].to(trainer.device))
            y = train.labels[start: start + trainer.eval_batch_size].to(trainer.device)
            with trainer.autocast():
                logits = model(self.augment(x, trainer, generator))
            out.append(symmetric_cross_entropy(logits.float(), y, self.sce_alpha, self.sce_beta).cpu())
        return torch.cat(out) if out else torch.empty(0)

    def mixmatch_epoch(self, model: nn.Module, train: Split, keep: Tensor, optimizer: torch.optim.Optimizer, trainer,
                       generator: torch.Generator, rng: np.random.Generator, epoch: int, num_classes: int) -> dict:
        """`train_iterations` MixMatch steps on the labelled (`keep`) and unlabelled parts; `epoch`
        counts from the warm-up's first (0-based), as the official ramp-up reads it."""
        labelled, unlabelled = torch.nonzero(keep).flatten(), torch.nonzero(~keep).flatten()
        batch = self.semi_batch_size
        for part, name in ((labelled, "labelled"), (unlabelled, "unlabelled")):
            if len(part) < batch:
                raise DataError(f"defense.semi_batch_size={batch} exceeds the {len(part)} {name} training samples "
                                f"of defense.epsilon={self.epsilon}; use a smaller defense.semi_batch_size")
        streams = {"x": [labelled, torch.empty(0, dtype=torch.long)], "u": [unlabelled, torch.empty(0, dtype=torch.long)]}

        def next_batch(key: str) -> Tensor:
            # a shuffled loader with drop_last, started again when it runs out
            part, queue = streams[key]
            if len(queue) < batch:
                queue = part[torch.randperm(len(part), generator=generator)]
                queue = queue[: len(queue) // batch * batch]
            streams[key][1] = queue[batch:]
            return queue[:batch]

        device = trainer.device
        started = time.perf_counter()
        model.train()
        totals = {"loss": 0.0, "loss_x": 0.0, "loss_u": 0.0}
        progress = bar(self.train_iterations, f"dbd mixmatch {epoch + 1}", unit="batch",
                       enabled=bool(getattr(trainer, "progress", False)))
        for it in range(self.train_iterations):
            xi, ui = next_batch("x"), next_batch("u")
            x = self.augment(to_float(train.images[xi].to(device)), trainer, generator)
            x_target = F.one_hot(train.labels[xi].to(device), num_classes).float()
            u = to_float(train.images[ui].to(device))
            u1, u2 = self.augment(u, trainer, generator), self.augment(u, trainer, generator)
            with torch.no_grad(), trainer.autocast():
                guess = (F.softmax(model(u1).float(), 1) + F.softmax(model(u2).float(), 1)) / 2
            sharpened = guess ** (1 / self.sharpen_temperature)
            u_target = sharpened / sharpened.sum(1, keepdim=True)
            inputs, targets = torch.cat([x, u1, u2], 0), torch.cat([x_target, u_target, u_target], 0)
            share = float(rng.beta(self.mixup_alpha, self.mixup_alpha))
            share = max(share, 1 - share)
            partner = torch.randperm(len(inputs), generator=generator).to(device)
            mixed = share * inputs + (1 - share) * inputs[partner]
            mixed_target = share * targets + (1 - share) * targets[partner]
            chunks = interleave(list(mixed.split(batch)), batch)
            with trainer.autocast():
                logits = [model(chunk) for chunk in chunks]
            logits = interleave(logits, batch)
            x_logits, u_logits = logits[0].float(), torch.cat(logits[1:], 0).float()
            loss_x = -(F.log_softmax(x_logits, 1) * mixed_target[:batch]).sum(1).mean()
            loss_u = ((F.softmax(u_logits, 1) - mixed_target[batch:]) ** 2).mean()
            ramp = 1.0 if self.rampup_epochs == 0 else min(max((epoch + it / self.train_iterations) / self.rampup_epochs, 0.0), 1.0)
            loss = loss_x + self.lambda_u * ramp * loss_u
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            totals["loss"] += loss.item()
            totals["loss_x"] += loss_x.item()
            totals["loss_u"] += loss_u.item()
            progress.update()
        progress.close()
        if not math.isfinite(totals["loss"]):
            raise TrainingError(f"defense.lr={self.lr}: the MixMatch loss became {totals['loss']}; lower defense.lr")
        row = {k: v / self.train_iterations for k, v in totals.items()}
        log.info("dbd mixmatch epoch %d: loss %.4f (Lx %.4f, Lu %.4f), %d labelled, %.1f s", epoch + 1, row["loss"],
                 row["loss_x"], row["loss_u"], len(labelled), time.perf_counter() - started)
        return row

    # ---- the three stages ---------------------------------------------------------------------

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        if ctx.build_model is None:
            raise ConfigError("defense dbd trains a fresh model and needs ctx.build_model")
        trainer, train, generator = ctx.trainer, ctx.poisoned_train, ctx.generator
        model = trainer.prepare(ctx.build_model())
        with torch.no_grad():
            model.eval()
            dim = features_of(model, to_float(train.images[:2].to(trainer.device))).shape[1]
        head = ProjectionHead(dim, self.projection_dim).to(trainer.device)
        extras: dict = {}
        history = self.self_supervised(model, head, train.images, trainer, generator,
                                       bool(getattr(trainer, "hflip", False)))
        extras["simclr_loss"] = history[-1]["loss"]
        optimizer = torch.optim.Adam(model.parameters(), lr=self.lr)  # the official one Adam for stages 2 and 3
        history = self.linear_warmup(model, train, trainer, optimizer, generator)
        extras["warmup_loss"] = history[-1]["loss"]
        losses = self.sample_losses(model, train, trainer, generator)
        keep = credible_split(losses, self.epsilon)
        detected = dict(sample_scores=losses, flagged=~keep)  # the dropped labels: the suspected part
        extras["n_labelled"] = int(keep.sum())
        if ctx.detection_only or self.semi_epochs == 0:
            return DefenseResult(model=None if ctx.detection_only else model.eval(), extras=extras, **detected)
        rng = np.random.default_rng(int(torch.randint(2**62, (1,), generator=generator)))
        for semi in range(self.semi_epochs):
            if semi > 0:  # the official loop records and splits again before every semi epoch
                keep = credible_split(self.sample_losses(model, train, trainer, generator), self.epsilon)
            row = self.mixmatch_epoch(model, train, keep, optimizer, trainer, generator, rng,
                                      self.warmup_epochs + semi, ctx.num_classes)
        extras.update({f"semi_{k}": v for k, v in row.items()})
        return DefenseResult(model=model.eval(), extras=extras, **detected)

    def describe(self) -> dict:
        return {**super().describe(), "budget": self.budget, "simclr_epochs": self.simclr_epochs,
                "simclr_cosine_period": self.simclr_cosine_period, "simclr_lr": self.simclr_lr,
                "simclr_batch_size": self.simclr_batch_size, "simclr_weight_decay": self.simclr_weight_decay,
                "temperature": self.temperature, "projection_dim": self.projection_dim,
                "warmup_epochs": self.warmup_epochs, "warmup_batch_size": self.warmup_batch_size,
                "sce_alpha": self.sce_alpha, "sce_beta": self.sce_beta, "lr": self.lr, "epsilon": self.epsilon,
                "semi_epochs": self.semi_epochs, "train_iterations": self.train_iterations,
                "semi_batch_size": self.semi_batch_size, "sharpen_temperature": self.sharpen_temperature,
                "mixup_alpha": self.mixup_alpha, "lambda_u": self.lambda_u, "rampup_epochs": self.rampup_epochs}
