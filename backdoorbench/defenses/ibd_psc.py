"""IBD-PSC: reject inputs whose confidence survives amplifying the batch-norm layers (input stage)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.datasets.base import to_float
from backdoorbench.defenses.base import DefenseContext, DefenseResult, InputDefense
from backdoorbench.errors import ConfigError


def amplifiable_batch_norms(model: nn.Module) -> list[nn.BatchNorm2d]:
    """The BatchNorm2d layers with a weight and a bias, in `named_modules` order (the official
    indexing: the last one registered is the deepest)."""
    return [m for _, m in model.named_modules()
            if isinstance(m, nn.BatchNorm2d) and m.weight is not None and m.bias is not None]


def amplify_last(model: nn.Module, count: int, scale: float) -> nn.Module:
    """A copy of `model` whose last `count` batch norms have weight and bias multiplied by `scale`
    (the official `scale_var_index` on `sorted_indices[:count]`); `model` itself is left as it is."""
    out = copy.deepcopy(model).eval()
    bns = amplifiable_batch_norms(out)
    with torch.no_grad():
        for bn in bns[len(bns) - min(count, len(bns)):]:
            bn.weight.mul_(scale)
            bn.bias.mul_(scale)
    return out


class IbdPsc(InputDefense):
    """IBD-PSC (Hou, Feng, Hua, Luo, Zhang, Li, "IBD-PSC: Input-level Backdoor Detection via
    Parameter-oriented Scaling Consistency", ICML 2024). Ledger: docs/fidelity.md#ibd-psc.

    Multiplying the weight and bias of the deepest batch-norm layers by `scale` collapses a clean
    input's prediction, while a triggered input's confidence in the target survives it. Calibration
    (`apply`, on the clean subset): the smallest k in 1..L-1 such that the model with its last k
    of L batch norms amplified errs on more than `error_rate` of the clean images. Then
    `num_models` amplified copies, the i-th (i = 0..n-1) with its last k + 1 + i batch norms
    amplified (all L at most), and the score of an input is its PSC: the mean, over the copies,
    of the softmax probability of the class the unamplified model predicts. Flagged above
    `threshold`; no further calibration.

    Official code: BackdoorBox `core/defenses/IBD_PSC.py` (the paper's "Codes are available at
    BackdoorBox"), the same in backdoor-toolbox; its defaults: scale 1.5, n 5, xi 0.6, T 0.9,
    `valset` 2,000 clean test images. Followed as written, the copies start one layer deeper than
    the k the search found (`sorted_indices[:layer_index + 1]`). Departures: where no k < L
    reaches the error rate the official search returns None and scoring fails; ours then
    amplifies every batch norm in every copy (k = L, `error_rate_reached: false` in the record).
    The runner flags PSC > threshold where the official code flags >= (a continuous score).
    Batch norms without affine parameters are skipped (the official code fails on them). The
    copies are made once per scored model and kept, where the official code deep-copies the
    model n times per batch. Calibration data: the clean subset (held clean training images),
    where BackdoorBox's tests take 2,000 clean test images.
    """

    name = "ibd_psc"
    family = "model_perturbation"
    sensitivity = ("scale",)  # swept by conf/experiment/sensitivity_ibd_psc.yaml
    aliases = ("ibdpsc",)
    needs_clean_data = True

    def __init__(self, *, scale: float = 1.5, num_models: int = 5, error_rate: float = 0.6,
                 threshold: float = 0.9, clean_fraction: float = 0.05) -> None:
        super().__init__(clean_fraction=clean_fraction)
        self.scale = checks.number("defense", "scale", scale, 1, low_open=True,
                                   hint="the factor the batch-norm weight and bias are amplified by; the official 1.5")
        self.num_models = checks.integer("defense", "num_models", num_models, 1, hint="the official n = 5")
        self.error_rate = checks.number("defense", "error_rate", error_rate, 0, 1, high_open=True,
                                        hint="the clean error the amplification must exceed; the official xi = 0.6")
        self.threshold = checks.number("defense", "threshold", threshold, 0, 1, hint="a mean probability; the official 0.9")
        self.start_layers: int | None = None  # k, found by apply()
        self._source: nn.Module | None = None  # the model the copies were made from
        self._copies: list[nn.Module] = []

    def check_model(self, model: nn.Module) -> None:
        if not amplifiable_batch_norms(model):
            name = getattr(getattr(model, "net", model), "name", type(model).__name__)
            raise ConfigError(f"defense ibd_psc amplifies the weight and bias of BatchNorm2d layers; model {name!r} "
                              "has none; choose one with batch norm (mnist_cnn, preact_resnet18, resnet18, vgg16_bn)")

    def layer_counts(self, num_bns: int) -> list[int]:
        """How many of the last batch norms each of the n copies amplifies (the official
        `sorted_indices[:layer_index + 1]` for layer_index in k..k+n-1, capped at L)."""
        if self.start_layers is None:
            raise RuntimeError("ibd_psc: call apply(ctx) before scoring inputs")
        return [min(self.start_layers + 1 + i, num_bns) for i in range(self.num_models)]

    def copies(self, model: nn.Module) -> list[nn.Module]:
        """The n amplified copies of `model`, made once per model (identical ones shared)."""
        if self._source is not model:
            counts = self.layer_counts(len(amplifiable_batch_norms(model)))
            made = {count: amplify_last(model, count, self.scale) for count in sorted(set(counts))}
            self._copies, self._source = [made[count] for count in counts], model
        return self._copies

    @torch.no_grad()
    def score_inputs(self, model: nn.Module, x: Tensor) -> Tensor:
        predicted = model(x).argmax(1, keepdim=True)
        confidence = [copy_(x).float().softmax(1).gather(1, predicted).squeeze(1) for copy_ in self.copies(model)]
        return torch.stack(confidence).mean(0).cpu()

    @torch.no_grad()
    def apply(self, ctx: DefenseContext) -> DefenseResult:
        self.check_model(ctx.model)
        clean = ctx.clean_subset
        if len(clean) < 1:
            raise ConfigError("ibd_psc needs clean images to choose the amplified layers, the clean subset has none; "
                              "raise defense.clean_fraction")
        device, batch = ctx.trainer.device, ctx.trainer.eval_batch_size
        model = ctx.trainer.prepare(ctx.model).eval()
        num_bns = len(amplifiable_batch_norms(model))
        images = [to_float(clean.images[s : s + batch].to(device)) for s in range(0, len(clean), batch)]
        labels = clean.labels.to(device)

        def clean_error(net: nn.Module) -> float:
            predicted = torch.cat([net(x).argmax(1) for x in images])
            return float((predicted != labels).float().mean())

        # the official search: k = 1, 2, ... < L, each a copy with its last k batch norms amplified once
        errors, self.start_layers = [], None
        for k in range(1, num_bns):
            errors.append(clean_error(amplify_last(model, k, self.scale)))
            if errors[-1] > self.error_rate:
                self.start_layers = k
                break
        reached = self.start_layers is not None
        if not reached:
            self.start_layers = num_bns  # every copy amplifies every batch norm
        self._source = None
        calibration = torch.cat([self.score_inputs(model, x) for x in images])
        return DefenseResult(extras={
            "n_batch_norms": num_bns,
            "start_layers": self.start_layers,
            "error_rate_reached": reached,
            "clean_error_per_k": errors,  # k = 1, 2, ... as searched
            "amplified_layers": self.layer_counts(num_bns),
            "clean_psc_mean": float(calibration.mean()),
            "calibration_fpr": float((calibration > self.threshold).float().mean()),
            "n_calibration": int(len(clean)),
        })

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "scale": self.scale, "num_models": self.num_models,
                "error_rate": self.error_rate, "threshold": self.threshold}
