"""Neural Cleanse: reverse-engineer a trigger per class, flag outliers by MAD, unlearn the flagged trigger."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.datasets.base import Split, to_float, to_uint8
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult
from backdoorbench.defenses.fine_pruning import require_clean_subset
from backdoorbench.errors import ConfigError
from backdoorbench.progress import track

MAD_CONSISTENCY = 1.4826  # makes the MAD a consistent estimator of the std under a normal distribution
TANH_EPS = 1e-7  # keeps tanh(.) / (2 - eps) + 0.5 strictly inside (0, 1), as the official code does
MAD_L1 = ("best_mask", "epoch_mean")


@dataclass
class ReversedTrigger:
    mask: Tensor  # (1, 1, H, W) in [0, 1]
    pattern: Tensor  # (1, C, H, W) in [0, 1]
    l1: float  # L1 norm of the saved mask (its sum: one value per pixel), what the MAD reads
    success: float  # fraction of the epoch's images the trigger sends to the class (last epoch)
    epoch_l1: float  # mean mask L1 over the batches of the epoch that saved it, what picks the best mask

    def apply(self, x: Tensor) -> Tensor:
        mask, pattern = self.mask.to(x.device, x.dtype), self.pattern.to(x.device, x.dtype)
        return (1 - mask) * x + mask * pattern


class ShuffledStream:
    """Batches of indices from successive shuffles of range(n), the last batch of each pass short,
    as the official code's Keras `ImageDataGenerator().flow(X, Y, batch_size)` deals them."""

    def __init__(self, n: int, batch_size: int, generator: torch.Generator) -> None:
        self.n, self.batch_size, self.generator = n, batch_size, generator
        self.order, self.position = torch.arange(n), n

    def next(self) -> Tensor:
        if self.position >= self.n:
            self.order, self.position = torch.randperm(self.n, generator=self.generator), 0
        batch = self.order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return batch


def numpy_median(values: Tensor) -> Tensor:
    """The median as `np.median` (the official code) takes it: the mean of the two middle values
    when the count is even. `torch.median` returns the lower of the two, which on 10 or 200
    classes moves both the centre and the MAD."""
    ordered = values.flatten().sort().values
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def mad_anomaly_index(norms: Tensor) -> Tensor:
    """|norm - median| / (1.4826 * median(|norm - median|)) per class, medians as np.median."""
    median = numpy_median(norms)
    mad = MAD_CONSISTENCY * numpy_median((norms - median).abs())
    # All norms equal but one: MAD is 0; a tiny floor keeps the index finite (records refuse inf).
    return (norms - median).abs() / mad.clamp_min(1e-12 * max(float(median.abs()), 1.0))


def flagged_classes(norms: Tensor, threshold: float) -> list[int]:
    """Classes whose mask norm is below the median with an anomaly index above `threshold`,
    smallest norm first (only small masks betray a backdoor: a shortcut to the class)."""
    index = mad_anomaly_index(norms)
    median = numpy_median(norms)
    flagged = [c for c in range(len(norms)) if norms[c] < median and index[c] > threshold]
    return sorted(flagged, key=lambda c: float(norms[c]))


