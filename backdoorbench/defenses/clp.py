"""Channel Lipschitzness-based Pruning: data-free removal of channels with an outlying Lipschitz bound."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.errors import ConfigError


def conv_bn_pairs(model: nn.Module, image_shape: tuple[int, ...]) -> list[tuple[str, nn.Conv2d, nn.BatchNorm2d]]:
    """(bn name, conv, bn) for every BatchNorm2d that normalizes a Conv2d's output directly.

    Found by one forward pass of a zero image: a BN is paired with the conv whose output tensor is
    its input, so the pairing holds whatever order the modules were registered in.
    """
    produced: dict[int, nn.Conv2d] = {}
    alive: list[Tensor] = []  # keeps outputs referenced so ids stay unique during the pass
    pairs: list[tuple[str, nn.Conv2d, nn.BatchNorm2d]] = []
    names = {id(m): name for name, m in model.named_modules()}

    def conv_hook(module, inputs, output) -> None:
        produced[id(output)] = module
        alive.append(output)

    def bn_hook(module, inputs, output) -> None:
        conv = produced.get(id(inputs[0]))
        if conv is not None and conv.out_channels == module.num_features and module.affine:
            pairs.append((names[id(module)], conv, module))

    handles = [m.register_forward_hook(conv_hook) for m in model.modules() if isinstance(m, nn.Conv2d)]
    handles += [m.register_forward_hook(bn_hook) for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    was_training = model.training
    try:
        model.eval()
        device = next(model.parameters()).device
        with torch.no_grad():
            model(torch.zeros(1, *image_shape, device=device))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return pairs


@torch.no_grad()
def channel_lipschitz_upper_bound(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> Tensor:
    """UCLC per output channel: the spectral norm of the channel's kernel, reshaped to
    (in_channels, k*k), times |gamma / sqrt(running_var + eps)| of the BN that follows."""
    kernels = conv.weight.detach().float().flatten(2)  # (out, in/groups, k*k)
    spectral = torch.linalg.matrix_norm(kernels, ord=2)
    scale = (bn.weight.detach().float() / (bn.running_var.detach().float() + bn.eps).sqrt()).abs()
    return (spectral * scale).cpu()


class ChannelLipschitzPruning(Defense):
    """CLP (Zheng, Zhang, Wagner, Goldblum, Koushanfar, "Data-free Backdoor Removal based on Channel
    Lipschitzness", ECCV 2022).

    A trigger must move a few channels a lot for a small input change, so backdoor channels have a
    large Lipschitz constant. Per conv layer, the upper bound of each channel's Lipschitz constant
    (UCLC: spectral norm of its kernel times its BN scale) is computed from the weights alone, and
    channels with UCLC > mean + u * std of their layer are pruned (BN scale and shift set to 0),
    without data or fine-tuning. u = 3 is the paper's default. Departures: conv->BN pairs are found
    by tracing a zero image (`conv_bn_pairs`) instead of registration order; convolutions not
    followed by a batch norm are left alone, as in the official code. The BN of a pre-activation
    block follows a residual sum, not a conv, and is not paired.
    """

    name = "clp"
    stage = "post_train"
    needs_clean_data = False

    def __init__(self, *, u: float = 3.0, clean_fraction: float = 0.0) -> None:
        super().__init__(clean_fraction=clean_fraction)
        self.u = checks.number("defense", "u", u, 0, hint="the paper uses 3")

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        model = copy.deepcopy(ctx.model).to(ctx.trainer.device)
        # Only the input's shape is read (a zero image traces the graph); CLP uses no data.
        image_shape = tuple(ctx.poisoned_train.images.shape[1:])
        pairs = conv_bn_pairs(model, image_shape)
        if not pairs:
            raise ConfigError(
                "defense clp needs Conv2d layers followed by BatchNorm2d; "
                f"model {getattr(model, 'name', '?')!r} has none"
            )
        pruned: list[list[int]] = []
        n_channels = 0
        with torch.no_grad():
            for _, conv, bn in pairs:
                bound = channel_lipschitz_upper_bound(conv, bn)
                limit = bound.mean() + self.u * bound.std() if len(bound) > 1 else float("inf")
                prune = torch.nonzero(bound > limit).flatten().to(bn.weight.device)
                bn.weight[prune] = 0.0
                bn.bias[prune] = 0.0
                pruned.append([int(c) for c in prune])
                n_channels += len(bound)
        return DefenseResult(model=model, extras={
            "n_layers": len(pairs),
            "n_channels": n_channels,
            "n_pruned": sum(len(p) for p in pruned),
            "pruned_per_layer": [len(p) for p in pruned],
            "pruned_channels": pruned,  # per conv->BN pair, in forward order
        })

    def describe(self) -> dict:
        return {**super().describe(), "u": self.u}
