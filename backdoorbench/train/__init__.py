"""The one trainer every attack and defense uses (trainer.py), with its batched augmentation, batching,
checkpoints, the official defense recipes applied to a copy of it, and the count of images through networks
(passes.py)."""

from backdoorbench.train.augment import apply_augmentation, augment_batch, draw_augmentation, draw_rotation, rotate
from backdoorbench.train.batches import batch_bounds, refresh_every, shard_bounds, to_device
from backdoorbench.train.checkpoint import CHECKPOINT_FORMAT, load_checkpoint, save_checkpoint
from backdoorbench.train.recipes import recipe, step_schedule
from backdoorbench.train.trainer import (SCHEDULES, EpochCallback, StepFn, Trainer, TrainingError, cross_entropy_step,
                                         resolve_device)

__all__ = ["CHECKPOINT_FORMAT", "SCHEDULES", "EpochCallback", "StepFn", "Trainer", "TrainingError", "apply_augmentation",
           "augment_batch", "batch_bounds", "cross_entropy_step", "draw_augmentation", "draw_rotation", "load_checkpoint",
           "recipe", "refresh_every", "resolve_device", "rotate", "save_checkpoint", "shard_bounds", "step_schedule",
           "to_device"]
