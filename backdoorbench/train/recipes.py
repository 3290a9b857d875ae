"""Training recipes of the official defense code, applied to a copy of the run's trainer.

A defense that fine-tunes or unlearns by its authors' recipe (optimizer, lr steps, augmentation)
must not inherit the victim's (e.g. a cosine schedule with weight decay 5e-4): `recipe` returns
a shallow copy of the trainer with those settings replaced, the run's trainer untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from functools import partial

import torch


def step_schedule(epochs: int, boundaries: Sequence[int], factors: Sequence[float]) -> Callable[[float], float]:
    """The lr factor of an epoch as the trainer asks for it (progress = epoch / epochs): factors[i]
    from epoch boundaries[i - 1] on, factors[0] before boundaries[0]; e.g. NAD's 0.1 for two
    epochs then 0.01 is step_schedule(epochs, [2], [1.0, 0.1]) at lr 0.1."""
    if len(factors) != len(boundaries) + 1:
        raise ValueError("step_schedule needs one factor more than boundaries")

    def factor(progress: float) -> float:
        epoch = round(progress * max(epochs, 1))
        return factors[sum(epoch >= b for b in boundaries)]

    return factor


def recipe(trainer, *, epochs: int, boundaries: Sequence[int] = (), factors: Sequence[float] = (1.0,),
           momentum: float = 0.9, weight_decay: float = 0.0, nesterov: bool = False, augment: bool | None = None,
           batch_size: int | None = None, shuffle: bool | None = None,
           optimizer: torch.optim.Optimizer | None = None):
    """A copy of `trainer` that trains with SGD(momentum, weight_decay, nesterov) at the lr given
    to `fit`, stepped by `factors` at epoch `boundaries`, with `augment`, `batch_size` and `shuffle`
    (False: the split's own order every epoch) when given. `optimizer`: an SGD optimizer made
    before (`sgd`) to go on with, its momentum buffers kept, as official code that unlearns with the
    optimizer it trained with does; the fit's lr and schedule replace its own."""
    copied = copy.copy(trainer)
    if optimizer is None:
        copied.optimizer = partial(torch.optim.SGD, lr=0.01, momentum=momentum, weight_decay=weight_decay,
                                   nesterov=nesterov)
    else:
        copied.optimizer = partial(_continue, optimizer)
    copied.schedule = step_schedule(epochs, boundaries, factors)
    if augment is not None:
        copied.augment = augment
    if batch_size is not None:
        copied.batch_size = batch_size
    if shuffle is not None:
        copied.shuffle = shuffle
    return copied


def sgd(params, *, momentum: float = 0.9, weight_decay: float = 0.0, nesterov: bool = False) -> torch.optim.SGD:
    """The SGD optimizer `recipe(optimizer=...)` carries from one fit to the next."""
    return torch.optim.SGD(list(params), lr=0.01, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)


def _continue(optimizer: torch.optim.Optimizer, params) -> torch.optim.Optimizer:
    """`optimizer` again for a new fit over the same parameters. The lr scheduler of the last fit
    left `initial_lr` in its groups, which the next scheduler would take as its base lr
    (LambdaLR only sets it where it is missing): it is dropped, so the new fit's lr is the base."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    if {id(p) for p in params} != held:
        raise ValueError("a continued optimizer must train the same parameters as before")
    for group in optimizer.param_groups:
        group.pop("initial_lr", None)
    return optimizer
