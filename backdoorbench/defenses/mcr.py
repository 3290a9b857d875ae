"""MCR: mode connectivity repair, a curve in weight space between two models trained on clean data."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm

from backdoorbench import checks
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.defenses.fine_pruning import require_clean_subset
from backdoorbench.errors import ConfigError
from backdoorbench.train.batches import to_device
from backdoorbench.train.recipes import recipe


def bezier_coefficients(t: Tensor, bends: int) -> Tensor:
    """The Bernstein weights of a Bezier curve with `bends` control points at t:
    C(n, k) t^k (1 - t)^(n - k), n = bends - 1 (the official `curves.Bezier`)."""
    n = bends - 1
    k = torch.arange(bends, dtype=t.dtype, device=t.device)
    binom = torch.tensor([math.comb(n, j) for j in range(bends)], dtype=t.dtype, device=t.device)
    return binom * t.pow(k) * (1 - t).pow(n - k)


def polychain_coefficients(t: Tensor, bends: int) -> Tensor:
    """The weights of the broken line through the control points (the official `curves.PolyChain`)."""
    k = torch.arange(bends, dtype=t.dtype, device=t.device)
    return (1 - (t * (bends - 1) - k).abs()).clamp_min(0)


CURVES = {"bezier": bezier_coefficients, "polychain": polychain_coefficients}


def lr_factor(progress: float) -> float:
    """The official curve schedule (`train.py`'s learning_rate_schedule) at progress = epoch / epochs
    (epoch 1-based): 1 for the first half, then linear down to 0.01 at 90%, then 0.01."""
    if progress <= 0.5:
        return 1.0
    if progress <= 0.9:
        return 1.0 - (progress - 0.5) / 0.4 * 0.99
    return 0.01


class ModeCurve(nn.Module):
    """A curve of weights theta(t) = sum_j c_j(t) theta_j through `bends` control points, from the
    parameters of `start` (t = 0) to those of `end` (t = 1). The end points are frozen buffers; the
    interior control points are the only parameters, initialised on the segment between the ends
    (the official `init_linear`). `net` is a copy of `start` that runs with theta(t) in place of its
    own parameters; its batch-norm running statistics are shared along the curve, as the official
    `CurveNet`'s, and recomputed for the one point taken out (`model_at`)."""

    def __init__(self, start: nn.Module, end: nn.Module, *, bends: int = 3, curve: str = "bezier") -> None:
        super().__init__()
        self.net = copy.deepcopy(start)
        self.net.requires_grad_(False)
        self.names = [name for name, _ in start.named_parameters()]
        ends = dict(end.named_parameters())
        if list(ends) != self.names or any(ends[n].shape != p.shape for n, p in start.named_parameters()):
            raise ValueError("the two ends of a curve must be the same architecture")
        self.bends, self.curve = bends, curve
        self.coefficients = CURVES[curve]
        first = {n: p.detach().clone() for n, p in start.named_parameters()}
        last = {n: ends[n].detach().clone() for n in self.names}
        for i, name in enumerate(self.names):
            self.register_buffer(f"start_{i}", first[name])
            self.register_buffer(f"end_{i}", last[name])
        self.interior = nn.ParameterList()
        for j in range(1, bends - 1):
            alpha = j / (bends - 1)
            self.interior.extend(nn.Parameter(alpha * last[n] + (1 - alpha) * first[n]) for n in self.names)

    def points(self, i: int) -> list[Tensor]:
        """The control points of the i-th parameter, from start to end."""
        count = len(self.names)
        inner = [self.interior[j * count + i] for j in range(self.bends - 2)]
        return [getattr(self, f"start_{i}"), *inner, getattr(self, f"end_{i}")]

    def weights(self, t: Tensor | float) -> dict[str, Tensor]:
        """theta(t), parameter name -> tensor (differentiable in the interior control points)."""
        t = torch.as_tensor(t, dtype=torch.float32, device=getattr(self, "start_0").device)
        c = self.coefficients(t, self.bends)
        out = {}
        for i, name in enumerate(self.names):
            points = self.points(i)
            w = c[0] * points[0]
            for cj, point in zip(c[1:], points[1:]):
                w = w + cj * point
            out[name] = w
        return out

    def forward(self, x: Tensor, t: Tensor | float) -> Tensor:
        return functional_call(self.net, self.weights(t), (x,))

    @torch.no_grad()
    def model_at(self, t: float) -> nn.Module:
        """A plain model with the weights theta(t) (batch-norm statistics still the curve's)."""
        model = copy.deepcopy(self.net)
        weights = self.weights(t)
        for name, param in model.named_parameters():
            param.copy_(weights[name])
        return model.requires_grad_(True)


@torch.no_grad()
def recompute_batch_norm(model: nn.Module, images: Tensor, *, batch_size: int, device: torch.device,
                         autocast=None) -> int:
    """The official `update_bn`: every batch-norm layer's running statistics reset and recomputed
    as the size-weighted mean over `images` (uint8), one pass in training mode. Returns the number
    of layers (0: nothing to do)."""
    layers = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    if not layers:
        return 0
    momenta = [m.momentum for m in layers]
    was_training = model.training
    model.train()
    for m in layers:
        m.reset_running_stats()
    seen = 0
    for start in range(0, len(images), batch_size):
        x = to_float(to_device(images[start:start + batch_size], device))
        for m in layers:
            m.momentum = len(x) / (seen + len(x))
        if autocast is None:
            model(x)
        else:
            with autocast():
                model(x)
        seen += len(x)
    for m, momentum in zip(layers, momenta):
        m.momentum = momentum
    model.train(was_training)
    return len(layers)


class CurveStep:
    """One official curve step as the trainer's `step`: t ~ U(0, 1) once per batch (from the
    defense's generator), cross-entropy of theta(t) plus the official regulariser
    0.5 * weight_decay * ||theta(t)||^2 over every parameter of the curve."""

    def __init__(self, generator: torch.Generator, weight_decay: float) -> None:
        self.generator, self.weight_decay = generator, weight_decay
        self.ts: list[float] = []

    def __call__(self, curve: ModeCurve, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        t = torch.rand((), generator=self.generator).item()
        self.ts.append(t)
        weights = curve.weights(t)
        logits = functional_call(curve.net, weights, (x,))
        loss = F.cross_entropy(logits, y)
        if self.weight_decay:
            loss = loss + 0.5 * self.weight_decay * sum(w.float().pow(2).sum() for w in weights.values())
        return loss, logits, y


class ModeConnectivityRepair(Defense):
    """MCR (Zhao, Chen, Das, Ramamurthy, Lin, "Bridging Mode Connectivity in Loss Landscapes and
    Adversarial Robustness", ICLR 2020; code: IBM/model-sanitization, `backdoor/backdoor-cifar`;
    BackdoorBench's `defense/mcr.py`). Ledger: docs/fidelity.md#mcr.

    Two models, the attacked one (t = 0) and a second end point (t = 1), are joined by a quadratic
    Bezier curve theta(t) = (1-t)^2 theta_0 + 2t(1-t) theta_mid + t^2 theta_1 whose middle control
    point alone is trained on the clean subset: it starts at (theta_0 + theta_1) / 2, and each batch
    draws t ~ U(0, 1) and descends the cross-entropy of theta(t) plus 0.5 wd ||theta(t)||^2 (SGD,
    momentum 0.9, the official schedule: lr flat for half the epochs, then down to 1% at 90%). The
    repaired model is theta(`t`), its batch-norm statistics recomputed on the clean subset (the
    official `update_bn`). The paper finds the backdoor gone in the interior of the path while clean
    accuracy stays.

    The second end point: the official experiments join two backdoored models trained apart; the
    defender here holds one, so, as BackdoorBench, it is the attacked model fine-tuned on the clean
    subset (the run's trainer, lr 0.01, cosine with T_max 100, `ft_epochs` epochs).
    Departures: curve training as the official `train.py` (lr 0.01, wd 1e-4 as the regulariser,
    100 epochs, no augmentation: its training set has the test transform), not BackdoorBench's (lr
    3e-5, cosine, weight decay on the control point, its augmented clean loader; its loop never
    zeroes the aggregate model's gradients, so each step's gradient is the sum of all before).
    t = 0.1, BackdoorBench's (the official code sweeps t over a grid and reports the path); the clean
    data is `clean_fraction` 5% of the training set (BackdoorBench's `ratio`), where the official
    run repeats 50 test images to 5,000.
    """

    name = "mcr"
    family = "mode_connectivity"
    sensitivity = ("t",)  # swept by conf/experiment/sensitivity_mcr.yaml
    aliases = ("mode_connectivity",)
    stage = "post_train"
    BUDGETS = {"official": {"epochs": 100, "ft_epochs": 100}, "cpu": {"epochs": 20, "ft_epochs": 20}}

    def __init__(self, *, budget: str = "official", t: float = 0.1, curve: str = "bezier", bends: int = 3,
                 epochs: int | None = None, lr: float = 0.01, momentum: float = 0.9, weight_decay: float = 1e-4,
                 batch_size: int = 128, ft_epochs: int | None = None, ft_lr: float = 0.01,
                 ft_cosine_period: int | None = 100, clean_fraction: float = 0.05) -> None:
        super().__init__(clean_fraction=clean_fraction)
        preset = self.resolve_budget(budget, epochs=epochs, ft_epochs=ft_epochs)
        self.t = checks.number("defense", "t", t, 0, 1, hint="the point of the curve returned; 0 = the attacked model, "
                                                          "1 = the fine-tuned one; BackdoorBench 0.1")
        if curve not in CURVES:
            raise ConfigError(f"defense.curve={curve!r} is unknown; choose one of: {', '.join(CURVES)}")
        self.curve = curve
        self.bends = checks.integer("defense", "bends", bends, 3, hint="control points of the curve, ends included; official 3")
        self.epochs = checks.integer("defense", "epochs", preset["epochs"], 1)
        self.lr = checks.number("defense", "lr", lr, 0, low_open=True)
        self.momentum = checks.number("defense", "momentum", momentum, 0, 1, high_open=True)
        self.weight_decay = checks.number("defense", "weight_decay", weight_decay, 0)
        self.batch_size = checks.integer("defense", "batch_size", batch_size, 1)
        self.ft_epochs = checks.integer("defense", "ft_epochs", preset["ft_epochs"], 1)
        self.ft_lr = checks.number("defense", "ft_lr", ft_lr, 0, low_open=True)
        self.ft_cosine_period = checks.integer("defense", "ft_cosine_period", ft_cosine_period, 1, allow_none=True,
                                               hint="epochs of the fine-tuning cosine's half period, BackdoorBench's T_max 100")

    def fine_tuned_end(self, ctx: DefenseContext) -> nn.Module:
        """The second end point: the attacked model fine-tuned on the clean subset (BackdoorBench's)."""
        end = copy.deepcopy(ctx.model)
        tuner = copy.copy(ctx.trainer)
        tuner.epochs, tuner.schedule_period = self.ft_epochs, self.ft_cosine_period
        tuner.fit(end, ctx.clean_subset, generator=ctx.generator, lr=self.ft_lr, desc="mcr fine-tune")
        return end.eval()

    def train_curve(self, curve: ModeCurve, clean: Split, ctx: DefenseContext) -> list[dict]:
        """The interior control points trained on `clean` by the official recipe."""
        trainer = recipe(ctx.trainer, epochs=self.epochs, momentum=self.momentum, weight_decay=0.0,
                         augment=False, batch_size=self.batch_size)
        epochs = self.epochs
        # the trainer asks for epoch e (0-based) at progress e / epochs; the official schedule is read at
        # (e + 1) / epochs
        trainer.schedule = lambda progress: lr_factor(progress + 1 / epochs)
        step = CurveStep(ctx.generator, self.weight_decay)
        history = trainer.fit(curve, clean, generator=ctx.generator, epochs=epochs, lr=self.lr, step=step,
                              desc="mcr curve")
        return history

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        require_clean_subset(ctx, self.name)
        start = copy.deepcopy(ctx.model).eval()
        end = self.fine_tuned_end(ctx)
        curve = ModeCurve(start, end, bends=self.bends, curve=self.curve)
        history = self.train_curve(curve, ctx.clean_subset, ctx)
        model = curve.model_at(self.t)
        trainer = ctx.trainer
        recompute_batch_norm(model, ctx.clean_subset.images, batch_size=self.batch_size, device=trainer.device,
                             autocast=trainer.autocast)
        return DefenseResult(model=model.eval(), extras={"t": self.t, "final_curve_loss": history[-1]["loss"]})

    def describe(self) -> dict:
        return {**super().describe(), "budget": self.budget, "t": self.t, "curve": self.curve, "bends": self.bends,
                "epochs": self.epochs, "lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay,
                "batch_size": self.batch_size, "ft_epochs": self.ft_epochs, "ft_lr": self.ft_lr,
                "ft_cosine_period": self.ft_cosine_period}
