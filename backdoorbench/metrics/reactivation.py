"""Post-purification robustness: does a defended model stay purified when an attacker tries again?

Min, Qin, Zhang, Shen, Cheng, "Uncovering, Explaining, and Mitigating the Superficial Safety of
Backdoor Defense", NeurIPS 2024 (arXiv 2410.09838); official code AISafety-HKUST/Backdoor_Safety_Tuning
(`fine_tune/ft_poison.py`, `fine_tune/qra.py`). Two probes of the model a defense returns:

- Retuning attack (RA): fine-tune a copy on a small training subset in which a few samples carry
  the trigger and the target label, and read CA and ASR after every step. A model whose backdoor
  was removed stays near the clean floor (a clean model needs far more poison to learn a trigger);
  one whose backdoor was only suppressed re-learns it within a few steps.
- Query-based reactivation (QRA): train a small network that maps an input to a perturbation of at
  most `eps` (L_inf, pixels) such that the defended model on the perturbed triggered input answers
  as the retuned model does on the triggered input, while a clean model on the perturbed input
  keeps the true label (so the perturbation is a reactivation of the old backdoor, not a plain
  adversarial example). Reported: the defended model's ASR on perturbed triggered test images,
  and the clean model's (the same perturbation's transfer to a model that never had the backdoor).

Departures (docs/fidelity.md#reactivation): the poisoned retuning samples are drawn among training
images whose target differs from their label (the official code takes any poisoned training file);
every sample of the retuning set is augmented by the trainer's augmentation except the poisoned ones
(as the official code, whose poisoned files get the test transform); the probe's perturbation
network takes C x H x W inputs (the official one is written for 3-channel images); the clean model
is the run's `attack=none` victim from the victim cache (the official code loads a separately
trained pratio-0 model). Every number is measured on the run's test split, as CA and ASR.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backdoorbench import checks
from backdoorbench.attacks.base import Attack
from backdoorbench.datasets.base import Split, to_float
from backdoorbench.errors import ConfigError
from backdoorbench.metrics.accuracy import evaluate
from backdoorbench.train import augment_batch, batch_bounds

log = logging.getLogger(__name__)

PROTOCOL = "Min et al., NeurIPS 2024 (arXiv 2410.09838): retuning attack (RA) and query-based reactivation (QRA)"


@dataclass(frozen=True)
class RetuningBudget:
    """The retuning attack's budget (official: `ft_poison.py --split_ratio 0.02 --poison_num 5 --epochs 5 --lr 0.01`)."""

    clean_fraction: float = 0.02  # share of the training set the attacker fine-tunes on
    poison_count: int = 5  # of those, how many carry the trigger and the target label
    epochs: int = 5
    lr: float = 0.01  # SGD, momentum 0.9, no weight decay, constant
    batch_size: int = 128
    eval_every: int = 1  # optimizer steps between two measurements of CA and ASR

    def __post_init__(self) -> None:
        group = "eval.reactivation"
        checks.number(group, "clean_fraction", self.clean_fraction, 0, 1, low_open=True)
        checks.integer(group, "poison_count", self.poison_count, 0)
        checks.integer(group, "epochs", self.epochs, 1)
        checks.number(group, "lr", self.lr, 0, low_open=True)
        checks.integer(group, "batch_size", self.batch_size, 1)
        checks.integer(group, "eval_every", self.eval_every, 1)

    def set_size(self, n_train: int) -> int:
        """How many training samples the retuning set holds; a ConfigError if it cannot hold the poison."""
        size = round(self.clean_fraction * n_train)
        if size < max(1, self.poison_count):
            wanted = max(1, self.poison_count)
            raise ConfigError(
                f"eval.reactivation.clean_fraction={self.clean_fraction} gives a retuning set of {size} of "
                f"{n_train} training samples, fewer than the {wanted} it needs (poison_count={self.poison_count}); "
                f"use eval.reactivation.clean_fraction >= {wanted / n_train:.2g}")
        return size


