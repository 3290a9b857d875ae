"""mnist: the full MNIST digits (LeCun et al., 1998), 60,000 train / 10,000 test, 28x28 grayscale."""

from __future__ import annotations

import gzip
import os
import tempfile
import zlib
from pathlib import Path

import torch
import torchvision

from backdoorbench import checks
from backdoorbench.datasets.base import ImageDataset, Split
from backdoorbench.datasets.cache import cached_splits, source_key
from backdoorbench.datasets.mnist5k import MNIST_MEAN, MNIST_STD
from backdoorbench.datasets.root import check_flag, corrupt_error, data_root, download_hint, require_files
from backdoorbench.errors import DataError

NAME = "mnist"
SOURCE = "the four *-ubyte.gz files from https://ossci-datasets.s3.amazonaws.com/mnist/"
RAW_FILES = {  # file -> number of dimensions its IDX header declares
    "train-images-idx3-ubyte": 3,
    "train-labels-idx1-ubyte": 1,
    "t10k-images-idx3-ubyte": 3,
    "t10k-labels-idx1-ubyte": 1,
}


def load_mnist(root: str | None = None, download: bool = False, crop_padding: int = 2) -> ImageDataset:
    """The official MNIST split (60,000 / 10,000 digits), read by torchvision.datasets.MNIST.

    Files: `<root>/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte`, the layout torchvision
    uses; the `.gz` files as downloaded are decompressed there on first use. `download=true`
    fetches them through torchvision (its mirrors, its md5s). IDX headers and file sizes are checked
    first, so a truncated file is named in one line instead of failing inside the reader. No resize.
    """
    checks.integer("dataset", "crop_padding", crop_padding, 0, 14)
    folder = data_root(root)
    raw = folder / "MNIST" / "raw"
    hint = download_hint(NAME, f"put {SOURCE} into {raw}")
    if check_flag("download", download):
        _download(folder)
    _decompress_gz(raw, hint)
    require_files(NAME, raw, RAW_FILES, hint)
    counts = {name: _check_idx(raw / name, ndim, hint) for name, ndim in RAW_FILES.items()}
    for split in ("train", "t10k"):
        images, labels = counts[f"{split}-images-idx3-ubyte"], counts[f"{split}-labels-idx1-ubyte"]
        if images != labels:
            raise DataError(f"dataset {NAME}: {raw}/{split}-images-idx3-ubyte holds {images} images but "
                            f"{split}-labels-idx1-ubyte {labels} labels; {hint}")
    key = source_key(folder, files=[raw / name for name in RAW_FILES])
    splits = cached_splits(folder, NAME, {}, key, lambda: _decode(folder, hint))
    return ImageDataset(
        name=NAME,
        train=Split(splits["train_images"], splits["train_labels"]),
        test=Split(splits["test_images"], splits["test_labels"]),
        num_classes=10,
        mean=MNIST_MEAN,
        std=MNIST_STD,
        hflip=False,  # a mirrored digit is not the same digit
        crop_padding=crop_padding,
    )


def _decode(folder: Path, hint: str) -> dict[str, torch.Tensor]:
    out = {}
    for split, train in (("train", True), ("test", False)):
        try:
            data = torchvision.datasets.MNIST(str(folder), train=train, download=False)
        except (RuntimeError, ValueError, TypeError, AssertionError) as exc:  # headers were checked; be safe
            raise corrupt_error(NAME, folder / "MNIST" / "raw", str(exc), hint) from exc
        out[f"{split}_images"] = data.data.unsqueeze(1).to(torch.uint8).contiguous()
        out[f"{split}_labels"] = data.targets.to(torch.int64)
    return out


def _check_idx(path: Path, ndim: int, hint: str) -> int:
    """Check an IDX file's magic number and that its size matches its header; return its length."""
    header_size = 4 * (ndim + 1)
    with open(path, "rb") as handle:
        header = handle.read(header_size)
    if len(header) < header_size or header[:4] != bytes((0, 0, 0x08, ndim)):
        raise corrupt_error(NAME, path, f"not an IDX file of {ndim}-d unsigned bytes", hint)
    dims = [int.from_bytes(header[4 * (i + 1): 4 * (i + 2)], "big") for i in range(ndim)]
    expected = header_size + (dims[0] * (dims[1] * dims[2] if ndim == 3 else 1))
    actual = path.stat().st_size
    if ndim == 3 and dims[1:] != [28, 28]:
        raise corrupt_error(NAME, path, f"images are {dims[1]}x{dims[2]}, expected 28x28", hint)
    if actual != expected:
        raise corrupt_error(NAME, path, f"truncated: {actual} bytes, its header promises {expected}", hint)
    return dims[0]


def _decompress_gz(raw: Path, hint: str) -> None:
    """Decompress `<name>.gz` where only the archive is present (a manual download), atomically."""
    for name in RAW_FILES:
        target, archive = raw / name, raw / f"{name}.gz"
        if target.is_file() or not archive.is_file():
            continue
        try:
            fd, tmp = tempfile.mkstemp(dir=raw, prefix=f".{name}.", suffix=".tmp")
        except OSError as exc:
            raise DataError(f"dataset {NAME}: cannot decompress {archive} in place ({exc.strerror or exc}); "
                            f"decompress it yourself (gunzip) or make {raw} writable") from exc
        try:
            with os.fdopen(fd, "wb") as out, gzip.open(archive, "rb") as source:
                while chunk := source.read(1 << 20):
                    out.write(chunk)
            os.replace(tmp, target)
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise corrupt_error(NAME, archive, f"not a complete gzip file: {exc}", hint) from exc
        finally:
            Path(tmp).unlink(missing_ok=True)


def _download(folder: Path) -> None:
    try:
        torchvision.datasets.MNIST(str(folder), train=True, download=True)
    except Exception as exc:  # URLError, timeouts, md5 mismatches: all mean "could not download"
        raise DataError(
            f"dataset {NAME}: downloading into {folder / 'MNIST' / 'raw'} failed ({' '.join(str(exc).split())}); "
            f"check the network, or fetch {SOURCE} yourself"
        ) from exc
