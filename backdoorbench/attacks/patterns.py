"""Trigger pattern images: a scikit-image sample by name, an image file, or seeded noise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from backdoorbench.errors import ConfigError, DataError

# Sample images of scikit-image that ship inside the package (no download needed).
SKIMAGE_SAMPLES = ("astronaut", "camera", "cat", "chelsea", "coffee", "coins", "horse", "moon", "rocket")


def load_pattern(spec: str, shape: tuple[int, int, int], seed: int = 0) -> Tensor:
    """Return a float pattern in [0, 1] of `shape` (C, H, W).

    `spec` is `random` (uniform noise drawn with `seed`), the name of a scikit-image sample
    (one of SKIMAGE_SAMPLES), or the path of an image file. Images are resized with antialiased
    bilinear interpolation and converted to gray (ITU-R 601 luma) for 1-channel data.
    """
    channels, height, width = shape
    if spec == "random":
        generator = torch.Generator().manual_seed(seed)
        return torch.rand(shape, generator=generator)
    if spec in SKIMAGE_SAMPLES:
        import skimage.data

        array = getattr(skimage.data, spec)()
    else:
        array = _read_image_file(spec)
    scale = 255.0 if np.issubdtype(array.dtype, np.integer) else 1.0
    image = torch.from_numpy(np.array(array, dtype=np.float32)) / scale
    if image.dim() == 2:
        image = image.unsqueeze(-1)
    image = image[..., :3].permute(2, 0, 1)  # drop alpha; HWC -> CHW
    if channels == 1 and image.shape[0] == 3:
        image = (0.299 * image[0] + 0.587 * image[1] + 0.114 * image[2]).unsqueeze(0)
    elif channels == 3 and image.shape[0] == 1:
        image = image.expand(3, -1, -1)
    elif image.shape[0] != channels:
        raise DataError(f"pattern {spec!r} has {image.shape[0]} channels; the dataset needs {channels}")
    resized = F.interpolate(image.unsqueeze(0), size=(height, width), mode="bilinear", antialias=True, align_corners=False)
    return resized.squeeze(0).clamp(0.0, 1.0)


def _read_image_file(spec: str) -> np.ndarray:
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"pattern {spec!r} is neither an image file that exists nor a known name; use a path to an "
            f"image, 'random', or one of: {', '.join(SKIMAGE_SAMPLES)}"
        )
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.load()
            return np.asarray(img.convert("RGBA" if img.mode in ("RGBA", "LA", "P") else "RGB"))
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:
        raise DataError(f"pattern file {str(path)!r} is not a readable image ({exc.__class__.__name__}: {exc})") from exc
