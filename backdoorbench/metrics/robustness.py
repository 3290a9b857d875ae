"""Adversarial robustness: accuracy under an L_inf PGD attack, in pixel units.

PGD (Madry, Makelov, Schmidt, Tsipras, Vladu, "Towards Deep Learning Models Resistant to
Adversarial Attacks", ICLR 2018): from a uniform random start in the eps-ball, `steps` signed
gradient-ascent steps on the cross-entropy of the true label, each followed by projection onto the
eps-ball around the clean image and clamping to [0, 1]. Images are [0, 1] pixels and the model
owns its normalization (`models.base.Normalized`), so eps = 0.3 means 0.3 of the pixel range.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.errors import ConfigError


def _check(eps: float, steps: int, step_size: float | None, batch_size: int) -> None:
    checks.number("eval.pgd", "eps", eps, 0, 1, hint="pixel units")
    checks.integer("eval.pgd", "steps", steps, 1)
    checks.number("eval.pgd", "step_size", step_size, 0, low_open=True, allow_none=True, hint="null = 2.5 * eps / steps")
    checks.integer("pgd_accuracy", "batch_size", batch_size, 1)  # an argument only, not in the config


def pgd_attack(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    eps: float,
    steps: int = 40,
    step_size: float | None = None,
    random_start: bool = True,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Untargeted L_inf PGD adversarial examples for `x` ([0, 1], on the model's device).

    `step_size` defaults to 2.5 * eps / steps (Madry et al.'s rule: enough to cross the ball).
    The model is used as given (call `.eval()` first); its parameters get no gradient.
    """
    _check(eps, steps, step_size, 1)
    if eps == 0:
        return x.detach().clone()
    alpha = 2.5 * eps / steps if step_size is None else float(step_size)
    x = x.detach()
    if random_start:
        # Drawn on the CPU so that one seed gives the same start on every device.
        noise = torch.rand(x.shape, generator=generator, dtype=torch.float32).to(x.device, x.dtype)
        x_adv = (x + (2 * noise - 1) * eps).clamp(0.0, 1.0)
    else:
        x_adv = x.clone()
    for _ in range(steps):
        x_adv.requires_grad_(True)
        # float32 on purpose: a bf16 gradient sign is noisy enough to weaken the attack.
        loss = F.cross_entropy(model(x_adv).float(), y)
        (grad,) = torch.autograd.grad(loss, x_adv)
        with torch.no_grad():
            x_adv = x_adv + alpha * grad.sign()
            x_adv = torch.min(torch.max(x_adv, x - eps), x + eps).clamp(0.0, 1.0)
    return x_adv.detach()


def pgd_accuracy(
    model: nn.Module,
    images_float: Tensor,
    labels: Tensor,
    *,
    eps: float,
    steps: int = 40,
    step_size: float | None = None,
    random_start: bool = True,
    generator: torch.Generator | None = None,
    batch_size: int = 256,
    device: torch.device | str | None = None,
) -> float:
    """Robust accuracy: the fraction of `images_float` ([0, 1], (N, C, H, W)) classified as
    `labels` both clean and after PGD at radius `eps` (as RobustBench counts it, so eps = 0
    gives the clean accuracy exactly). `device` defaults to the model's."""
    _check(eps, steps, step_size, batch_size)
    if len(labels) == 0:
        raise ValueError("robust accuracy of an empty set is undefined")
    if images_float.dtype == torch.uint8:
        raise ConfigError("pgd_accuracy needs float images in [0, 1]; convert uint8 with datasets.base.to_float")
    if device is None:
        device = next(model.parameters()).device
    model = model.to(device).eval()
    correct = 0
    for start in range(0, len(labels), batch_size):
        x = images_float[start : start + batch_size].to(device, torch.float32)
        y = labels[start : start + batch_size].to(device)
        with torch.no_grad():
            clean_ok = model(x).argmax(1) == y
        x_adv = pgd_attack(model, x, y, eps=eps, steps=steps, step_size=step_size,
                           random_start=random_start, generator=generator)
        with torch.no_grad():
            adv_ok = model(x_adv).argmax(1) == y
        correct += int((clean_ok & adv_ok).sum())
    return correct / len(labels)
