"""Adversarial robustness: accuracy under L_inf PGD attacks, in pixel units.

PGD (Madry, Makelov, Schmidt, Tsipras, Vladu, "Towards Deep Learning Models Resistant to
Adversarial Attacks", ICLR 2018): from a uniform random start in the eps-ball, `steps` signed
gradient-ascent steps on a loss of the true label, each followed by projection onto the eps-ball
around the clean image and clamping to [0, 1]. Images are [0, 1] pixels and the model owns its
normalization (`models.base.Normalized`), so eps = 0.3 means 0.3 of the pixel range.

Two losses: `ce`, the cross-entropy (Madry et al.; foolbox's LinfPGD, which the angular-margin
authors evaluate with), and `cw`, the margin max_{j != y} z_j - z_y of Carlini and Wagner ("Towards
Evaluating the Robustness of Neural Networks", IEEE S&P 2017), which reads the logits only, so a
defense that flattens the softmax (a small weight norm, as the angular-margin penalty's s = 0.1)
cannot hide the gradient from it. The step is absolute (`step_size`), relative to eps
(`rel_step_size`, foolbox's `rel_stepsize`: eps/30 is 1/30), or 2.5 * eps / steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.errors import ConfigError

LOSSES = ("ce", "cw")
SOURCES = ("attacked",)  # eval.pgd.transfer_from: the model whose adversarial examples the defended model meets
MASKING_EPS = 0.5  # at this radius every MNIST/CIFAR image can be pushed to mid-gray: accuracy must be ~0
MASKING_ACC = 0.05  # above this at MASKING_EPS, the gradient is suspect (masked), not the model robust


def eps_list(eps: Any) -> list[float]:
    """eval.pgd.eps as a list: one number (the old config) or a list of them."""
    return [eps] if checks.is_number(eps) else list(eps)


def check_settings(*, eps: Any, steps: Any, step_size: Any, rel_step_size: Any = None, losses: Any = ("ce",),
                   transfer_from: Any = None, group: str = "eval.pgd") -> None:
    """One ConfigError line for the first PGD setting that is wrong."""
    if checks.is_number(eps):  # one radius, shown as a float as the typed config did (-1 -> -1.0)
        checks.number(group, "eps", float(eps), 0, 1, hint="pixel units, one number or a list")
    elif eps is None or isinstance(eps, (str, bytes)):
        checks.number(group, "eps", eps, 0, 1, hint="pixel units, one number or a list")
    else:
        values = list(eps)
        if not values:
            raise ConfigError(f"{group}.eps=[] is empty; give one radius or a list, e.g. [0.05,0.1,0.2,0.3] (pixel units)")
        for value in values:
            if not checks.is_number(value) or not 0 <= value <= 1:
                raise ConfigError(f"{group}.eps={values} holds {value!r}; every radius must be a number in [0, 1] (pixel units)")
    checks.integer(group, "steps", steps, 1)
    checks.number(group, "step_size", step_size, 0, low_open=True, allow_none=True, hint="pixel units; null = rel_step_size * eps")
    checks.number(group, "rel_step_size", rel_step_size, 0, low_open=True, allow_none=True,
                  hint="a fraction of eps, e.g. 0.0333 for eps/30; null = 2.5 / steps")
    if step_size is not None and rel_step_size is not None:
        raise ConfigError(f"{group}.step_size={step_size} and {group}.rel_step_size={rel_step_size} are both set; "
                          "set one of them to null")
    names = [losses] if isinstance(losses, str) else list(losses) if losses is not None else []
    if not names or any(name not in LOSSES for name in names):
        raise ConfigError(f"{group}.losses={names} must be a non-empty list of {', '.join(LOSSES)}")
    if transfer_from is not None and transfer_from not in SOURCES:
        raise ConfigError(f"{group}.transfer_from={transfer_from!r} is not a model of the run; use null or {', '.join(SOURCES)}")


def step_length(eps: float, steps: int, step_size: float | None = None, rel_step_size: float | None = None) -> float:
    """The step of one PGD iteration: absolute, relative to eps, or Madry et al.'s 2.5 * eps / steps."""
    if step_size is not None:
        return float(step_size)
    if rel_step_size is not None:
        return float(rel_step_size) * eps
    return 2.5 * eps / steps


