"""Adversarial Neuron Pruning: learn per-neuron masks under adversarial neuron perturbation, prune low masks."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.datasets.base import to_float
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.defenses.fine_pruning import require_clean_subset
from backdoorbench.errors import ConfigError
from backdoorbench.progress import track
from backdoorbench.train import augment_batch

PRUNE_BY = ("threshold", "fraction")


class NoisyBatchNorm2d(nn.BatchNorm2d):
    """BatchNorm2d whose per-neuron scale is multiplied by (mask + noise) and shift by (1 + noise_bias).

    With the mask at 1 and the perturbation off it computes exactly nn.BatchNorm2d; pass it as
    `norm_layer=` to an architecture to make ANP's perturbed copy of a model.
    """

    def __init__(self, num_features: int, *args, **kwargs) -> None:
        super().__init__(num_features, *args, **kwargs)
        if not self.affine:
            raise ConfigError("ANP perturbs the affine scale and shift of batch norm; this norm has affine=False")
        self.neuron_mask = nn.Parameter(torch.ones(num_features))
        self.neuron_noise = nn.Parameter(torch.zeros(num_features))
        self.neuron_noise_bias = nn.Parameter(torch.zeros(num_features))
        self.perturbed = False

    @torch.no_grad()
    def reset_noise(self, eps: float, generator: torch.Generator) -> None:
        """Uniform random start of the perturbation in [-eps, eps]."""
        for noise in (self.neuron_noise, self.neuron_noise_bias):
            noise.copy_((torch.rand(noise.shape, generator=generator) * 2 - 1) * eps)

    def forward(self, x: Tensor) -> Tensor:
        if self.perturbed:
            scale, shift = self.neuron_mask + self.neuron_noise, 1.0 + self.neuron_noise_bias
        else:
            scale, shift = self.neuron_mask, 1.0
        # The bookkeeping of nn.BatchNorm2d.forward, with the masked/perturbed affine parameters.
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        return F.batch_norm(
            x, self.running_mean if track else None, self.running_var if track else None,
            self.weight * scale, self.bias * shift, use_batch_stats, momentum, self.eps,
        )


class AdversarialNeuronPruning(Defense):
    """Adversarial Neuron Pruning (Wu & Wang, "Adversarial Neuron Pruning Purifies Backdoored Deep
    Models", NeurIPS 2021).

    Backdoor neurons are those whose small perturbation collapses the model. Every batch-norm
    neuron gets a mask m in [0, 1]; on the clean subset, an inner step finds the multiplicative
    perturbation (within eps) of BN scales and shifts that maximizes the loss, and the masks
    minimize alpha * natural loss + (1 - alpha) * perturbed loss; neurons whose mask ends below
    `threshold` (or the lowest `prune_fraction`) have their BN scale set to zero, as the official
    code prunes. Defaults are the official ones: eps 0.4, one signed-gradient perturbation step
    of size eps from a uniform start in [-eps, eps], not clipped after (so the perturbation spans
    [-2 eps, 2 eps]), alpha 0.2, mask SGD lr 0.2 with momentum 0.9, 2,000 iterations of batch 128
    drawn with replacement and augmented, the model in training mode. `clip_noise=true` clips the
    perturbation to [-eps, eps] after each step instead, the box the paper states. Departures:
    one pruning threshold, 0.2 (the official code sweeps thresholds on test data, which a defense
    never sees); only BatchNorm2d neurons are perturbed (the architectures here have no
    BatchNorm1d). The optimization runs in the run's precision
    (`trainer.precision`, backdoorbench/precision.py; fp32 on the CPU).
    Ledger: docs/fidelity.md#anp.
    """

    name = "anp"
    family = "pruning"
    sensitivity = ("threshold",)  # swept by conf/experiment/sensitivity_anp.yaml
    stage = "post_train"

    def __init__(
        self,
        *,
        eps: float = 0.4,
        noise_steps: int = 1,
        clip_noise: bool = False,
        alpha: float = 0.2,
        mask_lr: float = 0.2,
        iterations: int = 2000,
        batch_size: int = 128,
        prune_by: str = "threshold",
        threshold: float = 0.2,
        prune_fraction: float = 0.05,
        clean_fraction: float = 0.05,
    ) -> None:
        super().__init__(clean_fraction=clean_fraction)
        for key, value in (("noise_steps", noise_steps), ("iterations", iterations), ("batch_size", batch_size)):
            checks.integer("defense", key, value, 1)
        checks.number("defense", "eps", eps, 0)
        checks.number("defense", "mask_lr", mask_lr, 0, low_open=True)
        for key, value in (("alpha", alpha), ("threshold", threshold), ("prune_fraction", prune_fraction)):
            checks.number("defense", key, value, 0, 1)
        if not isinstance(clip_noise, bool):
            raise ConfigError(f"defense.clip_noise={clip_noise!r} is invalid; use true or false")
        if prune_by not in PRUNE_BY:
            raise ConfigError(f"defense.prune_by={prune_by!r} is unknown; choose one of: {', '.join(PRUNE_BY)}")
        self.eps = float(eps)
        self.noise_steps = noise_steps
        self.clip_noise = clip_noise
        self.alpha = float(alpha)
        self.mask_lr = float(mask_lr)
        self.iterations = iterations
        self.batch_size = batch_size
        self.prune_by = prune_by
        self.threshold = float(threshold)
        self.prune_fraction = float(prune_fraction)

    def perturbable_copy(self, ctx: DefenseContext) -> nn.Module:
        """The attacked model rebuilt with NoisyBatchNorm2d, carrying the attacked weights."""
        if ctx.build_model is None:
            raise ConfigError("defense anp needs ctx.build_model to rebuild the model with a noisy batch norm")
        try:
            noisy = ctx.build_model(norm_layer=NoisyBatchNorm2d)
        except TypeError as exc:
            raise ConfigError(
                f"defense anp needs an architecture that takes norm_layer=; this one does not ({exc})"
            ) from exc
        if not any(isinstance(m, NoisyBatchNorm2d) for m in noisy.modules()):
            raise ConfigError(
                "defense anp needs BatchNorm2d layers built through norm_layer=; "
                f"model {getattr(noisy, 'name', '?')!r} has none"
            )
        result = noisy.load_state_dict(ctx.model.state_dict(), strict=False)
        missing = [k for k in result.missing_keys if not k.rsplit(".", 1)[-1].startswith("neuron_")]
        if missing or result.unexpected_keys:
            raise ConfigError(
                f"defense anp: the rebuilt model does not match the attacked one (missing {missing[:3]}, "
                f"unexpected {result.unexpected_keys[:3]})"
            )
        return noisy

    def optimize_masks(self, ctx: DefenseContext, noisy: nn.Module) -> dict[str, Tensor]:
        """Run ANP's min-max on the clean subset; return each noisy BN's mask, keyed by module name."""
        trainer, clean, generator = ctx.trainer, ctx.clean_subset, ctx.generator
        device = trainer.device
        noisy = noisy.to(device)
        layers = {name: m for name, m in noisy.named_modules() if isinstance(m, NoisyBatchNorm2d)}
        for param in noisy.parameters():
            param.requires_grad_(False)
        masks = [m.neuron_mask.requires_grad_(True) for m in layers.values()]
        noises = [p.requires_grad_(True) for m in layers.values() for p in (m.neuron_noise, m.neuron_noise_bias)]
        mask_optimizer = torch.optim.SGD(masks, lr=self.mask_lr, momentum=0.9)
        noise_optimizer = torch.optim.SGD(noises, lr=self.eps / self.noise_steps) if self.eps > 0 else None
        images, labels = clean.images.to(device), clean.labels.to(device)

        def perturb(on: bool) -> None:
            for m in layers.values():
                m.perturbed = on

        noisy.train()  # as the official code: batch statistics of the clean batch
        for _ in track(range(self.iterations), "anp: mask optimization", unit="iterations"):
            idx = torch.randint(len(clean), (self.batch_size,), generator=generator).to(device)
            x, y = to_float(images[idx]), labels[idx]
            if trainer.augment:
                x = augment_batch(x, generator, trainer.crop_padding, trainer.hflip)
            if noise_optimizer is not None:
                for m in layers.values():
                    m.reset_noise(self.eps, generator)
                perturb(True)
                for _ in range(self.noise_steps):
                    noise_optimizer.zero_grad(set_to_none=True)
                    (-F.cross_entropy(noisy(x), y)).backward()
                    for p in noises:
                        p.grad = torch.sign(p.grad)
                    noise_optimizer.step()
                    if self.clip_noise:  # the paper's box; the official code takes the step unclipped
                        with torch.no_grad():
                            for p in noises:
                                p.clamp_(-self.eps, self.eps)
            mask_optimizer.zero_grad(set_to_none=True)
            robust = F.cross_entropy(noisy(x), y) if noise_optimizer is not None else torch.zeros((), device=device)
            perturb(False)
            natural = F.cross_entropy(noisy(x), y)
            (self.alpha * natural + (1 - self.alpha) * robust).backward()
            mask_optimizer.step()
            with torch.no_grad():
                for mask in masks:
                    mask.clamp_(0.0, 1.0)
        return {name: m.neuron_mask.detach().cpu().clone() for name, m in layers.items()}

    def neurons_to_prune(self, masks: dict[str, Tensor]) -> dict[str, Tensor]:
        """Indices to prune per layer: mask <= threshold, or the lowest `prune_fraction` of all neurons."""
        if self.prune_by == "threshold":
            return {name: torch.nonzero(mask <= self.threshold).flatten() for name, mask in masks.items()}
        values = torch.cat(list(masks.values()))
        count = round(self.prune_fraction * len(values))
        chosen = torch.zeros(len(values), dtype=torch.bool)
        chosen[torch.argsort(values, stable=True)[:count]] = True
        out, start = {}, 0
        for name, mask in masks.items():
            out[name] = torch.nonzero(chosen[start : start + len(mask)]).flatten()
            start += len(mask)
        return out

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        require_clean_subset(ctx, self.name)
        masks = self.optimize_masks(ctx, self.perturbable_copy(ctx))
        pruned = self.neurons_to_prune(masks)
        model = copy.deepcopy(ctx.model)
        with torch.no_grad():
            for name, indices in pruned.items():
                norm = model.get_submodule(name)
                norm.weight[indices.to(norm.weight.device)] = 0.0  # the official pruning: zero the BN scale
        all_masks = torch.cat(list(masks.values()))
        return DefenseResult(model=model, extras={
            "n_neurons": int(len(all_masks)),
            "n_pruned": int(sum(len(i) for i in pruned.values())),
            "pruned_per_layer": [int(len(i)) for i in pruned.values()],
            "mask_mean": float(all_masks.mean()),
            "mask_min": float(all_masks.min()),
        })

    def describe(self) -> dict:
        return {**super().describe(), "eps": self.eps, "noise_steps": self.noise_steps,
                "clip_noise": self.clip_noise, "alpha": self.alpha,
                "mask_lr": self.mask_lr, "iterations": self.iterations, "batch_size": self.batch_size,
                "prune_by": self.prune_by, "threshold": self.threshold, "prune_fraction": self.prune_fraction}
