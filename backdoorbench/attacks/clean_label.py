"""The poison rate of the attacks that can run clean-label (SIG, Label-Consistent, Refool)."""

from __future__ import annotations

# Clean-label: the share of the target class poisoned, as the papers count it; the whole class is
# what BackdoorBench's pratio 0.1 reaches on CIFAR-10 and the official LC code's default
# (poisoning_proportion 1.0). Dirty-label variants poison a share of the whole training set, as
# every other data-poisoning attack here.
CLEAN_LABEL_RATE = 1.0
DIRTY_LABEL_RATE = 0.1


def default_poison_rate(poison_rate: float | None, clean_label: bool) -> float | None:
    """`poison_rate` as given, or, when it is None, the default of the chosen labelling."""
    if poison_rate is not None:
        return poison_rate
    return CLEAN_LABEL_RATE if clean_label else DIRTY_LABEL_RATE