def cw_margin(logits: Tensor, labels: Tensor) -> Tensor:
    """Per sample, max_{j != y} z_j - z_y: positive exactly when the sample is misclassified."""
    true = logits.gather(1, labels[:, None]).squeeze(1)
    others = logits.masked_fill(F.one_hot(labels, logits.shape[1]).bool(), float("-inf"))
    return others.max(1).values - true


def attack_loss(name: str, logits: Tensor, labels: Tensor) -> Tensor:
    """The quantity PGD ascends (a scalar; only its gradient's sign per pixel matters)."""
    if name == "ce":
        return F.cross_entropy(logits, labels)
    if name == "cw":
        return cw_margin(logits, labels).sum()
    raise ConfigError(f"PGD loss {name!r} is unknown; use one of {', '.join(LOSSES)}")


def pgd_attack(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    *,
    eps: float,
    steps: int = 40,
    step_size: float | None = None,
    rel_step_size: float | None = None,
    random_start: bool = True,
    loss: str = "ce",
    generator: torch.Generator | None = None,
) -> Tensor:
    """Untargeted L_inf PGD adversarial examples for `x` ([0, 1], on the model's device).

    The step: `step_size`, else `rel_step_size * eps`, else 2.5 * eps / steps (Madry et al.'s
    rule: enough to cross the ball). The model is used as given (call `.eval()` first); its
    parameters get no gradient.
    """
    check_settings(eps=eps, steps=steps, step_size=step_size, rel_step_size=rel_step_size, losses=[loss])
    if eps == 0:
        return x.detach().clone()
    alpha = step_length(eps, steps, step_size, rel_step_size)
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
        objective = attack_loss(loss, model(x_adv).float(), y)
        (grad,) = torch.autograd.grad(objective, x_adv)
        with torch.no_grad():
            x_adv = x_adv + alpha * grad.sign()
            x_adv = torch.min(torch.max(x_adv, x - eps), x + eps).clamp(0.0, 1.0)
    return x_adv.detach()


def _prepare(model: nn.Module, images_float: Tensor, labels: Tensor, batch_size: int, device) -> torch.device:
    checks.integer("pgd_accuracy", "batch_size", batch_size, 1)  # an argument only, not in the config
    if len(labels) == 0:
        raise ValueError("robust accuracy of an empty set is undefined")
    if images_float.dtype == torch.uint8:
        raise ConfigError("pgd_accuracy needs float images in [0, 1]; convert uint8 with datasets.base.to_float")
    if device is None:
        device = next(model.parameters()).device
    model.to(device).eval()
    return torch.device(device)


def pgd_accuracy(
    model: nn.Module,
    images_float: Tensor,
    labels: Tensor,
    *,
    eps: float,
    steps: int = 40,
    step_size: float | None = None,
    rel_step_size: float | None = None,
    random_start: bool = True,
    loss: str = "ce",
    generator: torch.Generator | None = None,
    batch_size: int = 256,
    device: torch.device | str | None = None,
) -> float:
    """Robust accuracy: the fraction of `images_float` ([0, 1], (N, C, H, W)) classified as
    `labels` both clean and after PGD at radius `eps` (as RobustBench counts it, so eps = 0
    gives the clean accuracy exactly). `device` defaults to the model's."""
    check_settings(eps=eps, steps=steps, step_size=step_size, rel_step_size=rel_step_size, losses=[loss])
    rows, _ = robustness_curve(model, images_float, labels, eps=[eps], losses=[loss], steps=steps, step_size=step_size,
                               rel_step_size=rel_step_size, random_start=random_start, generator=generator,
                               batch_size=batch_size, device=device)
    return rows[0]["acc"]


