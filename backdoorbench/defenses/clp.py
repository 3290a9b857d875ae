"""Channel Lipschitzness-based Pruning: data-free removal of channels with an outlying Lipschitz bound."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.errors import ConfigError


@dataclass(frozen=True)
class ConvBN:
    """A convolution scored by CLP and the batch norm whose per-channel scale bounds it.

    `through_sum`: the BN normalizes a residual sum that this conv's output is one operand of (a
    pre-activation block's conv2 or projection shortcut, read by the next block's bn1). Channel k
    of that BN is gamma_k / sigma_k * (conv_k(u) + other operands_k) + const, so as a function of
    the conv's input u it is Lipschitz with constant |gamma_k / sigma_k| * ||W_k||, the same UCLC
    as a BN right after the conv. Pruning such a channel zeroes the conv's own output channel
    (its kernel and bias), not the BN's, which would also cut the skip path's channel.
    """

    bn_name: str
    conv: nn.Conv2d
    bn: nn.BatchNorm2d
    through_sum: bool = False


def conv_bn_pairs(model: nn.Module, image_shape: tuple[int, ...]) -> list[ConvBN]:
    """Every Conv2d whose output reaches an affine BatchNorm2d either directly or as an operand of
    the one residual sum the BN normalizes, in forward order.

    Found by one forward pass of a zero image, reading the autograd graph: a BN whose input was
    made by a conv is paired with it; a BN whose input was made by an addition is paired with the
    convs among the addition's operands. Only one addition is looked through: an identity operand
    is the previous block's sum, whose convs are bounded by their own BN, not this one.
    """
    made_by: dict[object, nn.Conv2d] = {}  # autograd node of a conv's output -> the conv
    alive: list[object] = []  # keeps the nodes alive (and their ids unique) during the pass
    pairs: list[ConvBN] = []
    paired: set[int] = set()
    names = {id(m): name for name, m in model.named_modules()}

    def conv_hook(module, inputs, output) -> None:
        if output.grad_fn is not None:
            made_by[output.grad_fn] = module
            alive.append(output.grad_fn)

    def pair(conv: nn.Conv2d, bn: nn.BatchNorm2d, through_sum: bool) -> None:
        if id(conv) not in paired and conv.out_channels == bn.num_features and bn.affine:
            paired.add(id(conv))
            pairs.append(ConvBN(names[id(bn)], conv, bn, through_sum))

    def bn_hook(module, inputs, output) -> None:
        node = inputs[0].grad_fn
        if node is None:
            return
        if node in made_by:
            pair(made_by[node], module, through_sum=False)
        elif type(node).__name__.startswith("AddBackward"):
            for operand, _ in node.next_functions:
                if operand is not None and operand in made_by:
                    pair(made_by[operand], module, through_sum=True)

    handles = [m.register_forward_hook(conv_hook) for m in model.modules() if isinstance(m, nn.Conv2d)]
    handles += [m.register_forward_hook(bn_hook) for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    was_training = model.training
    try:
        model.eval()
        device = next(model.parameters()).device
        with torch.enable_grad():  # the graph is the trace; no backward is run
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
    without data or fine-tuning. u = 3 is the paper's default. Ledger: docs/fidelity.md#clp.
    Departures: conv->BN pairs are found by tracing a zero image (`conv_bn_pairs`) instead of
    registration order, which pairs a BN with whatever conv was registered last before it. In a
    pre-activation block the BN after the residual sum bounds every conv that feeds the sum
    (conv2 and the projection shortcut; see `ConvBN`), so PreAct-ResNet-18 has 19 of its 20 convs
    scored (the last conv2 feeds the pooling, no BN); a conv no BN reads is left alone, as in the
    official code.
    """

    name = "clp"
    family = "pruning"
    sensitivity = ("u",)  # swept by conf/experiment/sensitivity_clp.yaml
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
            for scored in pairs:
                conv, bn = scored.conv, scored.bn
                bound = channel_lipschitz_upper_bound(conv, bn)
                limit = bound.mean() + self.u * bound.std() if len(bound) > 1 else float("inf")
                prune = torch.nonzero(bound > limit).flatten().to(bn.weight.device)
                if scored.through_sum:  # only this conv's share of the summed channel goes
                    conv.weight[prune] = 0.0
                    if conv.bias is not None:
                        conv.bias[prune] = 0.0
                else:  # the official code's surgery: the channel's BN scale and shift
                    bn.weight[prune] = 0.0
                    bn.bias[prune] = 0.0
                pruned.append([int(c) for c in prune])
                n_channels += len(bound)
        return DefenseResult(model=model, extras={
            "n_layers": len(pairs),
            "n_layers_through_sum": sum(p.through_sum for p in pairs),
            "n_channels": n_channels,
            "n_pruned": sum(len(p) for p in pruned),
            "pruned_per_layer": [len(p) for p in pruned],
            "pruned_channels": pruned,  # per scored conv, in forward order
        })

    def describe(self) -> dict:
        return {**super().describe(), "u": self.u}
