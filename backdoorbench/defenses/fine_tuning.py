"""Fine-tuning on the defender's clean subset."""

from __future__ import annotations

import copy

from backdoorbench import checks
from backdoorbench.defenses.base import Defense, DefenseContext, DefenseResult


class FineTuning(Defense):
    """Fine-tuning, the baseline repair evaluated in Fine-Pruning (Liu, Dolan-Gavitt, Garg,
    "Fine-Pruning: Defending Against Backdooring Attacks on Deep Neural Networks", RAID 2018).

    The attacked model is trained further on the small clean subset the defender holds, hoping
    that the backdoor is forgotten while clean accuracy is kept. Departures: the paper fine-tunes
    with the original training schedule's final learning rate; we use the trainer's optimizer
    with `lr` (default 0.01) for `epochs` epochs under the same schedule and augmentation, as
    BackdoorBench (SGD, cosine, lr 0.01, 100 epochs). Budgets: `official` 100 epochs, `cpu` 10.
    Ledger: docs/fidelity.md#fine-tuning.
    """

    name = "fine_tuning"
    family = "fine_tuning"
    sensitivity = ("lr",)  # swept by conf/experiment/sensitivity_fine_tuning.yaml
    aliases = ("ft", "finetune", "finetuning")
    stage = "post_train"
    BUDGETS = {"official": {"epochs": 100}, "cpu": {"epochs": 10}}

    def __init__(self, *, budget: str = "official", epochs: int | None = None, lr: float = 0.01,
                 clean_fraction: float = 0.05) -> None:
        super().__init__(clean_fraction=clean_fraction)
        epochs = self.resolve_budget(budget, epochs=epochs)["epochs"]
        checks.integer("defense", "epochs", epochs, 1)
        checks.number("defense", "lr", lr, 0, low_open=True)
        self.epochs = epochs
        self.lr = float(lr)

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        model = copy.deepcopy(ctx.model)
        history = ctx.trainer.fit(
            model, ctx.clean_subset, generator=ctx.generator, epochs=self.epochs, lr=self.lr, desc="fine-tune"
        )
        return DefenseResult(model=model, extras={"final_loss": history[-1]["loss"]})

    def describe(self) -> dict:
        return {**super().describe(), "budget": self.budget, "epochs": self.epochs, "lr": self.lr}
