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
    with `lr` (default 0.01) for `epochs` epochs under the trainer's schedule and augmentation, as
    BackdoorBench (SGD, lr 0.01, 100 epochs, `CosineAnnealingLR` with T_max 100). Its T_max is 100
    whatever the epochs, so a shorter fine-tuning there keeps lr near 0.01 to the end; ours does the
    same: `cosine_period` (default 100) is the cosine's half period in epochs, and null runs the
    cosine over the fine-tuning's own epochs (what this class did before: at 20 epochs on mnist5k
    that halves the mean lr and leaves the BadNets backdoor whole, docs/fidelity.md#fine-tuning).
    Budgets: `official` 100 epochs, `cpu` 10. Ledger: docs/fidelity.md#fine-tuning.
    """

    name = "fine_tuning"
    family = "fine_tuning"
    sensitivity = ("lr",)  # swept by conf/experiment/sensitivity_fine_tuning.yaml
    aliases = ("ft", "finetune", "finetuning")
    stage = "post_train"
    BUDGETS = {"official": {"epochs": 100}, "cpu": {"epochs": 10}}

    def __init__(self, *, budget: str = "official", epochs: int | None = None, lr: float = 0.01,
                 cosine_period: int | None = 100, clean_fraction: float = 0.05) -> None:
        super().__init__(clean_fraction=clean_fraction)
        epochs = self.resolve_budget(budget, epochs=epochs)["epochs"]
        checks.integer("defense", "epochs", epochs, 1)
        checks.number("defense", "lr", lr, 0, low_open=True)
        checks.integer("defense", "cosine_period", cosine_period, 1, allow_none=True,
                       hint="epochs of the cosine's half period, BackdoorBench's T_max 100; null = the fine-tuning's epochs")
        self.epochs = epochs
        self.lr = float(lr)
        self.cosine_period = cosine_period

    def tuner(self, trainer):
        """The run's trainer set to fine-tune for `epochs` with its cosine over `cosine_period`
        epochs (a shallow copy: the run's own trainer is left as it was). Another schedule
        (multistep, plateau, constant) runs as the trainer has it, over the fine-tuning's epochs."""
        tuner = copy.copy(trainer)
        tuner.epochs = self.epochs
        tuner.schedule_period = self.cosine_period
        return tuner

    def apply(self, ctx: DefenseContext) -> DefenseResult:
        model = copy.deepcopy(ctx.model)
        history = self.tuner(ctx.trainer).fit(model, ctx.clean_subset, generator=ctx.generator, lr=self.lr,
                                              desc="fine-tune")
        return DefenseResult(model=model, extras={"final_loss": history[-1]["loss"], "final_lr": history[-1]["lr"]})

    def describe(self) -> dict:
        return {**super().describe(), "budget": self.budget, "epochs": self.epochs, "lr": self.lr,
                "cosine_period": self.cosine_period}
