"""GradCAM heatmaps on a classifier's last convolutional stage.

Selvaraju, Cogswell, Das, Vedantam, Parikh, Batra, "Grad-CAM: Visual Explanations from Deep
Networks via Gradient-based Localization", ICCV 2017. For class c and feature maps A^k of the
chosen layer, the weight of channel k is the spatial mean of dy_c / dA^k, and the map is
ReLU(sum_k w_k A^k), upsampled bilinearly to the input size. The seed paper uses it to show that
a backdoored model attends to the same regions on clean and poisoned inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench.models.taps import conv_stage_outputs


def last_conv_stage(model: nn.Module, probe: Tensor) -> nn.Module:
    """The module whose output is the feature map of `model`'s last conv stage (as fine-pruning
    and NAD find it: after that stage's norm, activation and pooling, and after a residual add)."""
    return conv_stage_outputs(model, probe)[-1][1]


def gradcam(model: nn.Module, images: Tensor, classes: Tensor | None = None, layer: nn.Module | None = None) -> Tensor:
    """GradCAM maps (B, H, W) in [0, 1] (each divided by its maximum; all zero where the map is)
    for `images` ((B, C, H, W), [0, 1], on the model's device) and `classes` (default: the
    predicted ones). `layer` defaults to the last conv stage; the model is left as it was."""
    was_training = model.training
    model.eval()
    layer = layer if layer is not None else last_conv_stage(model, images[:1])
    captured: list[Tensor] = []

    def keep(module: nn.Module, inputs, output: Tensor) -> None:
        captured.append(output)

    handle = layer.register_forward_hook(keep)
    try:
        with torch.enable_grad():
            x = images.detach().float().requires_grad_(True)  # so the graph reaches the layer even if frozen
            logits = model(x)
            if classes is None:
                classes = logits.argmax(1)
            chosen = logits.gather(1, classes.to(logits.device).view(-1, 1)).sum()
            if not captured or not captured[-1].requires_grad:
                raise RuntimeError("gradcam: the chosen layer does not lie on the path to the logits")
            # autograd.grad, not backward(): the model's parameter .grad stay untouched
            (grads,) = torch.autograd.grad(chosen, captured[-1])
    finally:
        handle.remove()
        model.train(was_training)
    maps, grads = captured[-1].detach().float(), grads.float()
    weights = grads.mean(dim=(2, 3), keepdim=True)
    cam = F.relu((weights * maps).sum(1, keepdim=True))
    cam = F.interpolate(cam, size=images.shape[-2:], mode="bilinear", align_corners=False).squeeze(1).clamp_min(0)
    peak = cam.flatten(1).amax(1).view(-1, 1, 1)
    return torch.where(peak > 0, cam / peak.clamp_min(1e-12), torch.zeros_like(cam)).cpu()
