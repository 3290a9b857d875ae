"""SCALE-UP: reject inputs whose prediction survives multiplying every pixel by n (input stage)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.datasets.base import to_float
from backdoorbench.defenses.base import DefenseContext, DefenseResult, InputDefense
from backdoorbench.errors import ConfigError


def amplified(x: Tensor, scale: float) -> Tensor:
    """`x` ([0, 1] pixels) with every pixel multiplied by `scale` and clipped to [0, 1]: the
    official `torch.clip(x * n, 0, 1)` on unnormalised images (BackdoorBox), or on denormalised
    ones, renormalised after (backdoor-toolbox); our models normalise inside, so this is both."""
    return (x * scale).clamp_(0.0, 1.0)


@torch.no_grad()
def scaled_predictions(model: nn.Module, x: Tensor, scales: Sequence[float]) -> tuple[Tensor, Tensor]:
    """The prediction on `x` (B,) and on each amplified copy (B, len(scales)), one pass per scale."""
    original = model(x).argmax(1)
    scaled = torch.stack([model(amplified(x, s)).argmax(1) for s in scales], dim=1)
    return original, scaled


def spc(scaled: Tensor, reference: Tensor) -> Tensor:
    """Scaled prediction consistency: the share of the scaled predictions (B, N) equal to `reference` (B,)."""
    return (scaled == reference.view(-1, 1)).float().mean(1)


class ScaleUp(InputDefense):
    """SCALE-UP (Guo, Li, Chen, Guo, Sun, Liu, "SCALE-UP: An Efficient Black-box Input-level Backdoor
    Detection via Analyzing Scaled Prediction Consistency", ICLR 2023). Ledger: docs/fidelity.md#scale-up.

    Each input's pixels are multiplied by every n of `scales` and clipped to [0, 1]; its scaled
    prediction consistency (SPC) is the share of the amplified copies the model labels as it labels
    the input. A trigger keeps deciding the prediction as the image brightens, where a clean image
    drifts, so triggered inputs have a high SPC; the score is the SPC, flagged above `threshold`.
    `standardize: true` is the paper's data-limited variant (BackdoorBox with a `valset`,
    backdoor-toolbox's default): the SPC becomes (SPC - mean) / std, the mean and (unbiased) std of
    the clean subset's SPC, taken there against the true labels as the official code does.

    Official code: the authors' script (JunfengGo/SCALE-UP, `torch_model_wrapper.py`) and
    BackdoorBox's `core/defenses/SCALE_UP.py`, to which the authors' README points, with its
    port in backdoor-toolbox. Defaults are BackdoorBox's: scales 3, 5, 7, 9, 11, threshold 0.5,
    no standardisation. Departures: the runner flags SPC > threshold where BackdoorBox flags
    >= (the same set at the defaults: five scales give SPC in steps of 0.2, never 0.5). The
    authors' script scores with n = 1..11, the unscaled prediction among them, and adds uniform
    noise of 0.02 to every input first; BackdoorBox does neither (scales=[1,...,11] gives the
    script's score without the noise). A clean subset with the same SPC everywhere (std 0) is
    standardised by its mean alone, where the official code divides by zero.
    """

    name = "scale_up"
    family = "input_perturbation"
    sensitivity = ("threshold",)  # swept by conf/experiment/sensitivity_scale_up.yaml
    aliases = ("scaleup",)
    needs_clean_data = False  # the default scores with the model alone; `standardize` reads the clean subset

    def __init__(self, *, scales: Sequence[float] = (3, 5, 7, 9, 11), threshold: float = 0.5,
                 standardize: bool = False, clean_fraction: float = 0.0) -> None:
        super().__init__(clean_fraction=clean_fraction)
        listed = list(scales) if checks.is_list(scales) else None
        if not listed or any(not checks.is_number(s) or not 0 < s < math.inf for s in listed):
            raise ConfigError(f"defense.scales={scales!r} is invalid; use a non-empty list of pixel "
                              "multipliers > 0 (the official [3, 5, 7, 9, 11])")
        self.scales = [float(s) for s in listed]
        if not checks.is_number(threshold) or math.isinf(threshold):
            raise ConfigError(f"defense.threshold={threshold!r} is invalid; use a finite number (the official 0.5: "
                              "a share of the scales, or a z-score with standardize)")
        self.threshold = float(threshold)  # fixed, the official T: no calibration
        if not isinstance(standardize, bool):
            raise ConfigError(f"defense.standardize={standardize!r} is invalid; use true or false")
        if standardize and self.clean_fraction == 0:
            raise ConfigError("defense.standardize=true standardises with the clean subset's SPC; "
                              "defense.clean_fraction=0 holds none: give defense.clean_fraction > 0")
        self.standardize = standardize
        self.mean, self.std = 0.0, 1.0  # the clean statistics, with `standardize`

    @torch.no_grad()
    def spc(self, model: nn.Module, x: Tensor) -> Tensor:
        """The raw SPC of each input of `x` ([0, 1]) against its own prediction."""
        original, scaled = scaled_predictions(model, x, self.scales)
        return spc(scaled, original).cpu()

    def score_inputs(self, model: nn.Module, x: Tensor) -> Tensor:
        return (self.spc(model, x) - self.mean) / self.std

    @torch.no_grad()
    def apply(self, ctx: DefenseContext) -> DefenseResult:
        clean = ctx.clean_subset
        extras: dict[str, Any] = {"n_scales": len(self.scales), "standardize": self.standardize}
        if self.standardize and len(clean) < 2:
            raise ConfigError(f"scale_up with standardize=true needs at least 2 clean images for a mean and std, "
                              f"the clean subset has {len(clean)}; raise defense.clean_fraction")
        if len(clean) == 0:
            return DefenseResult(extras=extras)
        device = ctx.trainer.device
        model = ctx.trainer.prepare(ctx.model).eval()
        against_labels, against_predictions = [], []
        for start in range(0, len(clean), ctx.trainer.eval_batch_size):
            x = to_float(clean.images[start : start + ctx.trainer.eval_batch_size].to(device))
            labels = clean.labels[start : start + ctx.trainer.eval_batch_size].to(device)
            original, scaled = scaled_predictions(model, x, self.scales)
            # the official statistics compare the scaled predictions with the true labels
            against_labels.append(spc(scaled, labels).cpu())
            against_predictions.append(spc(scaled, original).cpu())
        values = torch.cat(against_labels)
        mean, std = float(values.mean()), float(values.std()) if len(values) > 1 else 0.0
        if self.standardize:
            self.mean, self.std = mean, (std if std > 0 else 1.0)
        scores = (torch.cat(against_predictions) - self.mean) / self.std  # what score_inputs gives them
        extras.update({"clean_spc_mean": mean, "clean_spc_std": std, "n_calibration": int(len(values)),
                       "calibration_fpr": float((scores > self.threshold).float().mean())})
        return DefenseResult(extras=extras)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "scales": self.scales, "threshold": self.threshold,
                "standardize": self.standardize}
