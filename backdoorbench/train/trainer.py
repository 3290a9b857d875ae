"""The one trainer every attack and defense uses: data on the device, batched augmentation, hooks.

The whole training split lives on the training device as one uint8 tensor; each step indexes a
batch, augments it with tensor ops (random crop with zero padding, horizontal flip where the
dataset allows it, and random rotation when `rotation` > 0) and converts it to [0, 1] floats. A
training-controlled attack whose official code augments after poisoning (WaNet) passes a `poison`
hook: the batch is poisoned first, un-augmented, then augmented the same way. The epoch's shuffle
and augmentation draws are made once per epoch on the CPU generator and moved to the device in one
copy, and metrics are summed on the device, so the loop waits for the GPU only when a progress bar
reads them (about eight times an epoch, on a terminal). Each epoch ends with one log line (loss, accuracy,
lr, time) for the terminal and Hydra's log file, and one row for the run's logger (CSV, wandb).
Training-time attacks and in-training defenses replace the per-batch loss through the `step`
hook. `fit(..., checkpoint=path)` saves after every epoch and resumes from that file, bit-exactly
on the CPU.

Under torchrun (backdoorbench.distributed) `fit` is data-parallel with global batch semantics:
`batch_size` is the batch of the whole step, as in one process. Every process draws the same
seeded permutation and augmentation, takes its own contiguous share of each batch (sizes differ
by at most one), and runs the step inside a DistributedDataParallel module, which averages the
gradients; the loss is weighted by the share's size, so the averaged gradient is that of the
whole batch's mean loss. What differs from one process: batch norm sees each process's share
only (no SyncBatchNorm), dropout masks are drawn per share (every process from the same global
seed), and sums run in another order.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks, distributed, progress
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.errors import ConfigError, UserError
from backdoorbench.precision import precision_context, resolve_precision
from backdoorbench.train.augment import apply_augmentation, draw_augmentation, draw_rotation, rotate
from backdoorbench.train.batches import batch_bounds, refresh_every, shard_bounds, to_device
from backdoorbench.train.checkpoint import load_checkpoint, save_checkpoint
from backdoorbench.train.passes import epoch_done

log = logging.getLogger("backdoorbench.train")  # the name it had as one module: log configs use it

# A step maps (model, augmented images in [0, 1], labels) to (loss, logits, labels scored).
StepFn = Callable[[nn.Module, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
EpochCallback = Callable[[dict[str, Any]], None]


class TrainingError(UserError):
    """Training cannot go on (e.g. the loss became NaN); the message says at which epoch."""


def resolve_device(device: str) -> torch.device:
    """`auto` picks CUDA when present, else the CPU; anything else is passed to torch. Under
    torchrun, CUDA means this process's GPU (cuda:LOCAL_RANK)."""
    if device == "auto":
        return distributed.local_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"device={device!r} is not a device; use auto, cpu, cuda or cuda:N") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} asked for CUDA but no GPU is visible; use device=auto or cpu")
    return distributed.local_device(resolved)


