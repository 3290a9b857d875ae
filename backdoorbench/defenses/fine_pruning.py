"""Fine-Pruning: mask the last conv stage's channels that clean data leaves dormant, then fine-tune."""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.errors import ConfigError
from backdoorbench.models.taps import conv_stage_outputs
from backdoorbench.progress import track

ACC_DROP_MODES = ("relative", "absolute")
CURVE_POINTS = 11  # test-set pruning curve for the figure: 0%, 10%, ... of max_prune_ratio (and the chosen k)


def require_clean_subset(ctx: DefenseContext, defense: str) -> None:
    """A repair that learns from clean data cannot run on an empty clean subset."""
    if len(ctx.clean_subset) == 0:
        raise ConfigError(
            f"defense {defense} needs clean data but the clean subset is empty; set defense.clean_fraction > 0"
        )


def _mask_channels(module: nn.Module, inputs, output: Tensor) -> Tensor:
    return output * module.channel_mask.view(1, -1, 1, 1).to(output.dtype)


def attach_channel_mask(module: nn.Module, channels: int, device: torch.device | str = "cpu") -> Tensor:
    """Give `module` a `channel_mask` buffer (ones) that multiplies its output channels; return it.

    A buffer plus a module-level hook survives deepcopy and moves with the model between devices;
    masked channels pass no gradient, so fine-tuning cannot revive them.
    """
    if hasattr(module, "channel_mask"):
        raise RuntimeError(f"{type(module).__name__} already has a channel mask")
    module.register_buffer("channel_mask", torch.ones(channels, device=device))
    module.register_forward_hook(_mask_channels)
    return module.channel_mask


@torch.no_grad()
def mean_channel_activation(model: nn.Module, layer: nn.Module, images: Tensor, device: torch.device,
                            batch_size: int = 1024) -> Tensor:
    """Mean over images and positions of each output channel of `layer`, for uint8 `images`."""
    total: list[Tensor] = []

    def hook(module, inputs, output: Tensor) -> None:
        total.append(output.float().mean(dim=(2, 3)).sum(0))

    handle = layer.register_forward_hook(hook)
    try:
        model.eval()
        for start in range(0, len(images), batch_size):
            model(to_float(images[start : start + batch_size].to(device)))
    finally:
        handle.remove()
    return (torch.stack(total).sum(0) / len(images)).cpu()


def prune_last_stage(model: nn.Module, channels: list[int], probe: Tensor) -> nn.Module:
    """A copy of `model` with `channels` of its last conv stage masked, e.g. to redraw a record's
    pruning curve (its `channel_order`) on test data: CA and ASR against the pruned fraction."""
    pruned = copy.deepcopy(model)
    device = probe.device
    _, layer = conv_stage_outputs(pruned.to(device), probe)[-1]
    with torch.no_grad():
        out = layer_output_channels(pruned, layer, probe)
    mask = attach_channel_mask(layer, out, device)
    mask[torch.as_tensor(channels, dtype=torch.long, device=device)] = 0.0
    return pruned


def layer_output_channels(model: nn.Module, layer: nn.Module, probe: Tensor) -> int:
    """Number of channels `layer` outputs when `model` runs on `probe`."""
    shapes: list[torch.Size] = []
    handle = layer.register_forward_hook(lambda module, inputs, output: shapes.append(output.shape))
    try:
        model.eval()
        model(probe)
    finally:
        handle.remove()
    return int(shapes[0][1])


def subset_accuracy(trainer, model: nn.Module, split: Split) -> float:
    return float((trainer.predict(model, split.images) == split.labels).float().mean())


