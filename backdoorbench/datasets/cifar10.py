"""cifar10: CIFAR-10 (Krizhevsky, 2009), 50,000 train / 10,000 test colour images, 32x32, 10 classes."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchvision.datasets import CIFAR10
from torchvision.datasets.utils import check_integrity, download_and_extract_archive

from backdoorbench import checks
from backdoorbench.datasets.base import ImageDataset, Split
from backdoorbench.datasets.cache import cached_splits, source_key
from backdoorbench.datasets.root import check_flag, corrupt_error, data_root, download_hint, require_files
from backdoorbench.errors import DataError

NAME = "cifar10"
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
# The official file list and md5s are torchvision's, so both check the same bytes.
BATCHES = {name: md5 for name, md5 in CIFAR10.train_list + CIFAR10.test_list}
TRAIN_BATCHES = [name for name, _ in CIFAR10.train_list]
TEST_BATCHES = [name for name, _ in CIFAR10.test_list]


def load_cifar10(
    root: str | None = None, download: bool = False, verify_md5: bool = True, crop_padding: int = 4
) -> ImageDataset:
    """The official CIFAR-10 split from the "python version" batches, `<root>/cifar-10-batches-py/`.

    `download=true` fetches the official archive with torchvision (md5-checked) and extracts it.
    The format is a Python pickle, so only the official archive should be used: by default every
    batch's md5 is checked against torchvision's list before it is opened, as torchvision does.
    We read the batches with our own unpickler instead of torchvision.datasets.CIFAR10 for two
    reasons: it admits only numpy arrays, lists and dicts, so even a tampered file can't run code
    (torchvision uses plain `pickle.load`); and `verify_md5=false` lets it read other files in the
    official format, such as the tests' tiny batches, which torchvision's fixed md5 list refuses.
    """
    checks.integer("dataset", "crop_padding", crop_padding, 0, 16)
    folder = data_root(root)
    batches = folder / CIFAR10.base_folder
    hint = download_hint(NAME, f"extract {CIFAR10.url} (md5 {CIFAR10.tgz_md5}) into {folder}")
    check_flag("verify_md5", verify_md5)
    if check_flag("download", download):
        _download(folder)
    require_files(NAME, batches, BATCHES, hint)
    key = source_key(folder, files=[batches / name for name in BATCHES])
    splits = cached_splits(folder, NAME, {"verify_md5": verify_md5}, key, lambda: _decode(batches, verify_md5, hint))
    return ImageDataset(
        name=NAME,
        train=Split(splits["train_images"], splits["train_labels"]),
        test=Split(splits["test_images"], splits["test_labels"]),
        num_classes=10,
        mean=CIFAR10_MEAN,
        std=CIFAR10_STD,
        hflip=True,
        crop_padding=crop_padding,
    )


load_cifar10.aliases = ("cifar", "cifar_10")  # dataset=cifar (backdoorbench/registry.py)


def _decode(batches: Path, verify_md5: bool, hint: str) -> dict[str, torch.Tensor]:
    if verify_md5:
        for name, md5 in BATCHES.items():
            if not check_integrity(batches / name, md5):
                raise corrupt_error(
                    NAME, batches / name, f"md5 differs from the official {md5}; set dataset.verify_md5=false "
                    "only for files you made yourself", hint)
    out = {}
    for split, names in (("train", TRAIN_BATCHES), ("test", TEST_BATCHES)):
        images, labels = zip(*(read_batch(batches / name, hint) for name in names))
        out[f"{split}_images"] = torch.from_numpy(np.concatenate(images)).reshape(-1, 3, 32, 32).contiguous()
        out[f"{split}_labels"] = torch.from_numpy(np.concatenate(labels)).to(torch.int64)
    return out


def read_batch(path: Path, hint: str) -> tuple[np.ndarray, np.ndarray]:
    """One batch file: uint8 data (N, 3072), rows of 1024 R, G, B values each; int64 labels (N,)."""
    try:
        with open(path, "rb") as handle:
            entry = _ArraysOnly(handle, encoding="latin1").load()  # latin1: the batches are Python 2 pickles
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise corrupt_error(NAME, path, f"not a CIFAR-10 batch pickle: {exc}", hint) from exc
    data = entry.get("data") if isinstance(entry, dict) else None
    labels = entry.get("labels") if isinstance(entry, dict) else None
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise corrupt_error(NAME, path, "its 'data' is not a uint8 array of shape (N, 3072)", hint)
    try:
        labels = np.asarray(labels, dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise corrupt_error(NAME, path, "its 'labels' are not integers", hint) from exc
    if labels.shape != (len(data),):
        raise corrupt_error(NAME, path, f"{len(data)} images but {labels.size} labels", hint)
    return data, labels


def _latin1_encode(text: str, encoding: str) -> bytes:
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"refusing _codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


def _numpy_globals() -> dict[tuple[str, str], Any]:
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return {
        # Python 3 writes bytes in protocol-2 pickles as _codecs.encode(text, "latin1")
        ("_codecs", "encode"): _latin1_encode,
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
    }


class _ArraysOnly(pickle.Unpickler):
    """An unpickler that can build numpy arrays, bytes and plain containers, and nothing else."""

    allowed = _numpy_globals()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}") from None


def _download(folder: Path) -> None:
    if all(check_integrity(folder / CIFAR10.base_folder / name, md5) for name, md5 in BATCHES.items()):
        return
    try:
        download_and_extract_archive(CIFAR10.url, str(folder), filename=CIFAR10.filename, md5=CIFAR10.tgz_md5)
    except Exception as exc:  # URLError, timeouts, md5 mismatch, bad archive
        raise DataError(
            f"dataset {NAME}: downloading {CIFAR10.url} into {folder} failed ({' '.join(str(exc).split())}); "
            "check the network, or place the extracted cifar-10-batches-py/ there yourself"
        ) from exc