def cross_entropy_step(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    logits = model(x)
    return F.cross_entropy(logits, y), logits, y


class _StepModule(nn.Module):
    """The model, the step and the extra trained tensors as one module, for DistributedDataParallel.

    DDP only averages the gradients of what runs inside its forward. A step may call the model
    more than once, call its parts (`model.features`), or differentiate through it on the side
    (LIRA's look-ahead); wrapping the whole step keeps all of that inside one DDP forward, and
    the step still gets the plain model, with all its attributes.
    """

    _backdoorbench_transparent = True  # train/passes.py counts the networks the step calls, not this wrapper

    def __init__(self, net: nn.Module, step: StepFn, extra_params: list[nn.Parameter]) -> None:
        super().__init__()
        self.net = net
        self.extra = nn.ParameterList(extra_params)
        self.step = step

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.step(self.net, x, y)


def _cosine(progress: float, milestones, gamma) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _multistep(progress: float, milestones, gamma) -> float:
    return gamma ** sum(progress >= m for m in milestones)


def _constant(progress: float, milestones, gamma) -> float:
    return 1.0


# plateau: ReduceLROnPlateau on the epoch's mean training loss (BackdoorBench's Tiny-ImageNet recipe),
# a factor that depends on the losses, so it has no function of the progress here.
SCHEDULES = {"cosine": _cosine, "multistep": _multistep, "constant": _constant, "plateau": None}


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
        schedule_period: int | None = None,
        plateau_patience: int = 10,
        augment: bool = True,
        crop_padding: int = 0,
        hflip: bool = False,
        precision: str = "auto",
        min_precision: str = "bf16",
        rotation: float = 0.0,
        rotation_p: float = 0.5,
        channels_last: bool = True,
        compile: bool = False,
        progress: bool = True,
        device: str | torch.device = "cpu",
    ) -> None:
        checks.integer("trainer", "epochs", epochs, 0)
        for key, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            checks.integer("trainer", key, value, 1)
        if schedule not in SCHEDULES:
            raise ConfigError(f"trainer.schedule={schedule!r} is unknown; choose one of: {', '.join(SCHEDULES)}")
        if schedule_period is not None:
            checks.integer("trainer", "schedule_period", schedule_period, 1,
                           hint="epochs of the cosine's half period (CosineAnnealingLR's T_max); null = the run's epochs")
        checks.integer("trainer", "plateau_patience", plateau_patience, 0, hint="epochs without a lower loss")
        checks.integer("", "crop_padding", crop_padding, 0)  # the dataset's, passed in by the pipeline
        checks.number("trainer", "rotation", rotation, 0, 180, hint="degrees; 0 = off, the WaNet/IAD/LIRA code uses 10")
        checks.number("trainer", "rotation_p", rotation_p, 0, 1, hint="the share of images rotated")
        self.epochs = epochs
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.optimizer = optimizer
        self.schedule_name = schedule
        self.schedule = partial(SCHEDULES[schedule], milestones=tuple(milestones), gamma=gamma) if SCHEDULES[schedule] else None
        self.gamma = gamma
        self.schedule_period = schedule_period
        self.plateau_patience = plateau_patience
        self.augment = augment
        self.crop_padding = crop_padding
        self.hflip = hflip
        self.rotation = float(rotation)
        self.rotation_p = float(rotation_p)
        self.device = resolve_device(device) if isinstance(device, str) else distributed.local_device(device)
        on_cuda = self.device.type == "cuda"
        # One precision for every forward pass of the run (training, evaluation, defenses);
        # `min_precision` is the attack's (backdoorbench/precision.py).
        self.precision = resolve_precision(precision, self.device.type, min_precision)
        # channels_last on CUDA only. On the CPU it made mnist_cnn ~20% faster per step, but torch
        # 2.14's CPU backward aborted the process (SIGABRT, no Python error) for Input-aware's
        # generators with resnet18 at 64 px (tests/test_presets.py); the CPU stays contiguous.
        self.memory_format = torch.channels_last if channels_last and on_cuda else torch.contiguous_format
        # Allowed on the CPU too (inductor needs a C++ compiler there), but only asked for on CUDA.
        self.compile = bool(compile)
        self.progress = progress
        self.on_epoch: EpochCallback | None = None  # default per-epoch callback (the run's logger)
        # Batches in a new random order every epoch; a recipe that keeps the split's own order (ABL's
        # isolation loader, `shuffle=False`) turns it off on its copy of the trainer.
        self.shuffle = True
        distributed.init_from_env(self.device)  # under torchrun: join the process group once

    def prepare(self, model: nn.Module) -> nn.Module:
        return model.to(self.device, memory_format=self.memory_format)

    def autocast(self):
        """The run's precision as a context: every forward pass of training, evaluation and the
        defenses runs inside it, so a trigger reaches the model alike in all of them."""
        return precision_context(self.device.type, self.precision)

    def _compiled(self, model: nn.Module) -> nn.Module:
        """`model` itself, or a torch.compile wrapper sharing its parameters (`trainer.compile`).
        The wrapper is never returned to the caller, so state dicts keep their plain keys."""
        return torch.compile(model) if self.compile else model

    def _data_parallel(self, net: nn.Module, step: StepFn, extra: list[nn.Parameter]) -> Callable:
        """(x, y) -> step(net, x, y), inside DistributedDataParallel under torchrun (which first
        copies rank 0's weights to every process); the plain step in one process."""
        if not distributed.active():
            return partial(step, net)
        from torch.nn.parallel import DistributedDataParallel

        # find_unused_parameters: a step may leave some parameters out of its loss (a frozen
        # branch, a head it does not use); DDP would otherwise wait for their gradients forever.
        return DistributedDataParallel(_StepModule(net, step, extra),
                                       device_ids=[self.device.index] if self.device.type == "cuda" else None,
                                       find_unused_parameters=True)

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
        checkpoint: str | Path | None = None,
        companion: Any = None,
        poison: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
    ) -> list[dict[str, Any]]:
        """Train `model` on `split`; returns one dict per epoch (loss, accuracy, lr, seconds).

        `generator` (a CPU generator) drives shuffling and augmentation, so runs are seeded.
        `step` replaces plain cross-entropy (training-time attacks, in-training defenses).
        `checkpoint`: a file written (atomically) after every epoch with the model, optimizer,
        schedule, generator and global RNG states; if it exists when fit starts, training goes
        on from the epoch after it, ending exactly where an uninterrupted fit would (bit-exact
        on the CPU). State a `step` keeps outside the model (a trigger generator, its optimizer,
        the attack's own random stream) is saved with it when `companion` is given: an object
        with `training_state() -> dict` and `load_training_state(dict)`. Epochs restored from it are passed to `on_epoch` once more, at
        the start, because the process that logged them first is gone (a killed run's logger never
        wrote them), so the resumed run's log holds every epoch.
        `poison`: (x, y) -> (x, y), applied to each batch as un-augmented [0, 1] images before the
        augmentation (then done on floats, with the same draws); `step` gets the augmented poisoned
        batch. For an attack whose official code poisons first and augments after (WaNet).
        """
        # trainer.schedule_period (CosineAnnealingLR's T_max) times the cosine of the trainer's own
        # fit; a fit given its own epochs (a defense's fine-tuning, a surrogate) and the multistep
        # milestones (fractions of the run) go by the fit's epochs.
        period = self.schedule_period if epochs is None and self.schedule_name == "cosine" else None
        epochs = self.epochs if epochs is None else epochs
        period = period or epochs
        world, rank = distributed.world_size(), distributed.rank()
        model = self.prepare(model)
        net = self._compiled(model)
        extra = list(extra_params or [])
        params = [p for p in model.parameters() if p.requires_grad] + extra
        optimizer = self.optimizer(params)
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        # Stepped once per epoch: the factor of epoch e (0-based) is schedule(e / period), period the
        # fit's epochs unless trainer.schedule_period says otherwise; plateau steps on the epoch's loss.
        if self.schedule is None:
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=self.gamma,
                                                                   patience=self.plateau_patience)
        else:
            schedule = self.schedule
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: schedule(e / max(period, 1)))
        history: list[dict[str, Any]] = []
        meta = {"desc": desc, "epochs": epochs, "samples": len(split), "batch_size": self.batch_size}
        if world > 1:
            meta["world_size"] = world  # a resumed data-parallel fit must keep its batch shares
            if self.batch_size < 2 * world or 0 < len(split) < 2 * world:
                raise ConfigError(f"{desc}: {world} processes need at least 2 images each per batch, but "
                                  f"trainer.batch_size={self.batch_size} and the split has {len(split)} images; "
                                  f"use trainer.batch_size >= {2 * world} or fewer processes")
        done = 0
        if checkpoint is not None:
            checkpoint = Path(checkpoint).expanduser()
            if checkpoint.exists():
                done, history = load_checkpoint(checkpoint, meta, model, optimizer, scheduler, generator, extra,
                                                companion=companion)
                log.info("%s: resumed from %s after epoch %d of %d", desc, checkpoint, done, epochs)
                replay = on_epoch or self.on_epoch
                if replay is not None:
                    for row in history:
                        replay(row)
        run_step = self._data_parallel(net, step, extra)
        images = split.images.to(self.device)
        labels = split.labels.to(self.device)
        bounds = batch_bounds(len(split), self.batch_size, min_last=2 * world)
        for epoch in range(done + 1, epochs + 1):
            model.train()
            started = time.perf_counter()
            # All of the epoch's random draws at once and one copy to the device, rather than
            # small host tensors every batch (each would be a synchronising copy on CUDA).
            order = torch.randperm(len(split), generator=generator) if self.shuffle else torch.arange(len(split))
            offsets = flips = angles = None
            if self.augment:
                offsets, flips = draw_augmentation(len(split), generator, self.crop_padding, self.hflip)
                angles = draw_rotation(len(split), generator, self.rotation, self.rotation_p)
            order, offsets, flips, angles = (to_device(t, self.device) if t is not None else None
                                             for t in (order, offsets, flips, angles))
            loss_sum = torch.zeros((), device=self.device)
            correct = torch.zeros((), device=self.device, dtype=torch.long)
            seen = 0
            bar = progress.bar(len(bounds), f"{desc} {epoch}/{epochs}", unit="batch", enabled=self.progress)
            lr_now = optimizer.param_groups[0]["lr"]
            for i, (batch_start, batch_stop) in enumerate(bounds):
                start, stop = shard_bounds(batch_start, batch_stop, rank, world)
                idx = order[start:stop]
                batch, y = images[idx], labels[idx]
                crop_flip = partial(apply_augmentation,
                                    offsets=offsets[start:stop] if offsets is not None else None,
                                    flips=flips[start:stop] if flips is not None else None,
                                    crop_padding=self.crop_padding)
                if poison is None:
                    # Cropping and flipping the uint8 batch moves a quarter of the bytes of a float one.
                    x = to_float(crop_flip(batch) if self.augment else batch)
                else:
                    x, y = poison(to_float(batch), y)
                    x = crop_flip(x) if self.augment else x
                x = rotate(x, angles[start:stop] if angles is not None else None)
                x = x.contiguous(memory_format=self.memory_format)
                with self.autocast():
                    loss, logits, scored = run_step(x, y)
                optimizer.zero_grad(set_to_none=True)
                if world > 1 and (stop - start) * world != batch_stop - batch_start:
                    # DDP averages over processes; weighting each share's mean loss by its size
                    # makes that the mean over the whole batch when the shares are unequal.
                    (loss * ((stop - start) * world / (batch_stop - batch_start))).backward()
                else:
                    loss.backward()
                optimizer.step()
                # Metrics stay on the device; reading them only now and then avoids a sync per step.
                loss_sum += loss.detach() * len(scored)
                correct += (logits.detach().argmax(1) == scored).sum()
                seen += len(scored)
                if not bar.disable:
                    bar.update()
                    last = i + 1 == len(bounds)
                    if last or (i + 1) % refresh_every(len(bounds)) == 0:
                        bar.set_postfix({"loss": f"{loss_sum.item() / seen:.4f}", "acc": f"{correct.item() / seen:.4f}",
                                         "lr": f"{lr_now:.3g}"}, refresh=last)
            bar.close()
            if world > 1:  # the whole epoch's sums, one collective per epoch
                totals = distributed.all_reduce_sum(torch.stack([loss_sum.double(), correct.double(),
                                                                 torch.tensor(float(seen), device=self.device, dtype=torch.float64)]))
                loss_sum, correct, seen = totals[0], totals[1], int(totals[2].item())
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
            if self.schedule is None:
                scheduler.step(mean_loss)
            else:
                scheduler.step()
            history.append(row)
            epoch_done(len(split))  # the running pass counters' training images (train/passes.py)
            if distributed.is_main():
                log.info("%s epoch %d/%d: loss %.4f, acc %.4f, lr %.4g, %.1f s", desc, epoch, epochs,
                         row["loss"], row["train_acc"], row["lr"], row["time_s"])
            if checkpoint is not None and distributed.is_main():
                save_checkpoint(checkpoint, meta, epoch, model, optimizer, scheduler, generator, extra, history,
                                companion=companion)
            callback = on_epoch or self.on_epoch
            if callback is not None:
                callback(row)
        # Weights are equal after every step; batch-norm statistics are each process's own. Rank
        # 0's go to all, so whatever runs next (evaluation, a defense) is the same everywhere.
        distributed.broadcast_state(model)
        return history

    @torch.no_grad()
    def predict(self, model: nn.Module, images: Tensor, transform: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """Predicted labels (on the CPU) for uint8 images, optionally passed through `transform`
        (e.g. an attack's `apply_trigger`) after conversion to [0, 1]."""
        model = self.prepare(model)
        model.eval()
        net = self._compiled(model)
        out = []
        for start in range(0, len(images), self.eval_batch_size):
            x = to_float(to_device(images[start : start + self.eval_batch_size], self.device))
            if transform is not None:
                x = transform(x)
            with self.autocast():
                out.append(net(x.contiguous(memory_format=self.memory_format)).argmax(1))
        return torch.cat(out).cpu() if out else torch.empty(0, dtype=torch.long)
