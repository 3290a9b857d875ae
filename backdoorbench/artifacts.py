"""Artifacts: the small arrays figures need beyond a record's metrics, kept beside the record.

`<record path without .json>.npz` holds named numeric arrays (trigger examples, GradCAM maps,
Neural Cleanse anomaly indices, STRIP entropies, pruning curves), so `python -m
backdoorbench.figures` redraws every figure without retraining. The file is written atomically
before the record, so a record never names a missing file, and read with allow_pickle=False:
an artifacts file can hold numbers only, never code.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from backdoorbench.fileio import atomic_write_bytes, load_arrays, write_new_bytes
from backdoorbench.metrics.gradcam import gradcam


def to_array(name: str, value: Any) -> np.ndarray:
    """A numeric numpy array of `value` (Tensor, ndarray, number or list of numbers)."""
    if isinstance(value, Tensor):
        value = value.detach().cpu()
        value = value.float() if value.dtype in (torch.bfloat16, torch.float16) else value
        value = value.numpy()
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
        raise TypeError(f"artifact {name!r} must be numeric, got dtype {array.dtype}")
    return array


def save_artifacts(path: str | Path, arrays: Mapping[str, Any], *, exclusive: bool = False) -> Path:
    """Write `arrays` to the .npz `path` atomically (temp file + fsync + rename); `exclusive`:
    FileExistsError rather than replace an existing file."""
    path = Path(path)
    if path.suffix != ".npz":
        raise ValueError(f"artifacts go to an .npz file, got {path}")
    converted = {name: to_array(name, value) for name, value in arrays.items()}
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **converted)
    (write_new_bytes if exclusive else atomic_write_bytes)(path, buffer.getvalue())
    return path


def load_artifacts(path: str | Path) -> dict[str, np.ndarray]:
    """The arrays of an artifacts file; a DataError naming the file if it is missing or corrupt."""
    return load_arrays(path)


def write_beside_record(record_path: str | Path, arrays: Mapping[str, Any]) -> str | None:
    """Save `arrays` as `<record path without .json>.npz` and return its file name (for the
    record's `artifacts` field), or None when there is nothing. Like the record, it never replaces
    a file of another run: FileExistsError if the name is taken."""
    if not arrays:
        return None
    return save_artifacts(Path(record_path).with_suffix(".npz"), arrays, exclusive=True).name


def example_artifacts(model: torch.nn.Module, examples: Tensor, trainer) -> dict[str, Tensor]:
    """The pipeline's trigger examples (8 clean, then their 8 poisoned versions) and GradCAM maps
    of both on the attacked model, for the trigger-gallery and GradCAM figures."""
    clean, poisoned = examples.chunk(2)
    net = trainer.prepare(model)
    device = next(net.parameters()).device
    return {
        "examples_clean": clean, "examples_poisoned": poisoned,
        "gradcam_clean": gradcam(net, clean.to(device)), "gradcam_poisoned": gradcam(net, poisoned.to(device)),
    }