@dataclass(frozen=True)
class ProbeBudget:
    """The query-based probe's budget (official: `qra.py --eps 16/255 --epochs 50 --alpha_qra 0.2
    --clean_num_qra 500 --poison_num_qra 500`, SGD lr 0.1 momentum 0.9, batch 128)."""

    enabled: bool = True
    eps: float = 16 / 255  # L_inf, pixel units
    epochs: int = 50
    alpha: float = 0.2  # weight of the reactivation term against the clean model's cross-entropy
    clean_count: int = 500
    poison_count: int = 500
    lr: float = 0.1
    batch_size: int = 128
    hidden: int = 1024  # width of the perturbation network's three hidden layers

    def __post_init__(self) -> None:
        group = "eval.reactivation.probe"
        checks.number(group, "eps", self.eps, 0, 1, low_open=True, hint="pixel units")
        checks.integer(group, "epochs", self.epochs, 1)
        checks.number(group, "alpha", self.alpha, 0)
        checks.integer(group, "clean_count", self.clean_count, 0)
        checks.integer(group, "poison_count", self.poison_count, 1)
        checks.number(group, "lr", self.lr, 0, low_open=True)
        checks.integer(group, "batch_size", self.batch_size, 1)
        checks.integer(group, "hidden", self.hidden, 1)


def _attackable(attack: Attack, labels: Tensor) -> Tensor:
    return attack.target_rule(labels) != labels


