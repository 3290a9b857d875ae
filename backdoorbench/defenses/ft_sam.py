"""FT-SAM: fine-tuning on the clean subset with an adaptive sharpness-aware (ASAM) step."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from backdoorbench import checks
from backdoorbench.defenses.base import DefenseContext, DefenseResult
from backdoorbench.defenses.fine_pruning import require_clean_subset
from backdoorbench.defenses.fine_tuning import FineTuning
from backdoorbench.errors import ConfigError

# Added to the norm of the scaled gradient before dividing by it, as BackdoorBench's `perturb_eps`.
NORM_EPS = 1e-12


def sharpness_perturbation(params: Sequence[Tensor], grads: Sequence[Tensor | None], rho: float, *,
                           adaptive: bool = True, eta: float = 0.0) -> list[Tensor | None]:
    """The weight perturbation of one (A)SAM step: e_w = rho T_w^2 g / ||T_w g||, the norm over every
    parameter that has a gradient, with T_w = |w| + eta elementwise (adaptive, ASAM) or 1 (plain SAM,
    e_w = rho g / ||g||). None where a parameter has no gradient (it is not perturbed)."""
    scales = [None if g is None else (w.detach().abs() + eta if adaptive else torch.ones_like(w))
              for w, g in zip(params, grads)]
    norms = [(t * g).norm(2) for t, g in zip(scales, grads) if g is not None]
    if not norms:
        return [None] * len(params)
    factor = rho / (torch.stack(norms).norm(2) + NORM_EPS)
    return [None if g is None else factor * t * t * g for t, g in zip(scales, grads)]


def smoothed_cross_entropy(logits: Tensor, y: Tensor, smoothing: float) -> Tensor:
    """BackdoorBench's `smooth_crossentropy`, averaged over the batch: KL(q || softmax(logits)) with
    q = 1 - smoothing on the label and smoothing / (K - 1) on each other class; cross-entropy at 0."""
    log_p = F.log_softmax(logits.float(), dim=1)
    q = torch.full_like(log_p, smoothing / max(log_p.shape[1] - 1, 1))
    q.scatter_(1, y[:, None], 1.0 - smoothing)
    return F.kl_div(log_p, q, reduction="none").sum(1).mean()


@contextmanager
def frozen_running_stats(model: nn.Module) -> Iterator[None]:
    """Normalisation layers in training mode normalise with the batch's statistics but leave their
    running statistics as they were (BackdoorBench sets BN momentum to 0 for the second pass)."""
    tracking = [m for m in model.modules() if isinstance(m, _NormBase) and m.track_running_stats]
    for module in tracking:
        module.track_running_stats = False
    try:
        yield
    finally:
        for module in tracking:
            module.track_running_stats = True


class SharpnessAwareStep:
    """One ASAM step split between the trainer's two hooks.

    As the trainer's `step`: the loss and its gradient at w, the weights moved to w + e_w
    (`sharpness_perturbation`), and the loss at w + e_w returned for the trainer to differentiate;
    as a step pre-hook of the trainer's optimizer (`attach`): w restored, so the optimizer updates w
    with the gradient taken at w + e_w (weight decay and momentum at w, as BackdoorBench's base
    optimizer). The second pass leaves batch-norm running statistics alone."""

    def __init__(self, *, rho: float, adaptive: bool = True, eta: float = 0.0, label_smoothing: float = 0.0) -> None:
        self.rho, self.adaptive, self.eta, self.label_smoothing = rho, adaptive, eta, label_smoothing
        self.saved: list[tuple[Tensor, Tensor]] = []  # (parameter, its value at w) while perturbed
        self.last_perturbation: list[Tensor | None] = []  # e_w of the latest step, one per trained parameter

    def loss(self, logits: Tensor, y: Tensor) -> Tensor:
        return smoothed_cross_entropy(logits, y, self.label_smoothing)

    def __call__(self, model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.saved:
            raise RuntimeError("an FT-SAM step began with the weights still perturbed: the optimizer never "
                               "stepped; attach() its optimizer")
        params = [p for p in model.parameters() if p.requires_grad]
        logits = model(x)
        grads = torch.autograd.grad(self.loss(logits, y), params, allow_unused=True)
        with torch.no_grad():
            perturbation = sharpness_perturbation(params, grads, self.rho, adaptive=self.adaptive, eta=self.eta)
            self.saved = [(p, p.detach().clone()) for p, e in zip(params, perturbation) if e is not None]
            for p, e in zip(params, perturbation):
                if e is not None:
                    p.add_(e)
        self.last_perturbation = perturbation
        with frozen_running_stats(model):
            sharp_loss = self.loss(model(x), y)
        # The accuracy the epoch reports is the unperturbed pass's, as BackdoorBench's.
        return sharp_loss, logits.detach(), y

    def restore(self, *_) -> None:
        """Put back the weights the step perturbed (the optimizer's step pre-hook)."""
        with torch.no_grad():
            for p, value in self.saved:
                p.copy_(value)
        self.saved = []

    def attach(self, make_optimizer):
        """`make_optimizer` (the trainer's factory) wrapped so that each optimizer it makes restores w
        before every step."""
        def make(params, *args, **kwargs):
            optimizer = make_optimizer(params, *args, **kwargs)
            optimizer.register_step_pre_hook(self.restore)
            return optimizer
        return make


class FTSAM(FineTuning):
    """FT-SAM (Zhu, Wei, Shen, Fan, Wu, "Enhancing Fine-Tuning Based Backdoor Defense with
    Sharpness-Aware Minimization", ICCV 2023; code: BackdoorBench, `defense/ft-sam.py`).
    Ledger: docs/fidelity.md#ft-sam.

    Fine-tuning on the clean subset in which every step is an adaptive sharpness-aware one (ASAM):
    the gradient g at w moves every trained parameter to w + e_w, e_w = rho T_w^2 g / ||T_w g||
    with T_w = |w| + eta (eta 0 in BackdoorBench: T_w = |w|), and the optimizer updates w with the
    gradient at w + e_w. The perturbation grows with |w|^2, so the neurons of large norm the paper
    finds the backdoor in are pushed hardest and shrink. Loss: BackdoorBench's label-smoothed
    cross-entropy (0.1) in both passes; the second pass leaves the batch-norm running statistics as
    they were. rho 2. The rest is `fine_tuning`'s: the run's trainer (optimizer, augmentation,
    precision), lr 0.01 for `epochs` under its cosine with the half period `cosine_period`
    (BackdoorBench's T_max 100).

    Departures: one value on every dataset, BackdoorBench's default and CIFAR-10 one; its GTSRB and
    Tiny-ImageNet files set rho 8 and no label smoothing (GTSRB also 50 epochs), which
    `defense.rho=8 defense.label_smoothing=0` matches. BackdoorBench steps its
    CosineAnnealingLR(T_max=100) once a batch, so its lr falls to 0 and rises again every 200 steps
    (20 epochs on CIFAR-10) and ends the 100 epochs at 0.01; ours steps it once an epoch, as
    `fine_tuning` (the same mean lr over 100 epochs). Batch size and precision are the run's
    (BackdoorBench: 256, fp32); its clean subset is drawn per class, ours from the whole set.
    Budgets: `official` 100 epochs (BackdoorBench's), `cpu` 10.
    """

    name = "ft_sam"
    family = "fine_tuning"
    sensitivity = ("rho",)  # swept by conf/experiment/sensitivity_ft_sam.yaml
    aliases = ("ftsam",)
    stage = "post_train"
    BUDGETS = {"official": {"epochs": 100}, "cpu": {"epochs": 10}}

    def __init__(self, *, budget: str = "official", epochs: int | None = None, lr: float = 0.01,
                 cosine_period: int | None = 100, rho: float = 2.0, adaptive: bool = True, eta: float = 0.0,
                 label_smoothing: float = 0.1, clean_fraction: float = 0.05) -> None:
        super().__init__(budget=budget, epochs=epochs, lr=lr, cosine_period=cosine_period,
                         clean_fraction=clean_fraction)
        self.rho = checks.number("defense", "rho", rho, 0, low_open=True,
                                 hint="the radius of the weight perturbation; BackdoorBench 2, 8 on GTSRB and Tiny-ImageNet")
        if not isinstance(adaptive, bool):
            raise ConfigError(f"defense.adaptive={adaptive!r} is invalid; use true (ASAM, BackdoorBench's) "
                              f"or false (plain SAM)")
        self.adaptive = adaptive
        self.eta = checks.number("defense", "eta", eta, 0, hint="added to |w| in ASAM's T_w; BackdoorBench 0")
        self.label_smoothing = checks.number("defense", "label_smoothing", label_smoothing, 0, 1, high_open=True)

    def sam_step(self) -> SharpnessAwareStep:
        return SharpnessAwareStep(rho=self.rho, adaptive=self.adaptive, eta=self.eta,
                                  label_smoothing=self.label_smoothing)

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        require_clean_subset(ctx, self.name)
        model = copy.deepcopy(ctx.model)
        step = self.sam_step()
        tuner = self.tuner(ctx.trainer)
        tuner.optimizer = step.attach(ctx.trainer.optimizer)
        history = tuner.fit(model, ctx.clean_subset, generator=ctx.generator, lr=self.lr, step=step, desc="ft-sam")
        # the loss at the perturbed weights, the one the steps minimise
        return DefenseResult(model=model, extras={"final_loss": history[-1]["loss"], "final_lr": history[-1]["lr"]})

    def describe(self) -> dict:
        return {**super().describe(), "rho": self.rho, "adaptive": self.adaptive, "eta": self.eta,
                "label_smoothing": self.label_smoothing}