def robustness_curve(
    model: nn.Module,
    images_float: Tensor,
    labels: Tensor,
    *,
    eps: Sequence[float],
    losses: Sequence[str] = ("ce",),
    steps: int = 40,
    step_size: float | None = None,
    rel_step_size: float | None = None,
    random_start: bool = True,
    seed: int = 0,
    generator: torch.Generator | None = None,
    batch_size: int = 256,
    device: torch.device | str | None = None,
    keep_examples: bool = False,
) -> tuple[list[dict[str, Any]], dict[tuple[str, float], Tensor]]:
    """Robust accuracy of `model` at every radius in `eps` under PGD with every loss in `losses`:
    rows {"loss", "eps", "acc", "source": "self"}, and, with `keep_examples`, the adversarial
    images per (loss, eps) (CPU) for a transfer attack. Each (loss, eps) draws its random start
    from a generator seeded with `seed` (or from `generator`, shared, when given)."""
    check_settings(eps=list(eps), steps=steps, step_size=step_size, rel_step_size=rel_step_size, losses=list(losses))
    device = _prepare(model, images_float, labels, batch_size, device)
    with torch.no_grad():
        clean_ok = torch.cat([model(x.to(device, torch.float32)).argmax(1).cpu() == y
                              for x, y in zip(images_float.split(batch_size), labels.split(batch_size))])
    rows, examples = [], {}
    for loss in losses:
        for radius in eps:
            g = generator if generator is not None else torch.Generator().manual_seed(seed)
            correct, kept = 0, []
            for start in range(0, len(labels), batch_size):
                x = images_float[start : start + batch_size].to(device, torch.float32)
                y = labels[start : start + batch_size].to(device)
                x_adv = pgd_attack(model, x, y, eps=float(radius), steps=steps, step_size=step_size,
                                   rel_step_size=rel_step_size, random_start=random_start, loss=loss, generator=g)
                with torch.no_grad():
                    adv_ok = (model(x_adv).argmax(1) == y).cpu()
                correct += int((clean_ok[start : start + batch_size] & adv_ok).sum())
                if keep_examples:
                    kept.append(x_adv.cpu())
            rows.append({"loss": loss, "eps": float(radius), "acc": correct / len(labels), "source": "self"})
            if keep_examples:
                examples[(loss, float(radius))] = torch.cat(kept)
    return rows, examples


@torch.no_grad()
def transfer_accuracy(
    model: nn.Module,
    images_float: Tensor,
    labels: Tensor,
    examples: dict[tuple[str, float], Tensor],
    *,
    source: str,
    batch_size: int = 256,
    device: torch.device | str | None = None,
) -> list[dict[str, Any]]:
    """Robust accuracy of `model` on adversarial images crafted on another model (`examples`,
    from `robustness_curve(..., keep_examples=True)` on `source`): a sample counts when `model`
    classifies it right both clean and perturbed. Rows {"loss", "eps", "acc", "source"}."""
    device = _prepare(model, images_float, labels, batch_size, device)
    clean_ok = torch.cat([model(x.to(device, torch.float32)).argmax(1).cpu() == y
                          for x, y in zip(images_float.split(batch_size), labels.split(batch_size))])
    rows = []
    for (loss, radius), adversarial in examples.items():
        adv_ok = torch.cat([model(x.to(device, torch.float32)).argmax(1).cpu() == y
                            for x, y in zip(adversarial.split(batch_size), labels.split(batch_size))])
        rows.append({"loss": loss, "eps": radius, "acc": float((clean_ok & adv_ok).float().mean()), "source": source})
    return rows


def masking_suspects(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The white-box rows at eps >= MASKING_EPS whose accuracy stays above MASKING_ACC: at such a
    radius a working attack leaves ~0, so accuracy there means a masked gradient, not robustness
    (Athalye, Carlini, Wagner, ICML 2018, section 3.1's sanity checks)."""
    return [r for r in rows if r["source"] == "self" and r["eps"] >= MASKING_EPS and r["acc"] > MASKING_ACC]
