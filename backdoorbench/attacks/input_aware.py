"""Input-aware dynamic backdoor: a generator makes a different trigger for every input."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks, distributed
from backdoorbench.attacks import input_aware_nets as nets
from backdoorbench.attacks.base import StepWrapper, TrainingAttack
from backdoorbench.attacks.input_aware_nets import CrossPlan, diversity_loss, mask_norm_loss
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.errors import ConfigError, DataError
from backdoorbench.precision import precision_context
from backdoorbench.progress import track

log = logging.getLogger(__name__)


class InputAware(TrainingAttack):
    """Input-aware dynamic backdoor (Nguyen & Tran, "Input-Aware Dynamic Backdoor Attack",
    NeurIPS 2020).

    A pattern generator p and a mask generator m make each input's own trigger,
    x + m(x) * (p(x) - x). The mask generator is first trained alone (in `prepare`) to a sparse
    mask (norm loss towards `mask_density`) that differs between inputs (diversity loss), then
    frozen. Its diversity loss measures image distances on normalised images, in the official
    code's normalisation of the dataset (`diversity_std`, default `official`: backdoorbench/units.py
    INPUT_AWARE_STD; CIFAR-10's std ~0.25 makes it weigh ~4x what [0, 1] pixels would, MNIST's
    [-1, 1] 2x, GTSRB's raw pixels 1x); the joint training's diversity loss normalises images and
    patterns alike, as the official code does. While the victim trains, in every batch a `poison_rate` (the paper's rho_b) fraction
    carries its own trigger and the target label, a `cross_rate` (rho_c) fraction carries the
    trigger made from ANOTHER image and keeps its label (so a trigger works only on the input
    it was made for), and the pattern generator is trained with its own Adam optimizer on the
    classification loss plus `lambda_div` times the diversity loss. Defaults are the paper's.

    As the official train.py: the pattern generator's gradient is never zeroed during the joint
    training (only the classifier's is, `optimizerC.zero_grad()`), so its Adam steps on the running
    sum of every batch's gradient so far (`sum_generator_grads`, default true; false zeroes it
    after each step, which on mnist5k in 10 victim epochs planted the backdoor far faster:
    docs/fidelity.md#input-aware); the batch's attack and cross counts are
    int(rate * batch), floored; and the epoch count includes the mask pre-training
    (`epochs_include_mask`, default true): `trainer.epochs` plays the official `n_iters` (600, of
    which 25 pre-train the mask), the victim trains `trainer.epochs - mask_epochs` joint epochs
    (at least one, as the official loop), and the generator's and classifier's learning-rate
    schedules run against `trainer.epochs`, one step per joint epoch, as the official
    MultiStepLRs do (the generator's milestones [200, 300, 400, 500] of 600 are our fractions
    [1/3, 1/2, 2/3, 5/6]; a cosine with `trainer.schedule_period` keeps that period).
    `epochs_include_mask: false` trains `trainer.epochs` joint epochs after the pre-training.

    Precision: both generators compute in fp32 (autocast off, no TF32) wherever they run: in the
    training step, inside the run's autocast, and at test, where `Trainer.predict` applies the
    trigger outside it. Under bf16 the triggers of training and test would otherwise differ (the
    official code trains in fp32); the classifier still sees them in the run's precision.

    Departures from the official code: cross-trigger source images are other rows of the same
    batch (the official code draws them from a second shuffled loader); the mask generator's
    milestones are fractions of its pre-training (official: epochs [10, 20], the same at 25); the
    generators see [0, 1] images rather than normalized ones (their first batch norm absorbs the
    affine change) and the pattern lives in [0, 1] pixels (the diversity loss still measures in
    the official normalisation, see above); each call of `train_victim` restarts the pattern
    generator from its seeded initialization (and a zero gradient), so a defense that retrains a
    victim repeats the whole attack.

    Training budget: the cross-trigger rows are what take long to learn (the classifier must check
    that a trigger belongs to its image). On mnist5k with mnist_cnn (4,000 training images, 32
    steps an epoch: 200 epochs are ~6,400 steps, the paper's 600 MNIST epochs ~280k), 10 epochs of
    the default trainer give 36% ASR (93% with cross_rate=0). The paper's 25 mask pre-training
    epochs matter: with 4 (this class's default until Dec 2026) seed 2 reached 79.9% after 100
    unaugmented epochs and 83.2% after 200; with 25, 87.4% and 92.1%. With 25 mask epochs and 200
    unaugmented epochs, seeds 0 / 1 / 2 reach 97.9 / 92.6 / 92.1% (all2one) and, at rho_b = 0.2,
    96.7 / 91.4 / 92.0% (all2all), CA within 0.6 points of the clean control (these numbers predate the
    normalised diversity loss, which on mnist5k doubles the mask pre-training's diversity term; all of
    this paragraph's predate the official epoch count, summed gradient and floored counts: they trained
    `trainer.epochs` victim epochs after the mask, on per-step gradients). The committed table
    (results/README.md) states the epochs of each row.

    Exported set (for ABL, AC, spectral): as BackdoorBench's attack/inputaware.py saves, one pass of
    the final generators over the unaugmented training split, batches poisoned as in training (see
    `export_batch`; seeded rows of a seeded shuffle, BackdoorBench: the first rows in stored order).

    Augmentation: the trainer's, on the batch before the triggers are stamped (the official code augments in its
    loader, so its triggers are made from augmented images too), and in mask pre-training; the paper presets set
    the official crop and rotation (docs/fidelity.md#input-aware)."""

    name = "input_aware"
    family = "generative"
    learned_trigger = True
    exports_poisoned_set = True
    aliases = ("iad", "ia", "inputaware")

    def __init__(
        self,
        *,
        cross_rate: float = 0.1,
        lambda_div: float = 1.0,
        lambda_norm: float = 100.0,
        mask_density: float = 0.032,
        mask_epochs: int = 25,
        generator_lr: float = 0.01,
        mask_lr: float = 0.01,
        generator_milestones: tuple[float, ...] = (1 / 3, 1 / 2, 2 / 3, 5 / 6),
        mask_milestones: tuple[float, ...] = (0.4, 0.8),
        lr_gamma: float = 0.1,
        channels: int | None = None,
        depth: int | None = None,
        diversity_std: str | float | Sequence[float] | None = "official",
        epochs_include_mask: bool = True,
        sum_generator_grads: bool = True,
        seed: int = 0,
        **common,
    ) -> None:
        super().__init__(**common)
        image_channels, height, width = self.image_shape
        self.diversity_std = nets.resolve_diversity_std(diversity_std, self.dataset, image_channels)
        checks.number("attack", "cross_rate", cross_rate, 0, 1)
        if self.poison_rate + cross_rate > 1:
            raise ConfigError(
                f"attack.cross_rate={cross_rate!r} with poison_rate={self.poison_rate} exceeds the batch; "
                f"use cross_rate <= {1 - self.poison_rate:.4g}"
            )
        for key, value in (("lambda_div", lambda_div), ("lambda_norm", lambda_norm)):
            checks.number("attack", key, value, 0)
        checks.number("attack", "mask_density", mask_density, 0, 1, low_open=True)
        for key, value in (("generator_lr", generator_lr), ("mask_lr", mask_lr), ("lr_gamma", lr_gamma)):
            checks.number("attack", key, value, 0, low_open=True)
        checks.integer("attack", "mask_epochs", mask_epochs, 0, hint="the paper uses 25")
        if not isinstance(epochs_include_mask, bool):
            raise ConfigError(f"attack.epochs_include_mask={epochs_include_mask!r} is invalid; use true (trainer.epochs "
                              f"counts the mask pre-training, as the official n_iters) or false")
        if not isinstance(sum_generator_grads, bool):
            raise ConfigError(f"attack.sum_generator_grads={sum_generator_grads!r} is invalid; use true (the official "
                              f"never-zeroed gradient) or false (each batch's own)")
        for key, milestones in (("generator_milestones", generator_milestones), ("mask_milestones", mask_milestones)):
            if not isinstance(milestones, Sequence) or isinstance(milestones, str) or any(
                not checks.is_number(m) or not 0 < m <= 1 for m in milestones
            ):
                shown = list(milestones) if isinstance(milestones, Sequence) else milestones
                raise ConfigError(
                    f"attack.{key}={shown!r} is invalid; use a list of fractions of the training in (0, 1]"
                )
        if depth is None:  # the official nets: 3 stages for 32 px images, 2 for MNIST's 28 px
            depth = 3 if height % 8 == 0 and width % 8 == 0 else 2
        if not checks.is_integer(depth) or depth < 1 or height % 2**depth or width % 2**depth:
            raise ConfigError(
                f"attack.depth={depth!r} does not fit {height}x{width} images; use an integer >= 1 with "
                f"height and width divisible by 2**depth"
            )
        if channels is None:  # the official widths: 16 for MNIST, 32 for color images
            channels = 16 if image_channels == 1 else 32
        checks.integer("attack", "channels", channels, 1)
        self.cross_rate = float(cross_rate)
        self.lambda_div = float(lambda_div)
        self.lambda_norm = float(lambda_norm)
        self.mask_density = float(mask_density)
        self.mask_epochs = mask_epochs
        self.epochs_include_mask = epochs_include_mask
        self.sum_generator_grads = sum_generator_grads
        self.generator_lr = float(generator_lr)
        self.mask_lr = float(mask_lr)
        self.generator_milestones = tuple(float(m) for m in generator_milestones)
        self.mask_milestones = tuple(float(m) for m in mask_milestones)
        self.lr_gamma = float(lr_gamma)
        self.seed = seed
        self.pattern_generator = nets.seeded(
            seed, lambda: nets.TriggerGenerator(image_channels, image_channels, channels, depth)
        )
        self.mask_generator = nets.seeded(seed + 1, lambda: nets.TriggerGenerator(image_channels, 1, channels, depth))
        self._initial_pattern_state = copy.deepcopy(self.pattern_generator.state_dict())
        self.mask_ready = False
        self.mask_history: list[dict[str, Any]] = []  # one row per mask pre-training epoch
        # Per-batch choices; reseeded from the training generator in train_victim.
        self.batch_generator = torch.Generator().manual_seed(seed + 2)
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending_update = False
        self._steps_done = 0
        self._steps_per_epoch = 1  # joint-training batches per epoch
        self._schedule_epochs = 1  # the epochs the generator's milestones are fractions of

    def _std_tensor(self) -> Tensor | None:
        return torch.tensor(self.diversity_std) if self.diversity_std is not None else None

    # ---------------------------------------------------------------- triggers

    def _nets_to(self, device: torch.device) -> None:
        if next(self.pattern_generator.parameters()).device != device:
            self.pattern_generator.to(device)
            self.mask_generator.to(device)

    def masks(self, x: Tensor) -> Tensor:
        """The thresholded masks (B, 1, H, W) in [0, 1] of inputs x, computed in fp32."""
        with precision_context(x.device.type, "fp32"):
            return nets.threshold_mask(self.mask_generator(x.float()))

    def patterns(self, x: Tensor) -> Tensor:
        """The patterns (B, C, H, W) in [0, 1] of inputs x, computed in fp32 (autocast off, no
        TF32), so training (inside the run's autocast) and test (outside it) stamp the same trigger."""
        with precision_context(x.device.type, "fp32"):
            return self.pattern_generator(x.float())

    @torch.no_grad()
    def apply_cross(self, x: Tensor, sources: Tensor) -> Tensor:
        """Stamp on each x the trigger generated from the matching image of `sources`."""
        self._nets_to(x.device)
        self.pattern_generator.eval()
        self.mask_generator.eval()
        return nets.blend(x.float(), self.patterns(sources), self.masks(sources)).to(x.dtype)

    def apply_trigger(self, x: Tensor) -> Tensor:
        return self.apply_cross(x, x)

    # ------------------------------------------------------ mask pre-training

    def prepare(self, *, trainer, train: Split, generator: torch.Generator, build_model=None) -> None:
        """Train the mask generator alone (norm + diversity losses), then freeze it."""
        from backdoorbench.train import augment_batch

        device = trainer.device
        self._nets_to(device)
        net = self.mask_generator.train().requires_grad_(True)
        optimizer = torch.optim.Adam(net.parameters(), lr=self.mask_lr, betas=(0.5, 0.9))
        images = train.images.to(device)
        batch = trainer.batch_size
        std = self._std_tensor()
        self.mask_history = []
        for epoch in track(range(self.mask_epochs), "input_aware: mask generator pre-training", unit="epochs"):
            lr = self.mask_lr * self.lr_gamma ** sum(epoch / self.mask_epochs >= m for m in self.mask_milestones)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # Two independent orders pair every image with a random other one, as the paper's
            # two loaders do.
            first = torch.randperm(len(train), generator=generator).to(device)
            second = torch.randperm(len(train), generator=generator).to(device)
            # Summed on the device: reading a loss every step would sync the GPU.
            norm_sum = torch.zeros((), device=device)
            div_sum = torch.zeros((), device=device)
            steps = 0
            started = time.perf_counter()
            for start in range(0, len(train), batch):
                x1 = to_float(images[first[start : start + batch]])
                x2 = to_float(images[second[start : start + batch]])
                if trainer.augment:
                    augment = (generator, trainer.crop_padding, trainer.hflip, getattr(trainer, "rotation", 0.0),
                               getattr(trainer, "rotation_p", 0.5))
                    x1, x2 = augment_batch(x1, *augment), augment_batch(x2, *augment)
                m1, m2 = self.masks(x1), self.masks(x2)
                norm = mask_norm_loss(m1, self.mask_density)
                # Images normalised, masks not: as the official train_mask_step.
                div = diversity_loss(x1, x2, m1, m2, image_std=std)
                loss = self.lambda_norm * norm + self.lambda_div * div
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                norm_sum += norm.detach()
                div_sum += div.detach()
                steps += 1
            norm_mean, div_mean = norm_sum.item() / max(steps, 1), div_sum.item() / max(steps, 1)
            loss_mean = self.lambda_norm * norm_mean + self.lambda_div * div_mean
            row = {"stage": "mask", "epoch": epoch + 1, "loss": loss_mean, "norm": norm_mean, "div": div_mean,
                   "lr": lr, "time_s": time.perf_counter() - started}
            self.mask_history.append(row)
            log.info("input_aware mask epoch %d/%d: norm %.4f, diversity %.4f", epoch + 1, self.mask_epochs,
                     norm_mean, div_mean)
            if getattr(trainer, "on_epoch", None) is not None:
                trainer.on_epoch(row)  # the run's logger, beside the victim's epochs
        net.eval().requires_grad_(False)
        self.mask_ready = True

    # --------------------------------------------------------- joint training

    def plan_batch(self, batch_size: int, generator: torch.Generator | None = None) -> CrossPlan:
        """This batch's attack rows, cross rows and sources (nets.plan_cross_batch), default `batch_generator`."""
        generator = self.batch_generator if generator is None else generator
        return nets.plan_cross_batch(batch_size, self.poison_rate, self.cross_rate, generator)

    @torch.no_grad()
    def export_batch(self, x: Tensor, y: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The final generators in eval mode: attack rows get their own trigger and the target label,
        cross rows another image's trigger and keep their label (the cover), as BackdoorBench's export."""
        self._nets_to(x.device)
        self.pattern_generator.eval()
        self.mask_generator.eval()
        plan = self.plan_batch(len(y), generator)
        images, labels, _ = self.poison_batch(x, y, plan)
        return images, labels, plan.attack, plan.cross

    def poison_batch(self, x: Tensor, y: Tensor, plan: CrossPlan) -> tuple[Tensor, Tensor, Tensor]:
        """Apply `plan` with the generators in their current mode; returns images, labels and
        the diversity loss of the attack triggers against the cross-source triggers."""
        attack, cross, sources = (t.to(x.device) for t in (plan.attack, plan.cross, plan.sources))
        images, labels = x.clone(), y.clone()
        labels[attack] = self.target_rule(y[attack])
        if len(attack) + len(cross) == 0:
            return images, labels, x.new_zeros(())
        makers = torch.cat([x[attack], x[sources]])  # the images whose triggers are generated
        patterns = self.patterns(makers)  # fp32, as apply_trigger's at test
        with torch.no_grad():
            masks = self.masks(makers)  # frozen after pre-training
        n = len(attack)
        # .to(dtype): the images keep the batch's dtype.
        images[attack] = nets.blend(x[attack], patterns[:n], masks[:n]).to(images.dtype)
        images[cross] = nets.blend(x[cross], patterns[n:], masks[n:]).to(images.dtype)
        # The paper pairs the i-th attack image with the i-th cross source; without cross rows,
        # attack images are paired among themselves.
        pairs = min(n, len(cross))
        std = self._std_tensor()  # images and patterns both normalised, as the official train_step
        if pairs:
            div = diversity_loss(x[attack[:pairs]], x[sources[:pairs]], patterns[:pairs], patterns[n : n + pairs],
                                 image_std=std, output_std=std)
        elif n >= 2:
            div = diversity_loss(x[attack], x[attack.roll(1)], patterns[:n], patterns[:n].roll(1, dims=0),
                                 image_std=std, output_std=std)
        else:
            div = x.new_zeros(())
        return images, labels, div

    def _start_joint_training(self, steps_per_epoch: int = 1, schedule_epochs: int = 1) -> None:
        """A fresh pattern generator, zero gradient and Adam; its lr milestones are fractions of
        `schedule_epochs` epochs of `steps_per_epoch` batches."""
        self.pattern_generator.load_state_dict(self._initial_pattern_state)
        self.pattern_generator.requires_grad_(True)
        for param in self.pattern_generator.parameters():
            param.grad = None
        self._optimizer = torch.optim.Adam(self.pattern_generator.parameters(), lr=self.generator_lr, betas=(0.5, 0.9))
        self._pending_update = False
        self._steps_done = 0
        self._steps_per_epoch = max(int(steps_per_epoch), 1)
        self._schedule_epochs = max(int(schedule_epochs), 1)

    def generator_lr_at(self, epoch: int) -> float:
        """The pattern generator's lr in joint epoch `epoch` (0-based), stepped once an epoch as the
        official MultiStepLR: x lr_gamma at each milestone (a fraction of the schedule's epochs)."""
        progress = epoch / self._schedule_epochs
        return self.generator_lr * self.lr_gamma ** sum(progress >= m - 1e-9 for m in self.generator_milestones)

    def joint_epochs(self, epochs: int) -> int:
        """The victim's epochs when the run has `epochs`: with `epochs_include_mask` the official
        count (train.py: n_iters counts the 25 mask epochs, and the joint loop runs at least once)."""
        if not self.epochs_include_mask:
            return epochs
        return max(epochs - self.mask_epochs, min(epochs, 1))

    def _update_generator(self) -> None:
        """Step the pattern generator on the gradient the trainer's backward accumulated on it.

        The trainer steps only the classifier's optimizer, so the generator's step is taken here,
        before the next batch's forward pass, with its own Adam and schedule. The gradient is not
        zeroed (`sum_generator_grads`): as in the official train_step (`optimizerC.zero_grad()`
        only, then `optimizerG.step()`), each step sees the sum of every batch's gradient so far;
        with `sum_generator_grads: false` it is zeroed after each step.
        """
        if not self._pending_update or self._optimizer is None:
            return
        lr = self.generator_lr_at(self._steps_done // self._steps_per_epoch)
        for group in self._optimizer.param_groups:
            group["lr"] = lr
        # Under torchrun each process saw its own share of the batch: average, as DDP does for f
        # (the sum so far is the same on every process, so the average adds the mean new gradient).
        distributed.average_gradients(self.pattern_generator.parameters())
        self._optimizer.step()
        if not self.sum_generator_grads:
            self._optimizer.zero_grad(set_to_none=True)
        self._pending_update = False
        self._steps_done += 1

    def training_step(self, model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self._optimizer is None:
            self._start_joint_training()
        self._nets_to(x.device)
        self._update_generator()
        self.pattern_generator.train()
        self.mask_generator.eval()
        images, labels, div = self.poison_batch(x, y, self.plan_batch(len(y)))
        logits = model(images)
        self._pending_update = True
        return F.cross_entropy(logits, labels) + self.lambda_div * div, logits, labels

    def train_victim(
        self, trainer, model: nn.Module, train: Split, generator: torch.Generator, wrap_step: StepWrapper | None = None,
        checkpoint: str | Path | None = None,
    ) -> None:
        if not self.mask_ready:
            raise RuntimeError("InputAware.prepare() must pre-train the mask generator before train_victim()")
        from backdoorbench.train import batch_bounds

        self.batch_generator = torch.Generator().manual_seed(int(torch.randint(2**62, (), generator=generator)))
        joint = self._joint_trainer(trainer)
        steps = len(batch_bounds(len(train), trainer.batch_size, min_last=2 * distributed.world_size()))
        self._start_joint_training(steps_per_epoch=steps,
                                   schedule_epochs=trainer.epochs if self.epochs_include_mask else joint.epochs)
        self._nets_to(trainer.device)
        super().train_victim(joint, model, train, generator, wrap_step=wrap_step, checkpoint=checkpoint)
        self._update_generator()  # the last batch's step
        for param in self.pattern_generator.parameters():
            param.grad = None  # the summed gradient is spent
        distributed.broadcast_state(self.pattern_generator)  # under torchrun: rank 0's batch-norm statistics
        self.pattern_generator.eval()
        self._optimizer = None

    def _joint_trainer(self, trainer):
        """`trainer`, or with `epochs_include_mask` a copy that trains the official joint epochs
        (`joint_epochs`) on the schedule of the whole `trainer.epochs`: the classifier's lr in joint
        epoch e is the one epoch e of a trainer.epochs run has, as the official schedulerC
        (milestones in joint epochs against n_iters) and BackdoorBench's cosine give."""
        total = trainer.epochs
        epochs = self.joint_epochs(total)
        if epochs == total:
            return trainer
        if total <= self.mask_epochs:
            log.warning("input_aware: trainer.epochs=%d counts the %d mask pre-training epochs (the official n_iters "
                        "does), which leaves %d victim epoch(s); use trainer.epochs > %d, or "
                        "attack.epochs_include_mask=false for trainer.epochs victim epochs after the mask",
                        total, self.mask_epochs, epochs, self.mask_epochs)
        view = copy.copy(trainer)
        view.epochs = epochs
        # Trainer.fit takes the factor of epoch e as schedule(e / period), period its epochs unless a
        # cosine names trainer.schedule_period; rescale so that it stays schedule(e / total).
        if trainer.schedule is not None and not (trainer.schedule_name == "cosine" and trainer.schedule_period):
            schedule = trainer.schedule
            # fit passes e / epochs for whole e: round back to e, so no milestone moves by a rounding
            view.schedule = lambda fraction: schedule(round(fraction * epochs) / total)
        return view

    def describe(self) -> dict:
        return {**super().describe(), "diversity_std": list(self.diversity_std) if self.diversity_std else None}

    # ------------------------------------------------------------------ state

    def training_state(self) -> dict[str, Any]:
        # The summed gradient is on the pattern generator (the last batch's step is taken before
        # the next batch's forward), so it is saved too; the mask generator is frozen by then.
        params = list(self.pattern_generator.parameters())
        return {
            "pattern_generator": {k: v.detach().cpu().clone() for k, v in self.pattern_generator.state_dict().items()},
            "grads": [None if p.grad is None else p.grad.detach().cpu().clone() for p in params],
            "optimizer": self._optimizer.state_dict() if self._optimizer is not None else None,
            "pending_update": self._pending_update,
            "steps_done": self._steps_done,
            "steps_per_epoch": self._steps_per_epoch,
            "schedule_epochs": self._schedule_epochs,
            "batch_generator": self.batch_generator.get_state(),
        }

    def load_training_state(self, state: dict[str, Any]) -> None:
        self.pattern_generator.load_state_dict(state["pattern_generator"])
        params = list(self.pattern_generator.parameters())
        if len(state["grads"]) != len(params):
            raise ValueError(f"{len(state['grads'])} generator gradients saved, the generator has {len(params)}")
        for param, grad in zip(params, state["grads"]):
            param.grad = None if grad is None else grad.to(param.device)
        if state["optimizer"] is not None and self._optimizer is not None:
            self._optimizer.load_state_dict(state["optimizer"])
        self._pending_update = bool(state["pending_update"])
        self._steps_done = int(state["steps_done"])
        self._steps_per_epoch = int(state.get("steps_per_epoch", self._steps_per_epoch))
        self._schedule_epochs = int(state.get("schedule_epochs", self._schedule_epochs))
        self.batch_generator.set_state(state["batch_generator"])

    def prepare_state(self) -> dict[str, Any]:
        """The pre-trained mask generator and its epoch rows (the logger shows them again)."""
        return {"mask_generator": {k: v.detach().cpu().clone() for k, v in self.mask_generator.state_dict().items()},
                "history": list(self.mask_history)}

    def load_prepare_state(self, state: dict[str, Any]) -> None:
        try:
            self.mask_generator.load_state_dict(state["mask_generator"])
        except (KeyError, RuntimeError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DataError(f"input_aware's saved mask generator does not fit this attack's: {first}") from None
        self.mask_history = list(state.get("history", []))
        self.mask_generator.eval().requires_grad_(False)
        self.mask_ready = True

    def state_dict(self) -> dict[str, Any]:
        def cpu(net: nn.Module) -> dict[str, Tensor]:
            return {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}

        return {"pattern_generator": cpu(self.pattern_generator), "mask_generator": cpu(self.mask_generator)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("pattern_generator", "mask_generator"):
            net = getattr(self, key)
            try:
                net.load_state_dict(state[key])
            except (KeyError, RuntimeError, TypeError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise DataError(
                    f"input_aware state {key!r} does not fit this attack's generator "
                    f"(check attack.channels / attack.depth): {first}"
                ) from None
        self.mask_generator.eval().requires_grad_(False)
        self.mask_ready = True
