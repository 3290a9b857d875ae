"""Images through networks, counted at the outermost module call: an attack's compute in units that
compare across machines.

While `CallCounter.counting()` is on, a global forward pre-hook and hook see every `nn.Module` call.
A call made while no other counted call is in progress is an outermost one: the images of its
first tensor argument are counted forward once, whatever the module runs inside (a classifier, its
blocks, a U-Net called by a wrapper), and once more backward when a gradient reaches its output
(`backward()` or `torch.autograd.grad`, once per backward through it). A module without parameters
(a loss module, a parameter-free augmentation) is no network: it is neither counted nor hides the
networks it calls. A data-parallel wrapper (DistributedDataParallel, DataParallel, the trainer's
step module) is transparent: the networks called inside it are the outermost ones.

The trainer tells running counters how many training images each epoch it runs went through
(`epoch_done`), so a training's passes compare with a clean training's one forward and one
backward per image per epoch. Counters may be active at once (the pipeline's, and an attack's
own around the networks it trains); each keeps its own nesting.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

from torch import Tensor, nn

TRANSPARENT = "_backdoorbench_transparent"  # a module attribute: a wrapper whose inner calls are counted instead

_ACTIVE: list[CallCounter] = []


def transparent(module: nn.Module) -> bool:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    return isinstance(module, (DataParallel, DistributedDataParallel)) or getattr(module, TRANSPARENT, False)


def _is_network(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None and not transparent(module)


def _images(value: Any) -> int | None:
    """The batch size of the first tensor in `value` (arguments, nested in tuples, lists, dicts)."""
    if isinstance(value, Tensor):
        return int(value.shape[0]) if value.dim() else 1
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        found = _images(item)
        if found is not None:
            return found
    return None


def epoch_done(images: int) -> None:
    """Called by the trainer after each epoch it runs (not one restored from a checkpoint)."""
    for counter in _ACTIVE:
        if not counter._paused:
            counter.trained_images += images


class CallCounter:
    """`forward_images` and `backward_images` at outermost network calls, the images the trainer's
    epochs went through (`trained_images`), and the `seconds` spent counting, pauses left out."""

    def __init__(self) -> None:
        self.forward_images = 0
        self.backward_images = 0
        self.trained_images = 0
        self._seconds = 0.0
        self._since: float | None = None  # when the running count (or pause) began
        self._depth = 0
        self._open_images = 0
        self._paused = 0

    @property
    def seconds(self) -> float:
        """Seconds counted so far, the running count included."""
        running = time.perf_counter() - self._since if self._since is not None and not self._paused else 0.0
        return self._seconds + running

    def snapshot(self) -> dict[str, float | int]:
        """The cost so far, in the keywords of `add`."""
        return {"seconds": self.seconds, "forward_images": self.forward_images, "backward_images": self.backward_images}

    def add(self, *, seconds: float = 0.0, forward_images: int = 0, backward_images: int = 0) -> None:
        """Add a cost counted elsewhere (a restored preparation, cached networks)."""
        self._seconds += seconds
        self.forward_images += forward_images
        self.backward_images += backward_images

    def _enter(self, module: nn.Module, args: tuple) -> None:
        if self._depth:
            self._depth += 1
        elif _is_network(module):
            self._depth, self._open_images = 1, _images(args) or 0

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._depth:
            return
        self._depth -= 1
        if self._depth or self._paused or not self._open_images:
            return
        images = self._open_images
        self.forward_images += images
        outputs = [t for t in (output if isinstance(output, (tuple, list)) else (output,))
                   if isinstance(t, Tensor) and t.requires_grad]
        # one count per backward through the call, whichever of its outputs the gradient reaches
        fired, counted = [0] * len(outputs), [0]

        def on_grad(position: int):
            def hook(grad: Tensor) -> None:
                fired[position] += 1
                if fired[position] > counted[0]:
                    counted[0] += 1
                    self.backward_images += images
            return hook

        for position, tensor in enumerate(outputs):
            tensor.register_hook(on_grad(position))

    @contextmanager
    def counting(self) -> Iterator[CallCounter]:
        pre = nn.modules.module.register_module_forward_pre_hook(self._enter)
        post = nn.modules.module.register_module_forward_hook(self._leave, always_call=True)
        _ACTIVE.append(self)
        self._since = time.perf_counter()
        try:
            yield self
        finally:
            self._seconds += time.perf_counter() - self._since
            self._since = None
            _ACTIVE.remove(self)
            pre.remove()
            post.remove()
            self._depth = 0

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Neither images nor seconds counted inside (work that is not the counted one's)."""
        if self._since is not None and not self._paused:  # close the running stretch; the next opens after the pause
            self._seconds += time.perf_counter() - self._since
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            if self._since is not None and not self._paused:
                self._since = time.perf_counter()
