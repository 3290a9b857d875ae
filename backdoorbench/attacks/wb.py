"""WB (Wasserstein Backdoor): LIRA-style learned noise whose latent features match clean ones."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.attacks.lira import LIRA, joint_forward
from backdoorbench.errors import ConfigError

REFERENCES = ("target_class", "batch")


def wasserstein_1d(u: Tensor, v: Tensor, p: float = 2.0) -> Tensor:
    """W_p^p between the empirical distributions of each row of u (K, n) and of v (K, m).

    Exact for any n, m: both quantile functions are step functions, so the integral of
    |F_u^-1(t) - F_v^-1(t)|^p over t in (0, 1) is a sum over the merged breakpoints i/n and j/m.
    For n == m it is the mean of |sort(u) - sort(v)|^p.
    """
    su = u.sort(dim=1).values
    sv = v.sort(dim=1).values
    n, m = su.shape[1], sv.shape[1]
    if n == 0 or m == 0:
        raise ValueError("the Wasserstein distance needs at least one sample on each side")
    if n == m:
        return (su - sv).abs().pow(p).mean(dim=1)
    device = su.device
    levels = torch.cat([torch.arange(1, n + 1, device=device) / n, torch.arange(1, m + 1, device=device) / m]).sort().values
    widths = torch.diff(levels, prepend=levels.new_zeros(1))
    middles = levels - widths / 2  # strictly inside each interval, so floor() finds the step
    iu = (middles * n).floor().long().clamp(0, n - 1)
    iv = (middles * m).floor().long().clamp(0, m - 1)
    return ((su[:, iu] - sv[:, iv]).abs().pow(p) * widths.to(su.dtype)).sum(dim=1)


def sliced_wasserstein(a: Tensor, b: Tensor, directions: Tensor, p: float = 2.0) -> Tensor:
    """Mean over the unit `directions` (K, d) of W_p^p between the projections of a (n, d) and b (m, d)."""
    return wasserstein_1d(directions @ a.T, directions @ b.T, p).mean()


def classifier_directions(model: nn.Module) -> Tensor:
    """The rows w_c / ||w_c|| of the last linear layer (detached: slicing directions, not variables).

    `model.classifier` is a Linear, or a head holding one (e.g. the angular-margin defense's
    BN -> tanh -> Linear head, when that defense retrains a model the WB way): its last Linear is used.
    """
    head = model.classifier
    linears = [head] if isinstance(head, nn.Linear) else [m for m in head.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise TypeError(f"wb needs a linear last layer in model.classifier, got {type(head).__name__}")
    return F.normalize(linears[-1].weight.detach().float(), dim=1)


class WB(LIRA):
    """WB (Doan, Lao, Li, "Backdoor Attack with Imperceptible Input and Latent Modification",
    NeurIPS 2021).

    LIRA's eps-bounded generator noise plus a Wasserstein regularizer: the penultimate features of
    triggered inputs are pulled onto those of clean inputs, measured by a sliced Wasserstein
    distance along the rows of the classifier's last layer, so latent-space defenses see no
    separate cluster. Trained by stochastic alternating optimization (per batch one generator
    step, then one classifier step), then LIRA's stage II with the generator frozen.

    No official code exists; each choice we made, and why:
    - Reference set (`latent_reference`): `target_class` (default) compares the features of
      triggered samples with target t against those of the batch's CLEAN samples of class t
      (per target class, weighted by the triggered count; all2all groups by target). The
      classifier must send triggered inputs to t, and latent defenses inspect each class's
      representations, so it is the target class's clean latents the backdoor must look like.
      Matching triggered latents to the whole clean batch (`batch`, what public
      re-implementations do) fights the cross-entropy along exactly these directions: their
      projections are the logits (minus bias) scaled by 1/||w_c||.
    - Distance: the 1-D W_p^p per direction, exact for unequal sample counts, averaged over the C
      directions, with p = `wasserstein_order` = 1 (not squared): in feature units its gradient
      stays bounded, whereas W_2^2 in the classifier's loss reached values of 500 and wrecked
      training. Clean features and directions are detached (they are the reference).
    - Weights: generator loss = CE(f(T(x)), target) + `beta` * SWD (beta = 1); classifier loss =
      LIRA's combined CE + `beta_classifier` * SWD (0.1), in stage II only. The classifier term is
      our addition: with the generator term alone the final model's triggered latents were as far
      from the clean target latents as LIRA's (W_2^2 along the classifier directions 7.6 vs 7.4 on
      mnist5k), since stage II re-learns the features; with it, 0.53. In stage I, before f can
      tell the trigger apart, the term pulls every latent onto the target class (CA 10%), and at
      beta_classifier = 1 it does so in stage II too, hence 0.1 after stage I.
    - Schedule: as LIRA (stage I for `stage1_epochs`, stage II for `trainer.epochs` at
      `test_eps`), without the look-ahead (`lookahead=false`, LIRA's default too): the paper
      describes a plain alternating scheme. eps, test_eps, alpha and poison_rate as LIRA.
    """

    name = "wb"

    def __init__(
        self,
        *,
        beta: float = 1.0,
        beta_classifier: float = 0.1,
        latent_reference: str = "target_class",
        wasserstein_order: float = 1.0,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.wasserstein_order = checks.number("attack", "wasserstein_order", wasserstein_order, 1.0, 2.0)
        self.beta = checks.number("attack", "beta", beta, 0)
        self.beta_classifier = checks.number("attack", "beta_classifier", beta_classifier, 0)
        if latent_reference not in REFERENCES:
            raise ConfigError(
                f"attack.latent_reference={latent_reference!r} is unknown; choose one of: {', '.join(REFERENCES)}"
            )
        self.latent_reference = latent_reference

    def latent_distance(self, feats_trig: Tensor, y_target: Tensor, feats_clean: Tensor, y: Tensor,
                        directions: Tensor) -> Tensor:
        """The regularizer: sliced W_2^2 between triggered and reference clean features."""
        feats_clean = feats_clean.detach().float()
        feats_trig = feats_trig.float()
        if self.latent_reference == "batch":
            return sliced_wasserstein(feats_trig, feats_clean, directions, self.wasserstein_order)
        total = feats_trig.new_zeros(())
        counted = 0
        for cls in torch.unique(y_target).tolist():
            reference = feats_clean[y == cls]
            if len(reference) == 0:  # no clean sample of that class in this batch
                continue
            chosen = y_target == cls
            weight = int(chosen.sum())
            total = total + weight * sliced_wasserstein(feats_trig[chosen], reference, directions, self.wasserstein_order)
            counted += weight
        return total / counted if counted else total

    def generator_loss(self, model: nn.Module, x: Tensor, y: Tensor, x_poison: Tensor, y_target: Tensor) -> Tensor:
        x_trig = self._triggered(x_poison, self.eps)
        feats_clean, feats_trig = joint_forward(model.features, x, x_trig)
        if self.lookahead:
            ce = self._backdoor_ce(model, x, y, x_trig, y_target)
        else:
            ce = F.cross_entropy(model.classifier(feats_trig), y_target)
        if self.beta == 0:
            return ce
        return ce + self.beta * self.latent_distance(feats_trig, y_target, feats_clean, y, classifier_directions(model))

    def classifier_loss(
        self, model: nn.Module, x: Tensor, y: Tensor, x_trig: Tensor, y_target: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        feats, feats_trig = joint_forward(model.features, x, x_trig)
        logits = model.classifier(feats)
        logits_trig = model.classifier(feats_trig)
        loss = self.alpha * F.cross_entropy(logits, y) + (1 - self.alpha) * F.cross_entropy(logits_trig, y_target)
        # Stage II only (the generator is frozen by then): in stage I, before the classifier can
        # tell the trigger apart, this term would pull every latent onto the target class.
        if self.beta_classifier > 0 and self.trained:
            loss = loss + self.beta_classifier * self.latent_distance(
                feats_trig, y_target, feats, y, classifier_directions(model)
            )
        return loss, torch.cat([logits, logits_trig]), torch.cat([y, y_target])
