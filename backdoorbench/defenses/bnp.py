"""BNP: pruning the neurons whose batch-norm running statistics diverge from clean data's."""

from __future__ import annotations

from torch import Tensor

from backdoorbench.defenses.base import DefenseContext
from backdoorbench.defenses.pre_activation import PreActivationPruning, gaussian_kl, one_batch
from backdoorbench.errors import DataError


class BatchNormPruning(PreActivationPruning):
    """BNP, pruning by batch-norm statistics (Zheng, Tang, Li, Liu, NeurIPS 2022; official code
    RJ-T/NIPS2022_EP_BNP, `defense.py`). Ledger: docs/fidelity.md#bnp.

    A BatchNorm's running mean and variance were learned on the poisoned training set, so a
    backdoor neuron's are pulled by the poisoned samples away from what clean data gives. From one
    batch of the defender's clean data: per BatchNorm2d channel, the mean and (unbiased) variance of
    its input over the images and positions, N(mu1, var1); its running statistics N(mu2, var2);
    the score KL(N(mu1, var1) || N(mu2, var2)); channels with a score above mean + u std of their
    layer are pruned (`weight` of the BN zeroed). No fine-tuning.

    The official code holds out 1% of the training set as its clean data (500 CIFAR-10 images, one
    batch): `clean_fraction` 0.01. BackdoorBench's port differs (its log term is doubled, its
    clean statistics are overwritten by a poisoned batch's); we follow the official code. The
    batch is taken unaugmented (the official loader crops and flips it).
    """

    name = "bnp"
    family = "pruning"
    aliases = ("bn_pruning",)
    needs_clean_data = True

    def __init__(self, *, u: float = 3.0, batch_size: int = 500, clean_fraction: float = 0.01) -> None:
        super().__init__(u=u, batch_size=batch_size, clean_fraction=clean_fraction)

    def images(self, ctx: DefenseContext) -> Tensor:
        if len(ctx.clean_subset) < 2:
            raise DataError(f"defense bnp got {len(ctx.clean_subset)} clean image(s); it needs at least 2 for a "
                            "variance: raise defense.clean_fraction (the official 0.01)")
        return one_batch(ctx.clean_subset, self.batch_size, ctx.generator)

    def layer_scores(self, bns, inputs):
        scores = {}
        for name, bn in bns.items():
            x = inputs[name].double()
            mu1, var1 = x.mean(dim=(0, 2, 3)), x.var(dim=(0, 2, 3))
            mu2, var2 = bn.running_mean.detach().double().cpu(), bn.running_var.detach().double().cpu()
            scores[name] = gaussian_kl(mu1, var1, mu2, var2)
        return scores
