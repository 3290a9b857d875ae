"""ASSET: Active Separation via Offset. A fresh model is driven in opposite directions on a small
clean base set (its output variance minimised) and on the training samples a discriminator finds
unlike the base set (their loss maximised); its per-sample loss then separates the poison
(pre-training detection)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses.abl import per_sample_loss
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.defenses.fine_pruning import require_clean_subset
from backdoorbench.errors import ConfigError
from backdoorbench.models.taps import conv_stage_outputs
from backdoorbench.progress import track
from backdoorbench.train.batches import batch_bounds

DISCRIMINATOR_WIDTH = 128  # the official `MLP(input_size=..., hidden_size=128, num_layers=2)`
DISCRIMINATOR_LAYERS = 2
MIN_ASCENT = 2  # BackdoorBench skips the ascent for a batch with fewer suspects ("no poison"); one
#                 sample cannot pass a batch norm in training mode


def medcouple(values: np.ndarray) -> float:
    """The medcouple of a 1-d sample (Brys, Hubert, Struyf 2004), a robust skewness in [-1, 1], as
    statsmodels' `medcouple` computes it (the official code calls it): the median of
    h(u, l) = ((u - m) + (l - m)) / (u - l) over pairs u >= m >= l, m the sample median (the mean of
    the two middle values for an even count); pairs of values tied at m get -1, 0 or 1 by their
    positions (-1 above the anti-diagonal of the ties' block, 0 on it, 1 below)."""
    y = np.sort(np.asarray(values, dtype=np.float64).ravel())
    n = len(y)
    middle = (y[n // 2 - 1] + y[n // 2]) / 2 if n % 2 == 0 else y[(n - 1) // 2]
    z = y - middle
    lower, upper = z[z <= 0], z[z >= 0][:, None]  # lower ascending; upper ascending down the rows
    spread = upper - lower
    tied = (lower == 0) & (upper == 0)
    spread[tied] = np.inf
    h = (upper + lower) / spread
    ties = int((lower == 0).sum())
    if ties:
        block = np.ones((ties, ties)) - np.eye(ties)
        block -= 2 * np.triu(block)
        h[:ties, -ties:] = np.fliplr(block)
    return float(np.median(h))


def adjusted_outlyingness(values: Tensor) -> Tensor:
    """Per value, its adjusted outlyingness (Hubert and Van der Veeken 2008), as the official code:
    the distance to the (lower) median over the distance from the median to the whisker of the
    skew-adjusted boxplot on that side, w = q1 - 1.5 e^(-4 MC) IQR and q3 + 1.5 e^(3 MC) IQR for
    MC > 0 (e^(-3 MC), e^(4 MC) otherwise)."""
    v = values.detach().flatten().double().cpu()
    med = v.median()  # torch's lower median, as the official
    q1, q3 = torch.quantile(v, torch.tensor([0.25, 0.75], dtype=torch.float64))
    mc = medcouple(v.numpy())
    iqr = q3 - q1
    if mc > 0:
        low, high = q1 - 1.5 * math.exp(-4 * mc) * iqr, q3 + 1.5 * math.exp(3 * mc) * iqr
    else:
        low, high = q1 - 1.5 * math.exp(-3 * mc) * iqr, q3 + 1.5 * math.exp(4 * mc) * iqr
    return torch.where(v > med, (v - med) / (high - med), (med - v) / (med - low))


def tail_threshold(losses: np.ndarray, eps: float) -> float:
    """The official `get_t`: a Gaussian (sklearn's one-component mixture: the mean, the biased variance
    plus its 1e-6 regularisation) fitted to the losses at or below their lower median, and
    t = mu + sigma sqrt(-2 ln(eps) sigma sqrt(2 pi)). Losses at or above t are flagged."""
    x = np.asarray(losses, dtype=np.float64).ravel()
    half = np.quantile(x, 0.5, method="lower")
    low = x[x <= half]
    sigma = math.sqrt(float(low.var()) + 1e-6)
    return float(sigma * math.sqrt(-2 * math.log(eps) * sigma * math.sqrt(2 * math.pi)) + low.mean())


class Discriminator(nn.Module):
    """The official `MLP`: ReLU hidden layers of 128 units and one sigmoid output, near 1 for a
    training sample's features and near 0 for a base sample's once trained."""

    def __init__(self, in_features: int, generator: torch.Generator) -> None:
        super().__init__()
        widths = [in_features] + [DISCRIMINATOR_WIDTH] * DISCRIMINATOR_LAYERS
        layers: list[nn.Module] = []
        for a, b in zip(widths, widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(widths[-1], 1))
        with torch.no_grad():  # torch's default init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), from the defense's stream
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    bound = 1 / math.sqrt(layer.in_features)
                    layer.weight.copy_(torch.rand(layer.weight.shape, generator=generator) * 2 * bound - bound)
                    layer.bias.copy_(torch.rand(layer.bias.shape, generator=generator) * 2 * bound - bound)

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(self.net(x)).flatten()


def suspects(train_features: Tensor, base_features: Tensor, *, steps: int, lr: float, cut: float,
             generator: torch.Generator) -> Tensor:
    """Indices of the training batch the official discriminator step singles out: a fresh MLP,
    `steps` rounds of one Adam step pulling the batch's outputs to 1 and one (a second Adam)
    pulling the base batch's to 0 (mean squared error), then the batch's outputs whose adjusted
    outlyingness exceeds `cut`."""
    net = Discriminator(train_features.shape[1], generator).to(train_features.device)
    toward_one = torch.optim.Adam(net.parameters(), lr=lr)
    toward_zero = torch.optim.Adam(net.parameters(), lr=lr)
    ones = torch.ones(len(train_features), device=train_features.device)
    zeros = torch.zeros(len(base_features), device=base_features.device)
    for _ in range(steps):
        for features, target, optimizer in ((train_features, ones, toward_one), (base_features, zeros, toward_zero)):
            net.zero_grad()
            F.mse_loss(net(features), target).backward()
            optimizer.step()
    with torch.no_grad():
        outputs = net(train_features)
    return torch.nonzero(adjusted_outlyingness(outputs) > cut).flatten()


class FeatureTap:
    """The victim's last conv stage's map, unpooled and flattened (the official drops the last child,
    the linear head, of its ResNet-18: layer4's 512 x 4 x 4 on CIFAR-10), in eval mode, no gradient."""

    def __init__(self, victim: nn.Module, probe: Tensor) -> None:
        self.victim = victim.eval()
        self.name, self.module = conv_stage_outputs(victim, probe)[-1]

    @torch.no_grad()
    def __call__(self, x: Tensor) -> Tensor:
        caught: list[Tensor] = []
        handle = self.module.register_forward_hook(lambda _m, _i, out: caught.append(out.float().flatten(1)))
        try:
            self.victim(x)
        finally:
            handle.remove()
        return caught[0]


@torch.no_grad()
def output_variance(model: nn.Module, split: Split, device: torch.device, batch_size: int) -> float:
    """The base-set objective: the mean over samples of the variance of the logits (eval mode)."""
    model.eval()
    total = 0.0
    for start in range(0, len(split), batch_size):
        total += float(model(to_float(split.images[start:start + batch_size].to(device))).float().var(1).sum())
    return total / max(1, len(split))


def offset(detector: nn.Module, tap: FeatureTap, train: Split, base: Split, *, epochs: int, batch_size: int,
           lr: float, discriminator_steps: int, discriminator_lr: float, cut: float, device: torch.device,
           generator: torch.Generator) -> dict[str, Any]:
    """The official SL offset loop on `detector` (trained in place). Per batch of the shuffled training
    set: (a) one Adam step minimising the mean variance of its logits on min(batch, |base|) random
    base samples; (b) the discriminator's suspects in the batch (`suspects`, on the victim's
    features); (c) one step of a second Adam on their negated cross-entropy, i.e. their loss
    maximised (skipped with fewer than 2 suspects)."""
    minimise = torch.optim.Adam(detector.parameters(), lr=lr)
    maximise = torch.optim.Adam(detector.parameters(), lr=lr)
    base_count = min(batch_size, len(base))
    ascended = skipped = 0
    for _ in track(range(epochs), "asset: offset", unit="epochs"):
        order = torch.randperm(len(train), generator=generator)
        for start, stop in batch_bounds(len(order), batch_size):
            idx = order[start:stop]
            x = to_float(train.images[idx].to(device))
            y = train.labels[idx].to(device)
            neg = to_float(base.images[torch.randperm(len(base), generator=generator)[:base_count]].to(device))
            detector.train()
            minimise.zero_grad()
            detector(neg).float().var(1).mean().backward()
            minimise.step()
            chosen = suspects(tap(x), tap(neg), steps=discriminator_steps, lr=discriminator_lr, cut=cut,
                              generator=generator).to(device)
            if len(chosen) < MIN_ASCENT:
                skipped += 1
                continue
            maximise.zero_grad()
            (-F.cross_entropy(detector(x[chosen]).float(), y[chosen])).backward()
            maximise.step()
            ascended += len(chosen)
    return {"ascended_samples": ascended, "skipped_batches": skipped}


class Asset(Defense):
    """ASSET (Pan, Zeng, Lyu, Lin, Jia, "ASSET: Robust Backdoor Data Detection Across a Multiplicity of
    Deep Learning Paradigms", USENIX Security 2023), its end-to-end supervised (SL) offset as the
    official demo notebook runs it.

    A fresh model of the run's architecture (the detector) is trained for one pass over the
    poisoned training set, batch by batch, in two opposite directions: one Adam step minimises
    the variance of its logits on a batch of the clean base set (clean inputs get flat outputs,
    so a near-uniform loss of about ln K), and a second Adam maximises its cross-entropy on the
    training samples of the batch that a freshly trained MLP discriminator (victim's last-stage
    features, batch -> 1, base -> 0, 100 alternating steps) scores as outliers (adjusted
    outlyingness > 2). The maximisation spreads to every sample carrying what the suspects
    share (the trigger), not to clean ones, which the base step holds flat. The score of a
    training sample is the detector's cross-entropy at its label, higher = more suspicious; the
    flag is the official rule: at or above mu + sigma sqrt(-2 ln(eps) sigma sqrt(2 pi)) of a
    Gaussian fitted to the lower half of the losses, eps = 1e-6. Ledger: docs/fidelity.md#asset.

    Departures: the victim's features are read in eval mode (the official copies the victim in
    training mode, so its batch norms use each batch's statistics and a sample's features depend
    on its batch) and once per batch (the official recomputes the same features in each of the
    100 discriminator steps); the map is the last conv stage's output through the real forward
    (the official's `children()[:-1]` also skips the stem's ReLU of its ResNet). A batch with
    fewer than 2 suspects skips the ascent, as BackdoorBench's port (the official would step on
    the mean of none, NaN). The base set is the defender's clean subset of the training set
    (2%, BackdoorBench's `ratio`; the official draws 1,000 from CIFAR-10's test set, also 2% of
    its training set). The losses are scored in eval mode (the official notebook scores the
    poisoned part in training mode by its ordering).
    Limit (measured, mnist5k, mnist_cnn, seed 0): at the official values no batch's suspects pass the
    cut (triggered samples rank higher under the discriminator, adjusted outlyingness about 1), so
    nothing is maximised and the losses do not separate (AUROC 0.53 BadNets, 0.51 Blended).
    """

    name = "asset"
    family = "loss_separation"
    sensitivity = ("tail_eps",)  # swept by conf/experiment/sensitivity_asset.yaml
    stage = "pre_train"
    needs_clean_data = True
    meets_training_controlled_attacks = False
    # The official budget costs about a minute of one CPU core on mnist5k (5,000 samples): no CPU preset.

    def __init__(self, *, epochs: int = 1, batch_size: int = 512, lr: float = 1e-4, discriminator_steps: int = 100,
                 discriminator_lr: float = 1e-4, outlyingness: float = 2.0, tail_eps: float = 1e-6,
                 clean_fraction: float = 0.02) -> None:
        super().__init__(clean_fraction=clean_fraction)
        self.epochs = checks.integer("defense", "epochs", epochs, 1, hint="the official: 1 pass")
        self.discriminator_steps = checks.integer("defense", "discriminator_steps", discriminator_steps, 1,
                                                  hint="the official: 100")
        self.batch_size = checks.integer("defense", "batch_size", batch_size, 2, hint="the official: 512")
        self.lr = float(checks.number("defense", "lr", lr, 0, low_open=True, hint="the official Adam: 1e-4"))
        self.discriminator_lr = float(checks.number("defense", "discriminator_lr", discriminator_lr, 0, low_open=True,
                                                    hint="the official Adam: 1e-4"))
        self.outlyingness = float(checks.number("defense", "outlyingness", outlyingness, 0, low_open=True,
                                                hint="the official cut: 2"))
        self.tail_eps = float(checks.number("defense", "tail_eps", tail_eps, 0, 1, low_open=True, high_open=True,
                                            hint="the official threshold's eps: 1e-6"))

    def check_model(self, model: nn.Module) -> None:
        features = getattr(model, "features", None)
        if not isinstance(features, nn.Module) or not any(isinstance(m, nn.Conv2d) for m in features.modules()):
            raise ConfigError(f"defense=asset reads the last conv stage's feature map, but "
                              f"{getattr(model, 'name', type(model).__name__)!r} has no nn.Conv2d in its `features`; "
                              "choose a convolutional model")

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        require_clean_subset(ctx, self.name)
        if ctx.build_model is None:
            raise ConfigError("defense asset trains a fresh model and needs ctx.build_model")
        device = torch.device(ctx.trainer.device)
        train, base = ctx.poisoned_train, ctx.clean_subset
        batch = ctx.trainer.eval_batch_size
        tap = FeatureTap(ctx.model.to(device), to_float(train.images[:2].to(device)))
        detector = ctx.build_model().to(device)
        stats = offset(detector, tap, train, base, epochs=self.epochs, batch_size=self.batch_size, lr=self.lr,
                       discriminator_steps=self.discriminator_steps, discriminator_lr=self.discriminator_lr,
                       cut=self.outlyingness, device=device, generator=ctx.generator)
        losses = per_sample_loss(detector, train, device, batch)
        threshold = tail_threshold(losses.numpy(), self.tail_eps)
        flagged = losses >= threshold
        base_losses = per_sample_loss(detector, base, device, batch)
        extras = {**stats, "threshold": threshold, "n_flagged": int(flagged.sum()), "layer": tap.name,
                  "base_loss": float(base_losses.mean()), "base_output_variance": output_variance(detector, base, device, batch),
                  "train_loss_median": float(losses.median())}
        return DefenseResult(sample_scores=losses, flagged=flagged, extras=extras)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "epochs": self.epochs, "batch_size": self.batch_size,
                "lr": self.lr, "discriminator_steps": self.discriminator_steps, "discriminator_lr": self.discriminator_lr,
                "outlyingness": self.outlyingness, "tail_eps": self.tail_eps}
