"""The in-memory dataset every loader returns: uint8 images (N, C, H, W) and int64 labels per split."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from backdoorbench.errors import DataError


@dataclass
class Split:
    """One split: uint8 images (N, C, H, W) in [0, 255] and int64 labels (N,)."""

    images: Tensor
    labels: Tensor

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise DataError(
                f"images must be a uint8 tensor of shape (N, C, H, W), got {self.images.dtype} "
                f"of shape {tuple(self.images.shape)}"
            )
        if self.labels.dtype != torch.int64 or self.labels.shape != (self.images.shape[0],):
            raise DataError(
                f"labels must be an int64 tensor of shape ({self.images.shape[0]},), got "
                f"{self.labels.dtype} of shape {tuple(self.labels.shape)}"
            )

    def __len__(self) -> int:
        return self.images.shape[0]

    def subset(self, indices: Tensor) -> "Split":
        return Split(self.images[indices], self.labels[indices])

    def float_images(self) -> Tensor:
        """Images as float in [0, 1], the unit every attack and metric works in."""
        return to_float(self.images)


@dataclass
class ImageDataset:
    """A classification dataset held in memory, with what the trainer and model wrapper need."""

    name: str
    train: Split
    test: Split
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    hflip: bool  # whether horizontal flips preserve the class (not for digits or traffic signs)
    crop_padding: int  # padding of the random-crop augmentation, in pixels

    def __post_init__(self) -> None:
        for split_name, split in (("train", self.train), ("test", self.test)):
            if split.images.shape[1:] != self.train.images.shape[1:]:
                raise DataError(
                    f"dataset {self.name!r}: {split_name} images have shape "
                    f"{tuple(split.images.shape[1:])}, expected {tuple(self.train.images.shape[1:])}"
                )
            if len(split) and (split.labels.min() < 0 or split.labels.max() >= self.num_classes):
                raise DataError(
                    f"dataset {self.name!r}: {split_name} labels span "
                    f"[{int(split.labels.min())}, {int(split.labels.max())}], expected [0, {self.num_classes - 1}]"
                )
        channels = self.train.images.shape[1]
        if len(self.mean) != channels or len(self.std) != channels:
            raise DataError(f"dataset {self.name!r}: mean/std need {channels} values, one per channel")

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of every image."""
        c, h, w = self.train.images.shape[1:]
        return int(c), int(h), int(w)


def to_float(images: Tensor) -> Tensor:
    """uint8 [0, 255] -> float32 [0, 1]."""
    return images.float().div_(255.0)


def to_uint8(images: Tensor) -> Tensor:
    """float [0, 1] -> uint8 [0, 255], rounding to the nearest level as saving an image file would.

    BackdoorBench truncates instead (`np.uint8` / `astype(np.uint8)` of its float poisoned images),
    so its stored pixels are up to one level darker; a recorded departure, measured in
    docs/fidelity.md#sig and #blended (no change of CA or ASR beyond one test image on mnist5k)."""
    return images.clamp(0.0, 1.0).mul(255.0).round_().to(torch.uint8)