class FinePruning(Defense):
    """Fine-Pruning (Liu, Dolan-Gavitt, Garg, "Fine-Pruning: Defending Against Backdooring Attacks on
    Deep Neural Networks", RAID 2018).

    Channels of the last convolutional layer are pruned in increasing order of their mean
    activation on the defender's clean data (backdoor neurons sleep on clean inputs) until clean
    accuracy drops too far; the pruned network is then fine-tuned on the same clean data. The paper
    stops at a predetermined clean-accuracy threshold without fixing it, and the authors' code
    prunes a fixed count, so the rule is BackdoorBench's (`defense/fp.py`): `prune_step` (1%) of
    the channels a step, while accuracy stays within `max_acc_drop` (10%) of the unpruned one,
    relative (`acc_drop_mode=relative`) or in points (`absolute`); `prune_step=0` prunes one
    channel a step. At most `max_prune_ratio` of the channels go. Departures: the paper removes
    the neurons and BackdoorBench masks the inputs of the last linear layer; we mask the output
    channels of the last conv stage (after its norm, activation and pooling, see
    `conv_stage_outputs`), the same function, architecture kept. BackdoorBench measures test
    accuracy; ours the clean subset (test data never enters the defense; `prune_last_stage`
    rebuilds any point of the recorded curve for test-set curves). BackdoorBench's step k masks
    k - 1 channels and it fine-tunes the first network past the tolerance (its kept network is the
    same object it goes on pruning); ours masks k and keeps the last network within it.
    Fine-tuning uses the trainer's optimizer at `lr` for `epochs`, as `fine_tuning` does; budgets:
    `official` 100 epochs (BackdoorBench), `cpu` 10. Ledger: docs/fidelity.md#fine-pruning.
    """

    name = "fine_pruning"
    family = "pruning"
    sensitivity = ("max_acc_drop",)  # swept by conf/experiment/sensitivity_fine_pruning.yaml
    aliases = ("fp", "prune", "pruning")
    stage = "post_train"
    BUDGETS = {"official": {"epochs": 100}, "cpu": {"epochs": 10}}

    def __init__(
        self,
        *,
        max_acc_drop: float = 0.1,
        acc_drop_mode: str = "relative",
        prune_step: float = 0.01,
        max_prune_ratio: float = 0.9,
        budget: str = "official",
        epochs: int | None = None,
        lr: float = 0.01,
        clean_fraction: float = 0.05,
    ) -> None:
        super().__init__(clean_fraction=clean_fraction)
        epochs = self.resolve_budget(budget, epochs=epochs)["epochs"]
        checks.number("defense", "max_acc_drop", max_acc_drop, 0, 1)
        if acc_drop_mode not in ACC_DROP_MODES:
            raise ConfigError(f"defense.acc_drop_mode={acc_drop_mode!r} is unknown; choose one of: "
                              f"{', '.join(ACC_DROP_MODES)}")
        checks.number("defense", "prune_step", prune_step, 0, 1)
        checks.number("defense", "max_prune_ratio", max_prune_ratio, 0, 1, low_open=True, high_open=True)
        checks.integer("defense", "epochs", epochs, 0)
        checks.number("defense", "lr", lr, 0, low_open=True)
        self.max_acc_drop = float(max_acc_drop)
        self.acc_drop_mode = acc_drop_mode
        self.prune_step = float(prune_step)
        self.max_prune_ratio = float(max_prune_ratio)
        self.epochs = epochs
        self.lr = float(lr)

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        require_clean_subset(ctx, self.name)
        trainer, clean = ctx.trainer, ctx.clean_subset
        model = trainer.prepare(copy.deepcopy(ctx.model))
        probe = to_float(clean.images[:2].to(trainer.device))
        _, layer = conv_stage_outputs(model, probe)[-1]
        activation = mean_channel_activation(model, layer, clean.images, trainer.device, trainer.eval_batch_size)
        channels = len(activation)
        order = torch.argsort(activation, stable=True)  # most dormant first
        mask = attach_channel_mask(layer, channels, trainer.device)

        base_acc = subset_accuracy(trainer, model, clean)
        curve = [[0.0, base_acc]]
        n_pruned, pruned_acc, stopped = 0, base_acc, False
        for k in track(self.prune_counts(channels), "fine_pruning: pruning channels", unit="steps"):
            mask.fill_(1.0)
            mask[order[:k].to(mask.device)] = 0.0
            acc = subset_accuracy(trainer, model, clean)
            curve.append([k / channels, acc])
            stopped = stopped or not self.within_tolerance(base_acc, acc)
            if not stopped:
                n_pruned, pruned_acc = k, acc
        mask.fill_(1.0)
        mask[order[:n_pruned].to(mask.device)] = 0.0

        final_loss = None
        if self.epochs > 0:
            history = trainer.fit(model, clean, generator=ctx.generator, epochs=self.epochs, lr=self.lr,
                                  desc="fine-prune")
            final_loss = history[-1]["loss"]
        extras = {
            "n_channels": channels,
            "n_pruned": n_pruned,
            "pruned_fraction": n_pruned / channels,
            "pruned_channels": sorted(int(c) for c in order[:n_pruned]),
            "channel_order": [int(c) for c in order],  # ascending mean clean activation
            "mean_activation": [float(a) for a in activation],
            "subset_acc_unpruned": base_acc,
            "subset_acc_pruned": pruned_acc,
            "prune_curve": curve,  # [pruned fraction, clean-subset accuracy], before fine-tuning
        }
        if final_loss is not None:
            extras["final_loss"] = final_loss
        return DefenseResult(model=model, extras=extras)

    def prune_counts(self, channels: int) -> list[int]:
        """How many channels each pruning step masks: `prune_step` of them more a step (rounded up,
        at least one, as BackdoorBench's `once_prune_ratio`), up to `max_prune_ratio` of them."""
        step = max(1, math.ceil(self.prune_step * channels))
        return list(range(step, math.floor(self.max_prune_ratio * channels) + 1, step))

    def within_tolerance(self, base_acc: float, acc: float) -> bool:
        """Whether clean accuracy `acc` after a pruning step is still close enough to `base_acc`:
        relative, BackdoorBench's `|acc - base| / base < acc_ratio`; absolute, a drop of at most
        `max_acc_drop` points."""
        if self.acc_drop_mode == "absolute":
            return base_acc - acc <= self.max_acc_drop
        return base_acc > 0 and abs(acc - base_acc) / base_acc < self.max_acc_drop

    def test_artifacts(self, ctx: DefenseContext, result: DefenseResult, measure) -> dict[str, np.ndarray]:
        """The pruning curve on the test set, for the fine-pruning figure: CA, ASR and RA of the
        attacked model with its `k` most dormant channels masked, before any fine-tuning, at
        `CURVE_POINTS` evenly spaced k up to `max_prune_ratio` and at the chosen k. Evaluation only."""
        order = torch.as_tensor(result.extras["channel_order"], dtype=torch.long)
        channels, chosen = len(order), int(result.extras["n_pruned"])
        last = math.floor(self.max_prune_ratio * channels)
        counts = sorted({round(i * last / (CURVE_POINTS - 1)) for i in range(CURVE_POINTS)} | {chosen})
        trainer = ctx.trainer
        model = trainer.prepare(copy.deepcopy(ctx.model))
        _, layer = conv_stage_outputs(model, to_float(ctx.clean_subset.images[:2].to(trainer.device)))[-1]
        mask = attach_channel_mask(layer, channels, trainer.device)
        curve = []
        for k in counts:
            mask.fill_(1.0)
            mask[order[:k].to(mask.device)] = 0.0
            scores = measure(model)
            curve.append((scores["clean_acc"], scores["asr"], scores["ra"]))
        ca, asr, ra = (np.array(column, dtype=np.float64) for column in zip(*curve))
        return {"fp_pruned_fraction": np.array(counts, dtype=np.float64) / channels, "fp_clean_acc": ca,
                "fp_asr": asr, "fp_ra": ra, "fp_chosen_fraction": np.float64(chosen / channels)}

    def describe(self) -> dict:
        return {**super().describe(), "max_acc_drop": self.max_acc_drop, "acc_drop_mode": self.acc_drop_mode,
                "prune_step": self.prune_step, "max_prune_ratio": self.max_prune_ratio,
                "budget": self.budget, "epochs": self.epochs, "lr": self.lr}