class NeuralCleanse(Defense):
    """Neural Cleanse (Wang, Yao, Shan, Li, Viswanath, Zheng, Zhao, "Neural Cleanse: Identifying and
    Mitigating Backdoor Attacks in Neural Networks", IEEE S&P 2019).

    For every class c a mask m and pattern p are optimized so that x' = (1 - m) x + m p sends the
    clean subset to c while |m|_1 stays small; a class whose mask is an outlier on the small side
    (MAD anomaly index > 2) is the backdoor target, and the model is repaired by fine-tuning on the
    clean subset where 20% of the images carry the reversed trigger with their true label.
    We follow the official code's optimization: m and p in tanh space, Adam (lr 0.1, betas 0.5,
    0.9), the cost schedule (cost 0 until the trigger succeeds on >= 99% for `patience` epochs,
    then `init_cost`, raised x`cost_multiplier` after `patience` successful epochs and lowered by
    `cost_multiplier`**1.5 after `patience` failing ones), the best mask = smallest L1 among
    successful epochs, early stop after `early_stop_patience` epochs without a 1% gain.
    An epoch is `epoch_samples // batch_size` batches (the official 1,000 // 32 = 31, its
    `MINI_BATCH` steps of the outer loop) dealt from the clean subset reshuffled at each pass, as the
    official Keras generator deals them; `epoch_samples=null` makes it one pass over the clean
    subset. The MAD reads the L1 norm of each class's saved best mask, as the official
    `mad_outlier_detection.py` reads the saved mask images (`mad_l1=epoch_mean`: the epoch-mean L1
    that picked the mask); the best mask is still picked, and the early stop counted, by the
    epoch-mean L1, as the official code does.
    Budgets: `official` (default) up to 1,000 optimization epochs per class and 1 unlearning
    epoch, on a clean subset of 10% of the training set (the paper: 10%); `cpu` 50 and 10, the
    cut of the committed CPU tables (pass defense.clean_fraction=0.05 for their clean subset).
    Ledger: docs/fidelity.md#neural-cleanse. Departures: the official code searches on the test
    set, ours on the defender's clean subset; it reads the masks back from 8-bit PNG files, we
    keep them in floats; `parallel_classes` classes are optimized side by side in one batch (the
    same optimization, fewer kernel launches); several flagged classes share the stamped 20% in
    turns. If no class is flagged the model is returned unchanged (extras: unlearned = 0).
    """

    name = "neural_cleanse"
    family = "trigger_inversion"
    sensitivity = ("anomaly_threshold",)  # swept by conf/experiment/sensitivity_neural_cleanse.yaml
    aliases = ("nc",)
    stage = "post_train"
    BUDGETS = {"official": {"epochs": 1000, "unlearn_epochs": 1}, "cpu": {"epochs": 50, "unlearn_epochs": 10}}

    def __init__(
        self,
        *,
        budget: str = "official",
        epochs: int | None = None,
        epoch_samples: int | None = 1000,
        batch_size: int = 32,
        lr: float = 0.1,
        init_cost: float = 1e-3,
        cost_multiplier: float = 2.0,
        patience: int = 5,
        early_stop_patience: int = 25,
        attack_success_threshold: float = 0.99,
        reset_cost_to_zero: bool = True,
        anomaly_threshold: float = 2.0,
        mad_l1: str = "best_mask",
        unlearn_fraction: float = 0.2,
        unlearn_epochs: int | None = None,
        unlearn_lr: float = 0.01,
        parallel_classes: int = 10,
        clean_fraction: float = 0.1,
    ) -> None:
        super().__init__(clean_fraction=clean_fraction)
        resolved = self.resolve_budget(budget, epochs=epochs, unlearn_epochs=unlearn_epochs)
        epochs, unlearn_epochs = resolved["epochs"], resolved["unlearn_epochs"]
        for key, value, low in (("epochs", epochs, 1), ("batch_size", batch_size, 1), ("patience", patience, 1),
                                ("early_stop_patience", early_stop_patience, 1), ("unlearn_epochs", unlearn_epochs, 0),
                                ("parallel_classes", parallel_classes, 1)):
            checks.integer("defense", key, value, low)
        for key, value in (("lr", lr), ("init_cost", init_cost), ("unlearn_lr", unlearn_lr),
                           ("anomaly_threshold", anomaly_threshold)):
            checks.number("defense", key, value, 0, low_open=True)
        checks.number("defense", "cost_multiplier", cost_multiplier, 1, low_open=True)
        for key, value in (("attack_success_threshold", attack_success_threshold),
                           ("unlearn_fraction", unlearn_fraction)):
            checks.number("defense", key, value, 0, 1, low_open=True)
        if epoch_samples is not None:
            checks.integer("defense", "epoch_samples", epoch_samples, 1)
        if mad_l1 not in MAD_L1:
            raise ConfigError(f"defense.mad_l1={mad_l1!r} is unknown; choose one of: {', '.join(MAD_L1)}")
        if not isinstance(reset_cost_to_zero, bool):
            raise ConfigError(f"defense.reset_cost_to_zero={reset_cost_to_zero!r} is invalid; use true or false")
        self.epochs = epochs
        self.epoch_samples = epoch_samples
        self.batch_size = batch_size
        self.lr = float(lr)
        self.init_cost = float(init_cost)
        self.cost_multiplier = float(cost_multiplier)
        self.patience = patience
        self.early_stop_patience = early_stop_patience
        self.attack_success_threshold = float(attack_success_threshold)
        self.reset_cost_to_zero = reset_cost_to_zero
        self.anomaly_threshold = float(anomaly_threshold)
        self.mad_l1 = mad_l1
        self.unlearn_fraction = float(unlearn_fraction)
        self.unlearn_epochs = unlearn_epochs
        self.unlearn_lr = float(unlearn_lr)
        self.parallel_classes = parallel_classes

    def batches_per_epoch(self, n: int) -> int:
        """Optimizer steps in one epoch over a clean subset of `n` images."""
        if self.epoch_samples is None:
            return math.ceil(n / self.batch_size)
        return max(1, self.epoch_samples // self.batch_size)

    def reverse_engineer(self, model: nn.Module, images: Tensor, targets: list[int],
                         generator: torch.Generator) -> list[ReversedTrigger]:
        """For each class of `targets`, the smallest trigger found that sends `images` ([0, 1], on the
        model's device) to it. The classes are optimized side by side in one batch: their losses
        are independent and Adam is elementwise, so this equals one optimization per class."""
        device = images.device
        _, channels, height, width = images.shape
        count = len(targets)

        def to_tanh(values: Tensor) -> Tensor:
            return torch.atanh((values - 0.5) * (2 - TANH_EPS)).to(device)

        def squash(raw: Tensor) -> Tensor:
            return torch.tanh(raw) / (2 - TANH_EPS) + 0.5

        # Random start, like the official code.
        mask_raw = to_tanh(torch.rand(count, 1, height, width, generator=generator)).requires_grad_(True)
        pattern_raw = to_tanh(torch.rand(count, channels, height, width, generator=generator)).requires_grad_(True)
        optimizer = torch.optim.Adam([mask_raw, pattern_raw], lr=self.lr, betas=(0.5, 0.9))
        target_ids = torch.tensor(targets, device=device)
        cost = [0.0 if self.reset_cost_to_zero else self.init_cost] * count
        best: list[ReversedTrigger | None] = [None] * count
        cost_set, cost_up, cost_down, early_stop = [0] * count, [0] * count, [0] * count, [0] * count
        raised, lowered = [False] * count, [False] * count
        early_stop_best = [float("inf")] * count
        success = [0.0] * count
        active = list(range(count))
        classes = f"class {targets[0]}" if count == 1 else f"classes {targets[0]}-{targets[-1]}"
        stream = ShuffledStream(len(images), self.batch_size, generator)
        steps = self.batches_per_epoch(len(images))
        for _ in track(range(self.epochs), f"neural_cleanse: trigger search, {classes}", unit="epochs"):
            if not active:
                break
            rows = torch.tensor(active, device=device)
            cost_now = torch.tensor([cost[k] for k in active], device=device)
            hits = torch.zeros(len(active), device=device)
            l1_sum = torch.zeros(len(active), device=device)
            seen = 0
            for _ in range(steps):
                x = images[stream.next().to(device)]
                mask, pattern = squash(mask_raw[rows]), squash(pattern_raw[rows])  # (A, 1|C, H, W)
                stamped = (1 - mask[:, None]) * x[None] + mask[:, None] * pattern[:, None]  # (A, B, C, H, W)
                logits = model(stamped.flatten(0, 1)).view(len(active), len(x), -1)
                labels = target_ids[rows][:, None].expand(-1, len(x))
                ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(len(active), -1)
                l1 = mask.flatten(1).sum(1)
                loss = (ce.mean(1) + cost_now * l1).sum()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                hits += (logits.detach().argmax(2) == labels).float().sum(1)
                l1_sum += l1.detach()
                seen += len(x)
            hits, l1_mean = (hits / seen).tolist(), (l1_sum / steps).tolist()
            for row, k in enumerate(list(active)):
                success[k] = hits[row]
                if success[k] >= self.attack_success_threshold and (best[k] is None or l1_mean[row] < best[k].epoch_l1):
                    with torch.no_grad():
                        mask = squash(mask_raw[k : k + 1]).cpu()
                        best[k] = ReversedTrigger(mask, squash(pattern_raw[k : k + 1]).cpu(), float(mask.sum()),
                                                  success[k], l1_mean[row])
                best_l1 = best[k].epoch_l1 if best[k] is not None else float("inf")
                if best[k] is not None:
                    early_stop[k] = early_stop[k] + 1 if best_l1 >= 0.99 * early_stop_best[k] else 0
                early_stop_best[k] = min(best_l1, early_stop_best[k])
                if raised[k] and lowered[k] and early_stop[k] >= self.early_stop_patience:
                    active.remove(k)
                    continue
                # The cost schedule: find any working trigger first, then trade success for a small mask.
                succeeded = success[k] >= self.attack_success_threshold
                if cost[k] == 0 and succeeded:
                    cost_set[k] += 1
                    if cost_set[k] >= self.patience:
                        cost[k], cost_up[k], cost_down[k], raised[k], lowered[k] = self.init_cost, 0, 0, False, False
                else:
                    cost_set[k] = 0
                cost_up[k], cost_down[k] = (cost_up[k] + 1, 0) if succeeded else (0, cost_down[k] + 1)
                if cost_up[k] >= self.patience:
                    cost_up[k], cost[k], raised[k] = 0, cost[k] * self.cost_multiplier, True
                elif cost_down[k] >= self.patience:
                    cost_down[k], cost[k], lowered[k] = 0, cost[k] / self.cost_multiplier**1.5, True
        found = []
        for k in range(count):
            if best[k] is None:  # never reached the success threshold: keep the last trigger, as the official code
                with torch.no_grad():
                    mask, pattern = squash(mask_raw[k : k + 1]).cpu(), squash(pattern_raw[k : k + 1]).cpu()
                best[k] = ReversedTrigger(mask, pattern, float(mask.sum()), success[k], float(mask.sum()))
            found.append(best[k])
        return found

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        require_clean_subset(ctx, self.name)
        trainer, clean = ctx.trainer, ctx.clean_subset
        scanner = trainer.prepare(copy.deepcopy(ctx.model)).eval()
        for param in scanner.parameters():
            param.requires_grad_(False)  # only the trigger is optimized
        images = to_float(clean.images.to(trainer.device))
        classes = list(range(ctx.num_classes))
        step = self.parallel_classes
        chunks = [classes[start : start + step] for start in range(0, len(classes), step)]
        triggers = [t for chunk in chunks for t in self.reverse_engineer(scanner, images, chunk, ctx.generator)]
        del scanner
        norms = torch.tensor([t.l1 if self.mad_l1 == "best_mask" else t.epoch_l1 for t in triggers],
                             dtype=torch.float64)
        index = mad_anomaly_index(norms)
        flagged = flagged_classes(norms, self.anomaly_threshold)
        smallest = int(norms.argmin())
        extras = {
            "mask_l1": [float(n) for n in norms],  # what the MAD read (`mad_l1`)
            "mask_l1_epoch_mean": [float(t.epoch_l1) for t in triggers],
            "anomaly_index": [float(a) for a in index],
            "anomaly_index_of_smallest": float(index[smallest]),  # the number the paper reports
            "smallest_norm_class": smallest,
            # (H, W) mask of that class, for figures of the reversed trigger
            "smallest_norm_mask": [[round(float(v), 4) for v in row] for row in triggers[smallest].mask[0, 0]],
            "reversed_success": [float(t.success) for t in triggers],
            "flagged": flagged,
            "n_flagged": len(flagged),
            "unlearned": int(bool(flagged) and self.unlearn_epochs > 0),
        }
        # per class, for the anomaly-index figure (index of every class, threshold line at 2)
        artifacts = {"nc_anomaly_index": index.float(), "nc_mask_l1": norms.float(),
                     "nc_anomaly_threshold": torch.tensor(self.anomaly_threshold)}
        if not extras["unlearned"]:
            return DefenseResult(model=ctx.model, extras=extras, artifacts=artifacts)  # nothing detected: nothing to repair

        stamped = torch.randperm(len(clean), generator=ctx.generator)[: round(self.unlearn_fraction * len(clean))]
        unlearn_images = clean.images.clone()
        for turn, target in enumerate(flagged):
            chosen = stamped[turn :: len(flagged)]
            if len(chosen):
                unlearn_images[chosen] = to_uint8(triggers[target].apply(to_float(clean.images[chosen])))
        model = copy.deepcopy(ctx.model)
        history = trainer.fit(model, Split(unlearn_images, clean.labels.clone()), generator=ctx.generator,
                              epochs=self.unlearn_epochs, lr=self.unlearn_lr, desc="nc unlearn")
        extras["n_stamped"] = int(len(stamped))
        extras["final_loss"] = history[-1]["loss"]
        return DefenseResult(model=model, extras=extras, artifacts=artifacts)

    def describe(self) -> dict:
        return {
            **super().describe(), "budget": self.budget, "epochs": self.epochs, "epoch_samples": self.epoch_samples,
            "batch_size": self.batch_size, "lr": self.lr,
            "init_cost": self.init_cost, "cost_multiplier": self.cost_multiplier, "patience": self.patience,
            "early_stop_patience": self.early_stop_patience, "attack_success_threshold": self.attack_success_threshold,
            "reset_cost_to_zero": self.reset_cost_to_zero, "anomaly_threshold": self.anomaly_threshold,
            "mad_l1": self.mad_l1, "unlearn_fraction": self.unlearn_fraction, "unlearn_epochs": self.unlearn_epochs,
            "unlearn_lr": self.unlearn_lr, "parallel_classes": self.parallel_classes,
        }
