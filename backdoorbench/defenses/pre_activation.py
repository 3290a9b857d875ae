"""What EP and BNP share (backdoorbench/defenses/ep.py, bnp.py): the pre-activations of every
BatchNorm2d on one batch, EP's histogram entropy, BNP's Gaussian KL, and the pruning by layer outliers."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.errors import ConfigError


def batch_norm_inputs(model: nn.Module, bns: dict[str, nn.BatchNorm2d], images: Tensor,
                      device: torch.device) -> dict[str, Tensor]:
    """The input of each of `bns` (`batch_norms(model)`: its pre-activation), (N, C, H, W) on the CPU
    in fp32, for one forward pass of `images` (uint8) through `model` in eval mode."""
    seen: dict[str, Tensor] = {}
    hooks = [bn.register_forward_hook(
        lambda mod, inputs, output, name=name: seen.__setitem__(name, inputs[0].detach().float().cpu()))
        for name, bn in bns.items()]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(device_type=device.type, enabled=False):
            model(to_float(images).to(device))
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return seen


def batch_norms(model: nn.Module) -> dict[str, nn.BatchNorm2d]:
    bns = {name: m for name, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    if not bns or not all(bn.affine and bn.track_running_stats for bn in bns.values()):
        name = getattr(getattr(model, "net", model), "name", type(model).__name__)
        raise ConfigError(f"this defense reads and prunes BatchNorm2d layers with affine weights and running "
                          f"statistics; model {name!r} has none; choose one with batch norm "
                          "(mnist_cnn, preact_resnet18, resnet18, vgg16_bn)")
    return bns


def one_batch(split: Split, size: int, generator: torch.Generator) -> Tensor:
    """`size` images of `split` in a seeded random order (all of them if it holds fewer): the first
    batch of a shuffled loader, as the official code takes."""
    order = torch.randperm(len(split), generator=generator)[:size]
    return split.images[order]


def histogram_entropy(features: Tensor, step: float) -> Tensor:
    """The official EP entropy of each row of `features` (C, N): bins of width `step` shared by the
    whole layer, from its minimum, `int((max - min) / step)` of them; a value counts in bin b when
    min + b step < value < min + (b + 1) step (strictly: a value on an edge, the minimum among
    them, counts nowhere); p = count / N; H = -sum p log p, 0 log 0 = 0."""
    low, high = float(features.min()), float(features.max())
    bars = int((high - low) / step)
    n = features.shape[1]
    if bars == 0:
        return torch.zeros(features.shape[0], dtype=torch.float64)
    position = (features.double() - low) / step
    index = position.floor()
    counted = (index < bars) & (position != index)  # past the last bar, or on an edge: not counted
    counts = torch.zeros(features.shape[0], bars, dtype=torch.float64)
    counts.scatter_add_(1, index.clamp(max=bars - 1).long(), counted.double())
    p = counts / n
    return -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(1)


def outliers(scores: Tensor, u: float, side: str) -> Tensor:
    """Indices of the finite scores beyond mean -/+ u * std (unbiased) of the finite ones, per layer."""
    finite = torch.isfinite(scores)
    if int(finite.sum()) < 2:
        return torch.zeros(0, dtype=torch.long)
    values = scores[finite]
    mean, std = values.mean(), values.std()
    beyond = scores < mean - u * std if side == "low" else scores > mean + u * std
    return torch.nonzero(beyond & finite).flatten()


class PreActivationPruning(Defense):
    """What EP and BNP share: a score per channel of every BatchNorm2d from its input (the
    pre-activation) on one batch, the channels beyond mean +- u std of their layer pruned by zeroing
    the BN's weight (the official surgery: its bias stays, so the channel outputs that constant),
    no fine-tuning."""

    sensitivity = ("u",)
    stage = "post_train"
    side = "high"  # which tail of a layer's scores is pruned

    def __init__(self, *, u: float = 3.0, batch_size: int = 500, clean_fraction: float = 0.0) -> None:
        super().__init__(clean_fraction=clean_fraction)
        self.u = checks.number("defense", "u", u, 0, hint="the official default is 3; BackdoorBench takes 4 on Tiny-ImageNet")
        self.batch_size = checks.integer("defense", "batch_size", batch_size, 2, hint="the official batch is 500 images")

    def check_model(self, model: nn.Module) -> None:
        batch_norms(model)

    def images(self, ctx: DefenseContext) -> Tensor:
        """The one batch (uint8) the scores are read from."""
        raise NotImplementedError

    def layer_scores(self, bns: dict[str, nn.BatchNorm2d], inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """A score per channel of each batch norm, from its inputs on that batch (NaN: unscored)."""
        raise NotImplementedError

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        model = copy.deepcopy(ctx.model).to(ctx.trainer.device)
        bns = batch_norms(model)
        images = self.images(ctx)
        inputs = batch_norm_inputs(model, bns, images, torch.device(ctx.trainer.device))
        scores = self.layer_scores(bns, inputs)
        pruned: dict[str, list[int]] = {}
        with torch.no_grad():
            for name, bn in bns.items():
                channels = outliers(scores[name], self.u, self.side)
                bn.weight[channels.to(bn.weight.device)] = 0.0
                pruned[name] = [int(c) for c in channels]
        return DefenseResult(model=model, extras={
            "n_images": int(len(images)),
            "n_layers": len(bns),
            "n_channels": sum(bn.num_features for bn in bns.values()),
            "n_pruned": sum(len(c) for c in pruned.values()),
            "n_unscored": int(sum((~torch.isfinite(s)).sum() for s in scores.values())),
            "pruned_per_layer": [len(c) for c in pruned.values()],
            "pruned_channels": list(pruned.values()),
        }, artifacts={f"scores_{i}": s.float() for i, s in enumerate(scores.values())})

    def describe(self) -> dict:
        return {**super().describe(), "u": self.u, "batch_size": self.batch_size}


def gaussian_kl(mu1: Tensor, var1: Tensor, mu2: Tensor, var2: Tensor) -> Tensor:
    """KL(N(mu1, var1) || N(mu2, var2)), elementwise: log(s2 / s1) + (var1 + (mu1 - mu2)^2) / (2 var2) - 1/2."""
    return 0.5 * torch.log(var2 / var1) + (var1 + (mu1 - mu2) ** 2) / (2 * var2) - 0.5