def retuning_set(train: Split, attack: Attack, budget: RetuningBudget, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """(images in [0, 1], labels, is_poisoned) of the attacker's retuning set: a seeded random
    `clean_fraction` of the (clean) training split, of which the first `poison_count` images whose
    target differs from their label get the trigger and the target label."""
    size = budget.set_size(len(train))
    pick = torch.randperm(len(train), generator=generator)[:size]
    images, labels = to_float(train.images[pick]), train.labels[pick].clone()
    candidates = torch.nonzero(_attackable(attack, labels)).flatten()[: budget.poison_count]
    if len(candidates) < budget.poison_count:
        raise ConfigError(f"eval.reactivation.poison_count={budget.poison_count} but the retuning set of {size} "
                          f"samples has only {len(candidates)} whose target differs from their label; "
                          "raise eval.reactivation.clean_fraction")
    poisoned = torch.zeros(size, dtype=torch.bool)
    poisoned[candidates] = True
    if len(candidates):
        images[candidates] = attack.apply_trigger(images[candidates]).clamp(0, 1)
        labels[candidates] = attack.target_rule(labels[candidates])
    return images, labels, poisoned


def _measure(model: nn.Module, trainer, attack: Attack, test: Split, curve: dict[str, list], step: int) -> None:
    metrics = evaluate(model, trainer, attack, test)
    curve["steps"].append(step)
    curve["asr"].append(metrics["asr"])
    curve["ca"].append(metrics["clean_acc"])


def _own_rng(trainer, generator: torch.Generator):
    """The global random state (dropout masks) seeded from `generator` for the block, and restored
    after it: the stage is seeded, and what the run draws after it is as without it."""
    devices = [trainer.device.index or 0] if trainer.device.type == "cuda" else []
    seed = int(torch.randint(2**62, (1,), generator=generator))
    context = torch.random.fork_rng(devices=devices)
    context.__enter__()
    torch.manual_seed(seed)
    return context


def retune(model: nn.Module, trainer, attack: Attack, train: Split, test: Split, budget: RetuningBudget,
           generator: torch.Generator) -> tuple[dict[str, Any], nn.Module]:
    """The retuning attack on a copy of `model` (left untouched): returns ({"steps", "asr", "ca"},
    the retuned copy). Step 0 is the model as given; then every `eval_every` optimizer steps and the last."""
    context = _own_rng(trainer, generator)
    try:
        return _retune(model, trainer, attack, train, test, budget, generator)
    finally:
        context.__exit__(None, None, None)


def _retune(model: nn.Module, trainer, attack: Attack, train: Split, test: Split, budget: RetuningBudget,
            generator: torch.Generator) -> tuple[dict[str, Any], nn.Module]:
    images, labels, poisoned = retuning_set(train, attack, budget, generator)
    net = trainer.prepare(copy.deepcopy(model))
    device = trainer.device
    images, labels, poisoned = images.to(device), labels.to(device), poisoned.to(device)
    optimizer = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=budget.lr, momentum=0.9)
    curve: dict[str, list] = {"steps": [], "asr": [], "ca": []}
    _measure(net, trainer, attack, test, curve, 0)
    step = 0
    bounds = batch_bounds(len(images), budget.batch_size)
    for _ in range(budget.epochs):
        order = torch.randperm(len(images), generator=generator).to(device)
        for start, stop in bounds:
            index = order[start:stop]
            x, y = images[index], labels[index]
            if trainer.augment:  # the clean samples as the victim saw them; the poisoned ones as they are
                augmented = augment_batch(x, generator, trainer.crop_padding, trainer.hflip)
                x = torch.where(poisoned[index][:, None, None, None], x, augmented)
            net.train()
            with trainer.autocast():
                loss = F.cross_entropy(net(x.contiguous(memory_format=trainer.memory_format)), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % budget.eval_every == 0:
                _measure(net, trainer, attack, test, curve, step)
    if curve["steps"][-1] != step:
        _measure(net, trainer, attack, test, curve, step)
    return curve, net


class PerturbationNet(nn.Module):
    """x -> a perturbation in [-eps, eps] of x's shape: a fully connected encoder-decoder (three
    hidden layers of `hidden` units, ReLU, tanh output), the shape of the official QRA network."""

    def __init__(self, image_shape: tuple[int, int, int], eps: float, hidden: int = 1024) -> None:
        super().__init__()
        size = image_shape[0] * image_shape[1] * image_shape[2]
        self.image_shape, self.eps = tuple(image_shape), float(eps)
        self.layers = nn.Sequential(nn.Linear(size, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                    nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, size), nn.Tanh())

    def forward(self, x: Tensor) -> Tensor:
        delta = (self.layers(x.flatten(1)) * self.eps).clamp(-self.eps, self.eps)
        return delta.view(-1, *self.image_shape)

    def perturb(self, x: Tensor) -> Tensor:
        return (x + self(x)).clamp(0, 1)


def _frozen(model: nn.Module, trainer) -> nn.Module:
    net = trainer.prepare(copy.deepcopy(model)).eval()
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def query_reactivation(defended: nn.Module, retuned: nn.Module, clean: nn.Module, trainer, attack: Attack,
                       train: Split, test: Split, budget: ProbeBudget, generator: torch.Generator) -> dict[str, Any]:
    """QRA: fit a PerturbationNet on `clean_count` clean and `poison_count` triggered training
    images so that `defended`(x + delta) matches `retuned`(x) (KL, weight `alpha`) while
    `clean`(x + delta) keeps the true label (cross-entropy); then measure on the test split."""
    device = trainer.device
    defended, retuned, clean = (_frozen(m, trainer) for m in (defended, retuned, clean))
    order = torch.randperm(len(train), generator=generator)
    attackable = _attackable(attack, train.labels[order])
    poison_pick = order[attackable][: budget.poison_count]
    clean_pick = order[~torch.isin(order, poison_pick)][: budget.clean_count]
    if len(poison_pick) < budget.poison_count:
        raise ConfigError(f"eval.reactivation.probe.poison_count={budget.poison_count} but only {len(poison_pick)} "
                          "training images have a target different from their label; lower it")
    triggered = attack.apply_trigger(to_float(train.images[poison_pick])).clamp(0, 1)
    images = torch.cat([to_float(train.images[clean_pick]), triggered]).to(device)
    true_labels = torch.cat([train.labels[clean_pick], train.labels[poison_pick]]).to(device)
    net = PerturbationNet(tuple(train.images.shape[1:]), budget.eps, budget.hidden).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=budget.lr, momentum=0.9)
    with torch.no_grad():  # the retuned model's answers on the unperturbed inputs: the behaviour to reactivate
        teacher = torch.cat([retuned(images[s:e]).float() for s, e in batch_bounds(len(images), 1024, 1)])
    for _ in range(budget.epochs):
        shuffle = torch.randperm(len(images), generator=generator).to(device)
        for start, stop in batch_bounds(len(images), budget.batch_size, 1):
            index = shuffle[start:stop]
            x_adv = net.perturb(images[index])
            reactivate = F.kl_div(F.log_softmax(defended(x_adv), 1), F.softmax(teacher[index], 1), reduction="batchmean")
            benign = F.cross_entropy(clean(x_adv), true_labels[index])
            loss = budget.alpha * reactivate + benign
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    net.eval()
    with torch.no_grad():
        mask = _attackable(attack, test.labels)
        labels = test.labels[mask]
        targets = attack.target_rule(labels)
        triggered_test = [net.perturb(attack.apply_trigger(to_float(test.images[mask][s:e].to(device))))
                          for s, e in batch_bounds(int(mask.sum()), 1024, 1)]
        perturbed_clean = [net.perturb(to_float(test.images[mask][s:e].to(device)))
                           for s, e in batch_bounds(int(mask.sum()), 1024, 1)]

        def hits(model: nn.Module, batches: list[Tensor]) -> float:
            predictions = torch.cat([model(x).argmax(1).cpu() for x in batches])
            return int((predictions == targets).sum()) / max(len(targets), 1)

        return {"asr": hits(defended, triggered_test), "asr_clean_model": hits(clean, triggered_test),
                "clean_to_target": hits(defended, perturbed_clean)}


