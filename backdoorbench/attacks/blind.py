"""Blind: the attacker's code computes the loss; a triggered copy of every batch joins it, MGDA-balanced."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.attacks.base import StepWrapper, TrainingAttack
from backdoorbench.datasets.base import Split
from backdoorbench.errors import ConfigError

# The official PatternSynthesizer's 5x3 pattern: 1 = white, 0 = black, None = the image shows through.
PATTERN = ((1, 0, 1), (None, 1, None), (None, None, 0), (None, 1, None), (1, 0, 1))
LOSS_BALANCES = ("MGDA", "fixed")
NORMALIZATIONS = ("loss+", "loss", "l2", "none")
NORM_CAP = 10.0  # gradient_normalizers: min(..., 10)
NORM_EPS = 1e-5  # get_scales: grads / (gn + 1e-5)


def gradient_normalizer(kind: str, loss: Tensor, squared_norm: Tensor) -> Tensor:
    """The official `gradient_normalizers` for one task: `l2` the gradient's norm, `loss` the loss,
    `loss+` the loss times the norm (both capped at 10), `none` 1."""
    if kind == "l2":
        return squared_norm.sqrt()
    if kind == "loss":
        return torch.clamp(loss.detach(), max=NORM_CAP)
    if kind == "loss+":
        return torch.clamp(loss.detach() * squared_norm.sqrt(), max=NORM_CAP)
    return torch.ones_like(squared_norm)


def min_norm_two(v11: Tensor, v12: Tensor, v22: Tensor) -> Tensor:
    """The official `_min_norm_element_from2`: the gamma minimising |gamma x1 + (1 - gamma) x2|^2
    from the dot products v11 = <x1, x1>, v12 = <x1, x2>, v22 = <x2, x2>: (v22 - v12) / (v11 + v22
    - 2 v12), with the official 0.999 when v12 >= v11 and 0.001 when v12 >= v22. On the device,
    without a host sync."""
    inner = (v22 - v12) / (v11 + v22 - 2 * v12)
    inner = torch.where(torch.isfinite(inner), inner, torch.zeros_like(inner))
    return torch.where(v12 >= v11, torch.full_like(inner, 0.999), torch.where(v12 >= v22, torch.full_like(inner, 0.001), inner))


def mgda_scales(grads_1: Sequence[Tensor], grads_2: Sequence[Tensor], loss_1: Tensor, loss_2: Tensor,
                kind: str) -> tuple[Tensor, Tensor]:
    """The official `MGDASolver.get_scales` for two tasks: each gradient divided by its normaliser
    (+ 1e-5), then the min-norm point of their segment (for two tasks the official solver returns
    the closed form). Returns (scale of task 1, scale of task 2), summing to 1."""
    sq_1 = sum((g.float() ** 2).sum() for g in grads_1)
    sq_2 = sum((g.float() ** 2).sum() for g in grads_2)
    dot = sum((a.float() * b.float()).sum() for a, b in zip(grads_1, grads_2))
    a_1 = gradient_normalizer(kind, loss_1.float(), sq_1) + NORM_EPS
    a_2 = gradient_normalizer(kind, loss_2.float(), sq_2) + NORM_EPS
    gamma = min_norm_two(sq_1 / a_1**2, dot / (a_1 * a_2), sq_2 / a_2**2)
    return gamma, 1 - gamma


class Blind(TrainingAttack):
    """Blind backdoor (Bagdasaryan, Shmatikov, "Blind Backdoors in Deep Learning Models", USENIX
    Security 2021; official code ebagdasa/backdoors101).

    The attacker owns the loss computation, not the data: the stored training set stays clean.
    Every training batch (as the trainer hands it over, augmented) gets a copy whose first
    round(`poison_rate` * B) rows carry the trigger and go to the target rule (the official
    `poisoning_proportion` 1.1: all of them); the loss is `scale_b` * CE(backdoor copy) + `scale_n`
    * CE(batch). With `loss_balance: MGDA` (the paper's and every official config's) the scales are
    the two-task min-norm (MGDA, Frank-Wolfe) solution over the two losses' gradients, each first
    divided by its normaliser `mgda_normalize` (`loss+`: the loss times the gradient's norm, capped
    at 10); `fixed` takes `fixed_scale_normal` and `fixed_scale_backdoor` (BackdoorBench's default
    mode, 1.0 and 0.9). With `loss_threshold` set, a batch trains on the clean loss alone until the
    mean clean loss of the last `batch_history_len` batches is below it (the official
    `loss_threshold`: the backdoor joins once the model has learned its task).

    The trigger is the official PatternSynthesizer's: a 5x3 pattern of white, black and
    see-through pixels, its top-left corner at `location` (row 3, column 23), replacing the
    pixels in every channel. BackdoorBench saves no poisoned training set for Blind (`bd_train=None`):
    `exports_poisoned_set` is false, and the defenses that read only the stored split never meet it.

    Departures (docs/fidelity.md#blind): all2all relabels y -> y + 1 (BackdoorBench fills the
    all2one target in training whatever the mode); the step returns a loss whose gradient is the
    MGDA-weighted sum of the two gradients it already computed, instead of a second backward over
    both losses (the same gradient, one backward fewer); the clean-loss history holds
    `batch_history_len` batches (official: 1000). Under torchrun each process's scales come from
    its own share of the batch.
    """

    name = "blind"
    family = "patch"
    aliases = ("blind_backdoor",)
    exports_poisoned_set = False

    def __init__(
        self,
        *,
        location: Sequence[int] = (3, 23),
        loss_balance: str = "MGDA",
        mgda_normalize: str = "loss+",
        fixed_scale_normal: float = 1.0,
        fixed_scale_backdoor: float = 0.9,
        loss_threshold: float | None = 1.0,
        batch_history_len: int = 1000,
        poison_rate: float = 1.0,
        **common,
    ) -> None:
        super().__init__(poison_rate=poison_rate, **common)
        _, height, width = self.image_shape
        rows, cols = len(PATTERN), len(PATTERN[0])
        if (isinstance(location, str) or not isinstance(location, Sequence) or len(location) != 2
                or not all(checks.is_integer(v) for v in location)):
            raise ConfigError(f"attack.location={location!r} is invalid; use [row, column] of the pattern's top-left pixel")
        top, left = int(location[0]), int(location[1])
        if not (0 <= top <= height - rows and 0 <= left <= width - cols):
            raise ConfigError(f"attack.location=[{top}, {left}] puts the {rows}x{cols} pattern outside {height}x{width} "
                              f"images; use a row in [0, {height - rows}] and a column in [0, {width - cols}]")
        if loss_balance not in LOSS_BALANCES:
            raise ConfigError(f"attack.loss_balance={loss_balance!r} is unknown; choose one of: {', '.join(LOSS_BALANCES)}")
        if mgda_normalize not in NORMALIZATIONS:
            raise ConfigError(f"attack.mgda_normalize={mgda_normalize!r} is unknown; choose one of: {', '.join(NORMALIZATIONS)}")
        self.location = (top, left)
        self.loss_balance = loss_balance
        self.mgda_normalize = mgda_normalize
        self.fixed_scale_normal = checks.number("attack", "fixed_scale_normal", fixed_scale_normal, 0)
        self.fixed_scale_backdoor = checks.number("attack", "fixed_scale_backdoor", fixed_scale_backdoor, 0)
        self.loss_threshold = checks.number("attack", "loss_threshold", loss_threshold, 0, low_open=True, allow_none=True,
                                            hint="null = the backdoor loss from the first batch")
        self.batch_history_len = checks.integer("attack", "batch_history_len", batch_history_len, 1)
        mask = torch.tensor([[v is not None for v in row] for row in PATTERN])
        values = torch.tensor([[float(v or 0) for v in row] for row in PATTERN])
        self.mask = torch.zeros(height, width, dtype=torch.bool)
        self.values = torch.zeros(height, width)
        self.mask[top : top + rows, left : left + cols] = mask
        self.values[top : top + rows, left : left + cols] = values
        self.stats: dict[str, Any] = {}
        self._reset_training()

    # --- trigger -------------------------------------------------------------------------
    def patch_mask(self) -> Tensor:
        """(H, W) bool: the pixels the trigger sets."""
        return self.mask.clone()

    def apply_trigger(self, x: Tensor) -> Tensor:
        mask = self.mask.to(x.device)
        return torch.where(mask, self.values.to(x.device, x.dtype), x)

    # --- the blind loss ----------------------------------------------------------------------
    def _reset_training(self) -> None:
        self.loss_history: list[float] = []  # the clean loss of the last batches (with loss_threshold)
        self._steps = torch.zeros((), dtype=torch.float64)
        self._backdoor_steps = torch.zeros((), dtype=torch.float64)
        self._backdoor_scale_sum = torch.zeros((), dtype=torch.float64)

    def backdoor_on(self) -> bool:
        """Whether this batch trains the backdoor: always without `loss_threshold`; else once the
        history is full and its mean clean loss is below the threshold (the official rule)."""
        if self.loss_threshold is None:
            return True
        history = self.loss_history
        return len(history) >= self.batch_history_len and sum(history) / len(history) < self.loss_threshold

    def backdoor_batch(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        """The official make_backdoor_batch: a copy whose first round(poison_rate * B) rows carry the
        trigger and the target rule's labels (Python's round, as the official code)."""
        count = min(len(y), round(len(y) * self.poison_rate))
        images, labels = x.clone(), y.clone()
        images[:count] = self.apply_trigger(x[:count])
        labels[:count] = self.target_rule(y[:count])
        return images, labels

    def training_step(self, model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(loss, logits, labels scored): the clean batch alone before the threshold is met, else the
        clean batch and its backdoor copy (their logits and labels concatenated, clean rows first)."""
        attack = self.backdoor_on()
        self._steps = self._steps.to(x.device) + 1
        if not attack:
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            self._remember(loss)
            return loss, logits, y
        xb, yb = self.backdoor_batch(x, y)
        # The official order: the backdoor task's forward first, then the clean one (batch norm sees both).
        logits_b = model(xb)
        loss_b = F.cross_entropy(logits_b, yb)
        logits = model(x)
        loss_n = F.cross_entropy(logits, y)
        if self.loss_balance == "fixed":
            scale_b = torch.tensor(self.fixed_scale_backdoor, device=x.device)
            loss = self.fixed_scale_backdoor * loss_b + self.fixed_scale_normal * loss_n
        else:
            params = [p for p in model.parameters() if p.requires_grad]
            grads_b = self._grads(loss_b, params)
            grads_n = self._grads(loss_n, params)
            scale_b, scale_n = mgda_scales(grads_b, grads_n, loss_b, loss_n, self.mgda_normalize)
            scale_b, scale_n = scale_b.detach(), scale_n.detach()
            # A loss whose gradient is scale_b * grads_b + scale_n * grads_n, the gradients at hand
            # (official: backward of scale_b * loss_b + scale_n * loss_n), and whose value is that sum.
            direction = sum((p * (scale_b * gb + scale_n * gn).to(p.dtype)).sum() for p, gb, gn in zip(params, grads_b, grads_n))
            value = scale_b * loss_b.detach() + scale_n * loss_n.detach()
            loss = direction - direction.detach() + value
        self._backdoor_steps = self._backdoor_steps.to(x.device) + 1
        self._backdoor_scale_sum = self._backdoor_scale_sum.to(x.device) + scale_b.double()
        self._remember(loss_n)
        return loss, torch.cat([logits.detach(), logits_b.detach()]), torch.cat([y, yb])

    @staticmethod
    def _grads(loss: Tensor, params: list[nn.Parameter]) -> list[Tensor]:
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    def _remember(self, loss_n: Tensor) -> None:
        if self.loss_threshold is None:  # no rule reads the history: no host sync per batch
            return
        self.loss_history.append(float(loss_n.detach()))
        del self.loss_history[: -self.batch_history_len]

    def train_victim(self, trainer, model: nn.Module, train: Split, generator: torch.Generator,
                     wrap_step: StepWrapper | None = None, checkpoint: str | Path | None = None) -> None:
        # A fresh training starts with an empty history; a resumed one gets its own back from the checkpoint.
        self._reset_training()
        super().train_victim(trainer, model, train, generator, wrap_step=wrap_step, checkpoint=checkpoint)
        if not self.stats:  # the victim's training; a defense retraining the attacker's way leaves them
            steps, backdoor = float(self._steps), float(self._backdoor_steps)
            self.stats = {"backdoor_batches": round(backdoor / max(steps, 1.0), 4),
                          "mean_backdoor_scale": round(float(self._backdoor_scale_sum) / backdoor, 4) if backdoor else None}

    def training_state(self) -> dict[str, Any]:
        return {"loss_history": list(self.loss_history), "steps": self._steps.detach().cpu(),
                "backdoor_steps": self._backdoor_steps.detach().cpu(),
                "backdoor_scale_sum": self._backdoor_scale_sum.detach().cpu()}

    def load_training_state(self, state: dict[str, Any]) -> None:
        self.loss_history = [float(v) for v in state["loss_history"]]
        self._steps = state["steps"].double()
        self._backdoor_steps = state["backdoor_steps"].double()
        self._backdoor_scale_sum = state["backdoor_scale_sum"].double()

    def describe(self) -> dict:
        return {
            **super().describe(),
            "location": list(self.location),
            "loss_balance": self.loss_balance,
            "mgda_normalize": self.mgda_normalize,
            "fixed_scale_normal": self.fixed_scale_normal,
            "fixed_scale_backdoor": self.fixed_scale_backdoor,
            "loss_threshold": self.loss_threshold,
            "batch_history_len": self.batch_history_len,
            **self.stats,
        }
