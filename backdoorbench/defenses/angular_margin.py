"""Angular-margin weight penalty on a bias-free, tanh-fed classification layer (in-training)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.errors import ConfigError


def simplex_gram(num_classes: int, scale: float, device=None, dtype=torch.float32) -> Tensor:
    """s^2 G with G = C/(C-1) I - 1/(C-1) 11^T: the Gram matrix of C vectors of norm s whose
    pairwise cosines are all -1/(C-1), the vertices of a regular simplex (largest equal angles)."""
    c = num_classes
    eye = torch.eye(c, device=device, dtype=dtype)
    ones = torch.ones(c, c, device=device, dtype=dtype)
    return (scale**2) * (c / (c - 1) * eye - ones / (c - 1))


def simplex_penalty(weight: Tensor, scale: float) -> Tensor:
    """||W W^T - s^2 G||_F (not squared, as in the authors' code) for the (C, d) weight W."""
    with torch.autocast(weight.device.type, enabled=False):
        w = weight.float()
        return torch.linalg.matrix_norm(w @ w.T - simplex_gram(w.shape[0], scale, w.device))


class SimplexHead(nn.Module):
    """BatchNorm1d -> tanh -> bias-free linear: the classification part the penalty acts on.

    A factory for `head=` (called as `SimplexHead(in_features, num_classes)`); the model is built
    with `feature_act=nn.Identity` so this tanh replaces the usual ReLU on the features.
    """

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        if in_features < num_classes - 1:
            raise ConfigError(
                f"angular_margin needs penultimate features of at least num_classes - 1 = {num_classes - 1} "
                f"dimensions for a regular simplex, the model gives {in_features}"
            )
        self.norm = nn.BatchNorm1d(in_features)
        self.act = nn.Tanh()
        self.linear = nn.Linear(in_features, num_classes, bias=False)

    def forward(self, features: Tensor) -> Tensor:
        return self.linear(self.act(self.norm(features)))


def head_weight(model: nn.Module) -> Tensor:
    """The (C, d) weight the penalty reads: `model.classifier` must be a SimplexHead."""
    head = getattr(model, "classifier", None)
    if not isinstance(head, SimplexHead):
        raise ConfigError(
            f"angular_margin needs a model whose classifier is a SimplexHead, got {type(head).__name__}; "
            "the model must accept the head= and feature_act= constructor arguments"
        )
    return head.linear.weight


class AngularMargin(Defense):
    """Weight penalization on the classification layer (Xu, Li, Yang, "Improve Adversarial
    Robustness via Weight Penalization on Classification Layer", arXiv 2010.03844, 2020).

    Robustness is tied to the angles between the class weights of the last layer: the model is
    retrained with tanh(BN(features)) feeding a bias-free linear layer W (C x d) and the loss
    CE + lambda * ||W W^T - s^2 G||_F, which pulls the C rows of W to norm s and to a regular
    simplex (all pairwise cosines -1/(C-1), the largest equal angular margins).
    As the authors' code (github.com/MTandHJ/rbc, `RbcLoss`, `models/*rbc.py`): the Frobenius norm
    is not squared; lambda = 100, s = 0.1 (their `leverage`, `scale`); BN sits right before tanh
    on the penultimate vector (their `dense` ends in BatchNorm1d, then `Tanh`, then
    `Linear(bias=False)`). lambda = 0 keeps the tanh head without the penalty (the control that
    separates the head from the penalty).
    The authors' recipe is the preset `paper=angular_margin/mnist` (conf/paper/angular_margin/):
    their MNIST network (`model=rbc_mnist`, d = 200), Adam at lr 0.01, constant, no weight decay,
    no augmentation, 400 epochs, and their evaluation (PGD with a random start, 100 steps of
    eps/30) at several eps with the CE and the CW loss, plus a transfer attack from the plain
    model. It applies to the victim too, so the plain model A and the defended model B of one run
    are trained alike. Departures: the model is trained by the attacker's own procedure (the run's
    trainer, in the run's precision; the penalty itself is computed in float32), so without the preset it is
    our default SGD (momentum 0.9, cosine, wd 5e-4, crop augmentation), where the unsquared
    penalty's constant-size gradient moves W by a large share of its norm each step; our input
    normalization (MNIST mean/std; the authors feed [0, 1]) is absorbed by the first conv's BN
    (valid convolutions, no padding); with `model=mnist_cnn` the penultimate dropout sits between
    the last hidden linear layer and the BN.
    Its purpose here: to measure whether a margin on the classifier's weights alone, with no
    knowledge of the trigger, changes a backdoor's success (the paper claims adversarial
    robustness only; it makes no backdoor claim), and to check the paper's robustness claim.
    Ledger: docs/fidelity.md#angular-margin.
    """

    name = "angular_margin"
    family = "training_objective"
    sensitivity = ("penalty_weight",)  # swept by conf/experiment/sensitivity_angular_margin.yaml
    aliases = ("am",)
    stage = "in_train"
    needs_clean_data = False

    def __init__(self, *, penalty_weight: float = 100.0, scale: float = 0.1, clean_fraction: float = 0.0) -> None:
        super().__init__(clean_fraction=clean_fraction)
        checks.number("defense", "penalty_weight", penalty_weight, 0, high_open=True, hint="0 = the tanh head alone")
        checks.number("defense", "scale", scale, 0, low_open=True, high_open=True)
        self.penalty_weight = float(penalty_weight)
        self.scale = float(scale)

    def build(self, ctx: DefenseContext) -> nn.Module:
        """A fresh model of the run's architecture with the simplex head on tanh features."""
        if ctx.build_model is None or ctx.train_victim is None:
            raise RuntimeError("angular_margin needs ctx.build_model and ctx.train_victim (in-training defense)")
        try:
            return ctx.build_model(head=SimplexHead, feature_act=nn.Identity)
        except TypeError as exc:
            raise ConfigError(
                f"the model does not take head= and feature_act= arguments ({exc}); angular_margin needs both"
            ) from exc

    def wrap_step(self, step):
        """The attacker's step with lambda * penalty added to its loss."""

        def penalized(model: nn.Module, x: Tensor, y: Tensor):
            loss, logits, scored = step(model, x, y)
            return loss + self.penalty_weight * simplex_penalty(head_weight(model), self.scale), logits, scored

        return penalized

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        model = self.build(ctx)
        initial = float(simplex_penalty(head_weight(model).detach(), self.scale))
        ctx.train_victim(model, wrap_step=self.wrap_step)
        return DefenseResult(model=model, extras={"penalty_initial": initial, **weight_geometry(head_weight(model), self.scale)})

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "penalty_weight": self.penalty_weight, "scale": self.scale}


@torch.no_grad()
def weight_geometry(weight: Tensor, scale: float) -> dict[str, float]:
    """How close the trained W is to the simplex: final penalty, row norms, smallest angle."""
    w = weight.detach().float()
    norms = w.norm(dim=1)
    cosines = F.normalize(w, dim=1) @ F.normalize(w, dim=1).T
    off_diagonal = cosines[~torch.eye(len(w), dtype=torch.bool, device=w.device)]
    return {
        "penalty_final": float(simplex_penalty(w, scale)),
        "row_norm_mean": float(norms.mean()),
        "max_pairwise_cosine": float(off_diagonal.max()),  # simplex: -1/(C-1)
    }