def measure_reactivation(*, subject: nn.Module, subject_is: str, reference: nn.Module | None, clean_model, trainer,
                         attack: Attack, train: Split, test: Split, budget: RetuningBudget, probe: ProbeBudget,
                         generator: torch.Generator, reference_attack: Attack | None = None) -> dict[str, Any]:
    """The record's `reactivation` block: RA (and QRA when `probe.enabled` and a `clean_model` is
    given, a callable returning it) on `subject` (stored under `subject_is`: "defended" or
    "attacked"), and RA alone on `reference` (the undefended victim) when given, with the trigger
    `reference_attack` holds (default `attack`): an in-training defense retrains a learned trigger
    along with its model, and the victim's is the one it was trained with."""
    started = time.perf_counter()
    curve, retuned = retune(subject, trainer, attack, train, test, budget, generator)
    log.info("reactivation: %s model's ASR %.2f%% -> %.2f%% after %d retuning steps (%d poisoned of %d samples)",
             subject_is, 100 * curve["asr"][0], 100 * curve["asr"][-1], curve["steps"][-1], budget.poison_count,
             budget.set_size(len(train)))
    block: dict[str, Any] = {"protocol": PROTOCOL, "budget": {**asdict(budget), "set_size": budget.set_size(len(train)),
                                                              "steps": curve["steps"][-1], "probe": asdict(probe)}}
    if probe.enabled and clean_model is not None:
        probe_started = time.perf_counter()
        curve["probe"] = query_reactivation(subject, retuned, clean_model(), trainer, attack, train, test, probe, generator)
        log.info("reactivation: query-based probe ASR %.2f%% on the %s model, %.2f%% on the clean model (%.1f s)",
                 100 * curve["probe"]["asr"], subject_is, 100 * curve["probe"]["asr_clean_model"],
                 time.perf_counter() - probe_started)
    block[subject_is] = curve
    if reference is not None:
        block["attacked"], _ = retune(reference, trainer, reference_attack or attack, train, test, budget, generator)
    block["seconds"] = round(time.perf_counter() - started, 4)
    return block
