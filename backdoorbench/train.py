"""The one trainer every attack and defense uses: data on the device, batched augmentation, hooks.

The whole training split lives on the training device as one uint8 tensor; each step indexes a
batch, converts it to [0, 1] floats and augments it with tensor ops (random crop with zero
padding, horizontal flip where the dataset allows it). Training-time attacks and in-training
defenses replace the per-batch loss through the `step` hook.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from backdoorbench.datasets.base import Split, to_float
from backdoorbench.errors import ConfigError, UserError

# A step maps (model, augmented images in [0, 1], labels) to (loss, logits, labels scored).
StepFn = Callable[[nn.Module, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
EpochCallback = Callable[[dict[str, Any]], None]


class TrainingError(UserError):
    """Training cannot go on (e.g. the loss became NaN); the message says at which epoch."""


def resolve_device(device: str) -> torch.device:
    """`auto` picks CUDA when present, else the CPU; anything else is passed to torch."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"device={device!r} is not a device; use auto, cpu, cuda or cuda:N") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} asked for CUDA but no GPU is visible; use device=auto or cpu")
    return resolved


def cross_entropy_step(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    logits = model(x)
    return F.cross_entropy(logits, y), logits, y


def augment_batch(x: Tensor, generator: torch.Generator, crop_padding: int, hflip: bool) -> Tensor:
    """Random crop after zero padding by `crop_padding` px, and random horizontal flips, per image."""
    batch, _, height, width = x.shape
    if crop_padding > 0:
        padded = F.pad(x, (crop_padding,) * 4)
        span = 2 * crop_padding + 1
        off_h = torch.randint(span, (batch,), generator=generator).to(x.device)
        off_w = torch.randint(span, (batch,), generator=generator).to(x.device)
        rows = (off_h[:, None] + torch.arange(height, device=x.device)[None, :])[:, None, :, None]
        cols = (off_w[:, None] + torch.arange(width, device=x.device)[None, :])[:, None, None, :]
        channel = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
        sample = torch.arange(batch, device=x.device)[:, None, None, None]
        x = padded[sample, channel, rows, cols]
    if hflip:
        flip = (torch.rand(batch, generator=generator) < 0.5).to(x.device)[:, None, None, None]
        x = torch.where(flip, x.flip(3), x)
    return x


def _cosine(progress: float, milestones, gamma) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _multistep(progress: float, milestones, gamma) -> float:
    return gamma ** sum(progress >= m for m in milestones)


def _constant(progress: float, milestones, gamma) -> float:
    return 1.0


SCHEDULES = {"cosine": _cosine, "multistep": _multistep, "constant": _constant}


class Trainer:
    """Trains and evaluates classifiers on in-memory uint8 splits.

    Example:
        trainer = Trainer(epochs=10, optimizer=partial(torch.optim.SGD, lr=0.01), device="cpu")
        trainer.fit(model, data.train, generator=torch.Generator().manual_seed(0))
        predictions = trainer.predict(model, data.test.images)
    """

    def __init__(
        self,
        *,
        epochs: int = 10,
        batch_size: int = 128,
        eval_batch_size: int = 1024,
        optimizer: Callable[..., torch.optim.Optimizer] = partial(torch.optim.SGD, lr=0.01, momentum=0.9),
        schedule: str = "cosine",
        milestones: tuple[float, ...] = (0.5, 0.75),
        gamma: float = 0.1,
        augment: bool = True,
        crop_padding: int = 0,
        hflip: bool = False,
        amp: bool = True,
        channels_last: bool = True,
        progress: bool = True,
        device: str | torch.device = "cpu",
    ) -> None:
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ConfigError(f"trainer.epochs={epochs!r} is invalid; use an integer >= 0")
        for key, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"trainer.{key}={value!r} is invalid; use an integer >= 1")
        if schedule not in SCHEDULES:
            raise ConfigError(f"trainer.schedule={schedule!r} is unknown; choose one of: {', '.join(SCHEDULES)}")
        self.epochs = epochs
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.optimizer = optimizer
        self.schedule = partial(SCHEDULES[schedule], milestones=tuple(milestones), gamma=gamma)
        self.augment = augment
        self.crop_padding = crop_padding
        self.hflip = hflip
        self.device = resolve_device(device) if isinstance(device, str) else device
        on_cuda = self.device.type == "cuda"
        self.amp = amp and on_cuda  # bf16 autocast only where it pays off
        self.memory_format = torch.channels_last if channels_last and on_cuda else torch.contiguous_format
        self.progress = progress
        self.on_epoch: EpochCallback | None = None  # default per-epoch callback (the run's logger)

    def prepare(self, model: nn.Module) -> nn.Module:
        return model.to(self.device, memory_format=self.memory_format)

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp)

    def fit(
        self,
        model: nn.Module,
        split: Split,
        *,
        generator: torch.Generator,
        epochs: int | None = None,
        lr: float | None = None,
        step: StepFn = cross_entropy_step,
        extra_params: list[nn.Parameter] | None = None,
        desc: str = "train",
        on_epoch: EpochCallback | None = None,
    ) -> list[dict[str, Any]]:
        """Train `model` on `split`; returns one dict per epoch (loss, accuracy, lr, seconds).

        `generator` (a CPU generator) drives shuffling and augmentation, so runs are seeded.
        `step` replaces plain cross-entropy (training-time attacks, in-training defenses).
        """
        epochs = self.epochs if epochs is None else epochs
        model = self.prepare(model)
        params = [p for p in model.parameters() if p.requires_grad] + list(extra_params or [])
        optimizer = self.optimizer(params)
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: self.schedule(e / max(epochs, 1)))
        images = split.images.to(self.device)
        labels = split.labels.to(self.device)
        history: list[dict[str, Any]] = []
        for epoch in range(1, epochs + 1):
            model.train()
            started = time.perf_counter()
            order = torch.randperm(len(split), generator=generator).to(self.device)
            loss_sum = torch.zeros((), device=self.device)
            correct = torch.zeros((), device=self.device, dtype=torch.long)
            seen = 0
            batches = range(0, len(order), self.batch_size)
            bar = tqdm(batches, desc=f"{desc} {epoch}/{epochs}", leave=False, disable=None if self.progress else True)
            for i, start in enumerate(bar):
                idx = order[start : start + self.batch_size]
                x = to_float(images[idx])
                if self.augment:
                    x = augment_batch(x, generator, self.crop_padding, self.hflip)
                x = x.contiguous(memory_format=self.memory_format)
                with self._autocast():
                    loss, logits, scored = step(model, x, labels[idx])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                # Metrics stay on the device; reading them only now and then avoids a sync per step.
                loss_sum += loss.detach() * len(scored)
                correct += (logits.detach().argmax(1) == scored).sum()
                seen += len(scored)
                if i % 50 == 49:
                    bar.set_postfix(loss=f"{loss_sum.item() / seen:.4f}", acc=f"{correct.item() / seen:.4f}")
            bar.close()
            mean_loss = loss_sum.item() / max(seen, 1)
            if not math.isfinite(mean_loss):
                raise TrainingError(f"{desc}: the training loss became {mean_loss} at epoch {epoch}; lower the learning rate")
            row = {
                "stage": desc,
                "epoch": epoch,
                "loss": mean_loss,
                "train_acc": correct.item() / max(seen, 1),
                "lr": optimizer.param_groups[0]["lr"],
                "time_s": time.perf_counter() - started,
            }
            scheduler.step()
            history.append(row)
            callback = on_epoch or self.on_epoch
            if callback is not None:
                callback(row)
        return history

    @torch.no_grad()
    def predict(self, model: nn.Module, images: Tensor, transform: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """Predicted labels (on the CPU) for uint8 images, optionally passed through `transform`
        (e.g. an attack's `apply_trigger`) after conversion to [0, 1]."""
        model = self.prepare(model)
        model.eval()
        out = []
        for start in range(0, len(images), self.eval_batch_size):
            x = to_float(images[start : start + self.eval_batch_size].to(self.device))
            if transform is not None:
                x = transform(x)
            with self._autocast():
                out.append(model(x.contiguous(memory_format=self.memory_format)).argmax(1))
        return torch.cat(out).cpu() if out else torch.empty(0, dtype=torch.long)
