"""A defense's compute in units that compare across machines: images passed forward and backward
through the model, and FLOPs.

Every pass of a classifier, whole (`model(x)`) or features only (`model.features(x)`, as Spectral
Signatures and Activation Clustering take them), runs its `features` module, so that module is
where an image is counted. `PassCounter.watch(model)` tags it; copies of the model (`deepcopy`,
which most defenses start from) keep the tag, and so do models built by `ctx.build_model`, which
the runner watches. While `counting()` is on, a global forward hook counts the images entering a
tagged module, and a hook on its output counts them again when a backward pass reaches it. Work
that does not run the classifier (ICA, clustering, a trigger generator's own layers) is not
counted; its time is in `seconds`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

TAG = "_backdoorbench_counts_passes"


def counted_module(model: nn.Module) -> nn.Module:
    """The module every pass of `model` runs: the classifier's `features` (under a `Normalized`
    wrapper, its net's), else the model itself."""
    net = getattr(model, "net", model)
    features = getattr(net, "features", None)
    return features if isinstance(features, nn.Module) else net


class PassCounter:
    """Images through the watched models: `forward_images`, `backward_images`, and the seconds
    spent counting. One counter per scope; counting scopes do not nest."""

    def __init__(self) -> None:
        self.forward_images = 0
        self.backward_images = 0
        self.seconds = 0.0

    @staticmethod
    def watch(model: nn.Module) -> nn.Module:
        """Tag `model`'s counted module (kept by its copies); returns `model`."""
        setattr(counted_module(model), TAG, True)
        return model

    def _hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not getattr(module, TAG, False) or not args or not isinstance(args[0], Tensor):
            return
        images = int(args[0].shape[0])
        self.forward_images += images
        if isinstance(output, Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self._backward(images))

    def _backward(self, images: int) -> None:
        self.backward_images += images

    @contextmanager
    def counting(self):
        handle = nn.modules.module.register_module_forward_hook(self._hook)
        started = time.perf_counter()
        try:
            yield self
        finally:
            self.seconds += time.perf_counter() - started
            handle.remove()


@torch.no_grad()
def forward_flops_per_image(model: nn.Module, image_shape: tuple[int, ...]) -> int | None:
    """FLOPs of one forward pass of one image (torch.utils.flop_counter: a multiply-add is 2),
    in eval mode on the model's device; None when the model cannot be counted."""
    try:
        parameter = next(model.parameters())
    except StopIteration:
        return None
    was_training = model.training
    model.eval()
    try:
        x = torch.zeros(1, *image_shape, device=parameter.device)
        with FlopCounterMode(display=False) as counter:
            model(x)
        return int(counter.get_total_flops())
    except Exception:  # an op the counter cannot trace: no number rather than a made-up one
        return None
    finally:
        model.train(was_training)


def cost_summary(counter: PassCounter, n_train: int, flops_per_image: int | None) -> dict[str, Any]:
    """The record's `defense_cost`: seconds, images forward/backward, passes (forward + backward
    images) per training image, and FLOPs = forward FLOPs per image x (forward + 2 x backward
    images), the usual estimate of a backward pass as twice a forward one."""
    passes = counter.forward_images + counter.backward_images
    return {
        "seconds": round(counter.seconds, 4),
        "forward_images": counter.forward_images,
        "backward_images": counter.backward_images,
        "passes_per_train_image": passes / n_train if n_train else None,
        "forward_flops_per_image": flops_per_image,
        "flops": (float(flops_per_image) * (counter.forward_images + 2 * counter.backward_images)
                  if flops_per_image is not None else None),
    }
