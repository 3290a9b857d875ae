"""Feature taps of a classifier that methods of several families read: the feature maps of its conv
stages (Fine-Pruning, NAD, GradCAM) and its penultimate features (Spectral Signatures, Activation
Clustering)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from backdoorbench.datasets.base import to_float
from backdoorbench.errors import ConfigError


def conv_stage_outputs(model: nn.Module, probe: Tensor) -> list[tuple[str, nn.Module]]:
    """(name, module) whose outputs are the feature maps of the conv stages of `model`'s `features`.

    A stage starts at each direct child of `features` that holds an nn.Conv2d; its feature map is
    the output of the stage's last child that still yields a spatial map (4-D, H*W > 1), i.e. after
    its norm, activation and pooling. Stages are ordered as the forward pass runs them (one probe
    forward of `probe`, [0, 1] images). For mnist_cnn these are the two max-pools (32 and 64
    channels); for a ResNet the stem and each residual stage. Fine-Pruning and NAD both use this.
    """
    net = getattr(model, "net", model)
    features = getattr(net, "features", None)
    children = list(features.named_children()) if isinstance(features, nn.Module) else []
    while len(children) == 1 and any(isinstance(m, nn.Conv2d) for m in children[0][1].modules()):
        prefix, only = children[0]
        children = [(f"{prefix}.{name}", child) for name, child in only.named_children()]
    fired: list[tuple[str, nn.Module, torch.Size | None]] = []
    seen: set[int] = set()

    def record(name: str):
        def hook(module: nn.Module, inputs, output) -> None:
            if id(module) not in seen:
                seen.add(id(module))
                fired.append((name, module, output.shape if isinstance(output, Tensor) else None))
        return hook

    handles = [child.register_forward_hook(record(name)) for name, child in children]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(probe)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()

    stages: list[tuple[str, nn.Module]] = []
    current: tuple[str, nn.Module] | None = None
    in_stage = False
    for name, module, shape in fired:
        if any(isinstance(m, nn.Conv2d) for m in module.modules()):
            if current is not None:
                stages.append(current)
            current, in_stage = None, True
        if in_stage and shape is not None and len(shape) == 4 and shape[2] * shape[3] > 1:
            current = (f"features.{name}", module)
    if current is not None:
        stages.append(current)
    if not stages:
        raise ConfigError(
            f"model {getattr(model, 'name', type(model).__name__)!r} has no nn.Conv2d stage in its `features`; "
            "this defense needs a convolutional network"
        )
    return stages


@torch.no_grad()
def penultimate_features(model: nn.Module, images: Tensor, device: torch.device, batch_size: int = 1024) -> Tensor:
    """`model.features` of uint8 images (N, C, H, W) in eval mode, as float32 (N, d) on the CPU."""
    if not callable(getattr(model, "features", None)):
        raise ConfigError(f"this defense reads penultimate features, but {type(model).__name__} has no .features(x)")
    model = model.to(device).eval()
    out = [model.features(to_float(images[s : s + batch_size].to(device))).float().flatten(1).cpu()
           for s in range(0, len(images), batch_size)]
    return torch.cat(out)


@torch.no_grad()
def last_stage_map_features(model: nn.Module, images: Tensor, device: torch.device, batch_size: int = 1024) -> Tensor:
    """The feature map of the last conv stage (`conv_stage_outputs`), unpooled and flattened, of uint8
    images (N, C, H, W) in eval mode, as float32 (N, C' * H' * W') on the CPU: a ResNet's last residual
    stage before its global pooling (BackdoorBench's `layer4` tap), mnist_cnn's last max-pool."""
    model = model.to(device).eval()
    _, module = conv_stage_outputs(model, to_float(images[:1].to(device)))[-1]
    out: list[Tensor] = []
    handle = module.register_forward_hook(lambda _m, _i, output: out.append(output.float().flatten(1).cpu()))
    try:
        for s in range(0, len(images), batch_size):
            model(to_float(images[s : s + batch_size].to(device)))
    finally:
        handle.remove()
    return torch.cat(out)
