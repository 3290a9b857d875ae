"""A defense's and an attack's compute in units that compare across machines: images passed forward
and backward through the model, and FLOPs.

Every pass of a classifier, whole (`model(x)`) or features only (`model.features(x)`, as Spectral
Signatures and Activation Clustering take them), runs its `features` module, so that module is
where an image is counted. `PassCounter.watch(model)` tags it; copies of the model (`deepcopy`,
which most defenses start from) keep the tag, and so do models built by `ctx.build_model`, which
the runner watches. While `counting()` is on, a global forward hook counts the images entering a
tagged module, and a hook on its output counts them again when a backward pass reaches it. Work
that does not run the classifier (ICA, clustering, a trigger generator's own layers) is not
counted; its time is in `seconds`.

An attack's cost (`attack_cost`) is counted otherwise, since an attack's networks are its own
(a trigger generator, an encoder, a surrogate): the images entering every outermost network call
during its preparation and poisoning (backdoorbench/train/passes.py), per training image.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from backdoorbench.train.passes import CallCounter

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


# How `attack_cost.seconds` and the passes came about: counted in this run; the attack's prepare
# result came from its own cache and the cost recorded when it was made (its describe()'s
# `prepare_cost`) is added to this run's; or it came from that cache with no cost recorded, so the
# numbers hold only this run's loading and poisoning.
PREPARE_COST_SOURCES = ("measured", "recorded", "unknown")


def _per(value: float | int | None, n: int) -> float | None:
    return None if value is None or not n else value / n


def attack_cost(counted: CallCounter | dict[str, Any] | None, training_images: int, *, cached: bool = False,
                prepare_cost: str = "measured", clean_control_s: float | None = None,
                training: CallCounter | None = None) -> dict[str, Any]:
    """The record's `attack_cost`: what mounting the attack cost on `training_images` (N) images.

    `counted`: the poison stage's counter (its seconds, forward and backward images at outermost
    network calls), or a dict of `seconds` (and images, None where unknown). `passes` are those
    images over N (2.5: the attack's networks saw the equivalent of 2.5 passes over the training
    set). `training`: the counter of a training-controlled attack's victim training, whose
    `passes_per_epoch` compare with a clean training's 1 forward and 1 backward per image per epoch."""
    counted = counted.snapshot() if isinstance(counted, CallCounter) else dict(counted or {})
    seconds = round(max(float(counted.get("seconds") or 0.0), 0.0), 4)
    forward, backward = counted.get("forward_images"), counted.get("backward_images")
    known = forward is not None and backward is not None
    return {
        "training_images": int(training_images),
        "seconds": seconds,
        "seconds_per_training_image": _per(seconds, training_images),
        "forward_images": forward,
        "backward_images": backward,
        "passes": {"forward": _per(forward, training_images), "backward": _per(backward, training_images)}
        if known and training_images else None,
        "cached": bool(cached),
        "prepare_cost": prepare_cost,
        "clean_control_s": clean_control_s,
        "victim_training": None if training is None else {
            "images": training.trained_images,
            "epochs": round(training.trained_images / training_images, 4) if training_images else None,
            "forward_images": training.forward_images,
            "backward_images": training.backward_images,
            "passes_per_epoch": {"forward": _per(training.forward_images, training.trained_images),
                                 "backward": _per(training.backward_images, training.trained_images)}
            if training.trained_images else None,
        },
    }


def attack_cost_line(cost: dict[str, Any] | None) -> str | None:
    """`attack cost: 180.2 s (45.1 ms per training image), 2.50 forward / 2.50 backward passes`, and the
    victim training's passes per image per epoch for a training-controlled attack; None without a cost."""
    if not cost:
        return None
    seconds, per_image = cost["seconds"], cost.get("seconds_per_training_image")
    line = f"attack cost: {seconds:.1f} s" if seconds >= 1 else f"attack cost: {seconds:.3g} s"
    if per_image is not None:
        line += f" ({per_image * 1e3:.1f} ms" if per_image >= 1e-4 else f" ({per_image * 1e6:.3g} µs"
        line += " per training image)"
    passes = cost.get("passes")
    line += (f", {passes['forward']:.2f} forward / {passes['backward']:.2f} backward passes" if passes
             else ", passes not counted")
    if cost.get("prepare_cost") == "unknown":
        line += " (prepared from a cache that kept no cost: this run's share only)"
    training = (cost.get("victim_training") or {}).get("passes_per_epoch")
    if training:
        line += (f"; victim training {training['forward']:.2f} forward / {training['backward']:.2f} backward "
                 "per image per epoch (clean: 1 / 1)")
    return line
