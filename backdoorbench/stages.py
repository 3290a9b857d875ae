"""What the stages of a run share: a seeded random stream each, and a timer each (the record's timings_s)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

# Each random stream gets its own generator so that, e.g., changing the defense never changes
# which samples were poisoned.
STREAMS = {"poison": 1, "train": 2, "clean_subset": 3, "defense": 4, "defense_train": 5, "attack": 6, "reactivation": 7,
           "export": 8}


def stream(seed: int, name: str) -> torch.Generator:
    """The generator of stage `name` of the run with `seed`."""
    return torch.Generator().manual_seed(seed * 1_000_003 + STREAMS[name])


@contextmanager
def timed(timings: dict[str, float], stage: str):
    """Time the block and keep its seconds (4 decimals) as `timings[stage]`."""
    start = time.perf_counter()
    yield
    timings[stage] = round(time.perf_counter() - start, 4)
