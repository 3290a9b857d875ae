"""EP: entropy-based pruning of the neurons whose pre-activation is a two-population mixture."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from backdoorbench import checks
from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.pre_activation import PreActivationPruning, histogram_entropy, one_batch
from backdoorbench.errors import DataError


class EntropyPruning(PreActivationPruning):
    """EP, entropy-based pruning (Zheng, Tang, Li, Liu, NeurIPS 2022; official code
    RJ-T/NIPS2022_EP_BNP, `defense.py`). Ledger: docs/fidelity.md#ep.

    A backdoor neuron fires on the poisoned samples and not on the rest, so over a poisoned
    training set its pre-activation is a mixture of two populations, where a benign neuron's is one.
    From one batch of the training set the defender holds (the poisoned one, no clean data, labels
    unused): per BatchNorm2d channel, the maximum of its input over the spatial positions of each
    image, standardised over the images; the entropy of that value's histogram (bins of 0.01 shared
    by the layer, `histogram_entropy`); channels with entropy below mean - u std of their layer are
    pruned (`weight` of the BN zeroed). A mixture's standardised values gather in two narrow modes,
    so its histogram has less entropy.

    Departures: the batch is taken unaugmented (the official loader crops and flips it); a channel
    whose maximum is the same for every image (standardised: 0/0) is left unscored and unpruned
    (the official code fails on it). Against a training-controlled attack EP reads the poisoned set
    the attack exports (WaNet, Input-aware); LIRA and WB export none, so it does not apply.
    """

    name = "ep"
    family = "pruning"
    aliases = ("entropy_pruning",)
    needs_clean_data = False
    meets_training_controlled_attacks = False  # it reads the poisoned training set
    side = "low"

    def __init__(self, *, u: float = 3.0, batch_size: int = 500, step: float = 0.01, clean_fraction: float = 0.0) -> None:
        super().__init__(u=u, batch_size=batch_size, clean_fraction=clean_fraction)
        self.step = checks.number("defense", "step", step, 0, low_open=True, hint="histogram bin width; the official 0.01")

    def images(self, ctx: DefenseContext) -> Tensor:
        if len(ctx.poisoned_train) < 2:
            raise DataError("defense ep needs at least 2 training images to standardise its features")
        return one_batch(ctx.poisoned_train, self.batch_size, ctx.generator)

    def layer_scores(self, bns, inputs):
        scores = {}
        for name in bns:
            features = inputs[name].amax(dim=(2, 3)).T  # (C, N): each image's largest pre-activation
            std = features.std(dim=1, keepdim=True)
            constant = (std == 0).flatten()
            z = (features - features.mean(dim=1, keepdim=True)) / torch.where(std == 0, torch.ones_like(std), std)
            entropy = histogram_entropy(z, self.step)
            entropy[constant] = math.nan
            scores[name] = entropy
        return scores

    def describe(self) -> dict:
        return {**super().describe(), "step": self.step}
