"""Decode image files (PPM, JPEG, ...) with PIL into one uint8 (N, 3, H, W) tensor, in threads."""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from tqdm.auto import tqdm

from backdoorbench.datasets.root import corrupt_error

CHUNK = 256  # images per thread task: large enough that task overhead vanishes next to decoding


def decode_images(
    paths: Sequence[Path], size: int, *, resize: bool, dataset: str, how_to_get: str, desc: str
) -> Tensor:
    """RGB images of `paths` as uint8 (N, 3, size, size).

    With `resize`, each whole image is resized to size x size with PIL's bilinear filter (which
    antialiases when shrinking, as torchvision's Resize on PIL images does); without it, an image
    of another size is an error, since it can't come from the official archive. Grayscale and
    palette files are converted to RGB. PIL's decoders release the GIL, so threads scale.
    """
    out = np.empty((len(paths), size, size, 3), dtype=np.uint8)

    def decode_chunk(start: int) -> int:
        stop = min(start + CHUNK, len(paths))
        for i in range(start, stop):
            out[i] = _read_rgb(paths[i], size, resize, dataset, how_to_get)
        return stop - start

    workers = max(1, min(8, os.cpu_count() or 1))
    with tqdm(total=len(paths), desc=desc, unit="img", disable=None) as bar:
        pool = ThreadPoolExecutor(max_workers=workers)
        try:
            for done in pool.map(decode_chunk, range(0, len(paths), CHUNK)):
                bar.update(done)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # on an error, skip the chunks not yet started
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()


def _read_rgb(path: Path, size: int, resize: bool, dataset: str, how_to_get: str) -> np.ndarray:
    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB")  # forces the full decode, so truncation surfaces here
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise corrupt_error(dataset, path, f"not a readable image: {exc}", how_to_get) from exc
    if rgb.size != (size, size):
        if not resize:
            raise corrupt_error(dataset, path, f"image is {rgb.size[0]}x{rgb.size[1]}, expected {size}x{size}", how_to_get)
        rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
    return np.asarray(rgb)
