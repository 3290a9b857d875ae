"""Datasets as in-memory uint8 tensors; one loader per file, selected by `dataset=<name>`."""

from backdoorbench.datasets.base import ImageDataset, Split

__all__ = ["ImageDataset", "Split"]
