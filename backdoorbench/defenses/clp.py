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

    `through_sum` (traced pairing only): the BN normalizes a residual sum that this conv's output
    is one operand of (a pre-activation block's conv2 or projection shortcut, read by the next
    block's bn1). Channel k of that BN is gamma_k / sigma_k * (conv_k(u) + other operands_k) +
    const, so as a function of the conv's input u it is Lipschitz with constant
    |gamma_k / sigma_k| * ||W_k||, the same UCLC as a BN right after the conv. The traced rule
    prunes such a channel by zeroing the conv's own output channel (kernel and bias): that removes
    it from the sum, so from the skip path the later blocks read too. Zeroing the BN instead (the
    official surgery) removes the channel from the next block's residual branch only (and from its
    projection shortcut, which reads the post-BN activation); an identity skip carries the pre-BN
    sum on, channel k included.
    """

    bn_name: str
    conv: nn.Conv2d
    bn: nn.BatchNorm2d
    through_sum: bool = False


def registration_pairs(model: nn.Module) -> tuple[list[ConvBN], int]:
    """The official rule: each affine BatchNorm2d with the Conv2d registered last before it, in
    `named_modules` order, whatever the data flow; and the number of BNs left unpaired (no conv
    before them, or one with another channel count: the official code fails or reads the wrong
    channels there; here such a BN is skipped)."""
    pairs: list[ConvBN] = []
    unpaired = 0
    last: nn.Conv2d | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            last = module
        elif isinstance(module, nn.BatchNorm2d):
            if last is not None and module.affine and last.out_channels == module.num_features:
                pairs.append(ConvBN(name, last, module))
            else:
                unpaired += 1
    return pairs, unpaired


def conv_bn_pairs(model: nn.Module, image_shape: tuple[int, ...]) -> list[ConvBN]:
    """The `traced` pairing: every Conv2d whose output reaches an affine BatchNorm2d either directly
    or as an operand of the one residual sum the BN normalizes, in forward order.

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


PAIRINGS = ("registration", "traced")


class ChannelLipschitzPruning(Defense):
    """CLP (Zheng, Zhang, Wagner, Goldblum, Koushanfar, "Data-free Backdoor Removal based on Channel
    Lipschitzness", ECCV 2022).

    A trigger must move a few channels a lot for a small input change, so backdoor channels have a
    large Lipschitz constant. Per conv layer, the upper bound of each channel's Lipschitz constant
    (UCLC: spectral norm of its kernel times its BN scale) is computed from the weights alone, and
    channels with UCLC > mean + u * std of their layer are pruned, without data or fine-tuning.
    u = 3 is the paper's default. Ledger: docs/fidelity.md#clp.

    `pairing` says which conv each BN bounds. `registration` (the default) is the official code's
    rule: every BN with the conv registered last before it (`registration_pairs`), the channel
    pruned by zeroing the BN's weight and bias. On a conv->BN network (mnist_cnn, the
    post-activation ResNets, VGG) that is the data flow. On our PreAct-ResNet-18 it scores 16 of
    the 20 convs: a block's bn1 is paired with the previous block's conv2 (one operand of the sum
    it reads); the 3 projection shortcuts and the last conv2 are not scored. (BackdoorBench's
    PreActBlock registers the shortcut after conv2, so there the bn1 after a projection block is
    paired with the shortcut instead: 3 of its 16 pairs differ from ours.) `traced`, our earlier
    rule, pairs through the autograd graph of a zero image (`conv_bn_pairs`): the BN after a
    residual sum bounds every conv feeding it, 19 of 20 convs on PreAct-ResNet-18, and a conv
    feeding a sum is pruned by zeroing its own kernel channel (see `ConvBN`). A conv no BN reads
    is left alone under both rules, as in the official code.
    """

    name = "clp"
    family = "pruning"
    sensitivity = ("u",)  # swept by conf/experiment/sensitivity_clp.yaml
    stage = "post_train"
    needs_clean_data = False

    def __init__(self, *, u: float = 3.0, pairing: str = "registration", clean_fraction: float = 0.0) -> None:
        super().__init__(clean_fraction=clean_fraction)
        self.u = checks.number("defense", "u", u, 0, hint="the paper uses 3")
        if pairing not in PAIRINGS:
            raise ConfigError(f"defense.pairing={pairing!r} is unknown; choose one of: {', '.join(PAIRINGS)}")
        self.pairing = pairing

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        model = copy.deepcopy(ctx.model).to(ctx.trainer.device)
        unpaired = 0
        if self.pairing == "registration":
            pairs, unpaired = registration_pairs(model)
        else:
            # Only the input's shape is read (a zero image traces the graph); CLP uses no data.
            pairs = conv_bn_pairs(model, tuple(ctx.poisoned_train.images.shape[1:]))
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
            "pairing": self.pairing,
            "n_layers": len(pairs),
            "n_layers_through_sum": sum(p.through_sum for p in pairs),
            "n_bn_unpaired": unpaired,
            "n_channels": n_channels,
            "n_pruned": sum(len(p) for p in pruned),
            "pruned_per_layer": [len(p) for p in pruned],
            "pruned_channels": pruned,  # per scored pair, in the order of the pairing
        })

    def describe(self) -> dict:
        return {**super().describe(), "u": self.u, "pairing": self.pairing}
