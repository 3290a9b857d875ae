"""tiny_imagenet: Tiny ImageNet (Stanford CS231n, 2015), 200 ImageNet classes at 64x64 px."""

from __future__ import annotations

import re
import shutil
import tempfile
import zipfile
from pathlib import Path

import torch
from torchvision.datasets.utils import download_url

from backdoorbench import checks
from backdoorbench.datasets.base import ImageDataset, Split
from backdoorbench.datasets.cache import cached_splits, source_key
from backdoorbench.datasets.decode import decode_images
from backdoorbench.datasets.root import (
    check_flag,
    corrupt_error,
    data_root,
    download_hint,
    missing_error,
    require_files,
)
from backdoorbench.errors import DataError

NAME = "tiny_imagenet"
FOLDER = "tiny-imagenet-200"
URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
ZIP_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"  # the official archive, 248,100,043 bytes
NUM_CLASSES = 200
IMAGE_SIZE = 64
TINY_MEAN = (0.4802, 0.4481, 0.3975)
TINY_STD = (0.2302, 0.2265, 0.2262)
WNID = re.compile(r"n\d{8}")


def load_tiny_imagenet(root: str | None = None, download: bool = False, crop_padding: int = 4,
                       hflip: bool = True) -> ImageDataset:
    """Tiny ImageNet's 100,000 training images (500 per class) and, as the test split, its 10,000
    labelled validation images (50 per class); the official test images have no labels.

    Files: the official archive's `<root>/tiny-imagenet-200/` tree: wnids.txt,
    train/<wnid>/images/*.JPEG, val/images/*.JPEG and val/val_annotations.txt. `download=true`
    fetches the archive from the CS231n URL, checks its md5 and unzips it (into a temp folder, then
    renamed, so an interrupted unzip never looks complete). Labels are the wnids in sorted order,
    the order of torchvision's ImageFolder on train/ that BackdoorBench and most peers use, not the
    order of wnids.txt. Images are already 64x64 (grayscale ones are converted to RGB); no resize.
    num_classes is 200, and wnids.txt must list 200 classes, each with a training folder.
    crop_padding 4 follows BackdoorBench's TinyImageNet runs (WaNet-style code would use 64 // 8 = 8);
    horizontal flips are on, as these are natural photos (BackdoorBench's code flips only CIFAR-10).
    """
    checks.integer("dataset", "crop_padding", crop_padding, 0, 32)
    folder = data_root(root)
    tree = folder / FOLDER
    hint = download_hint(NAME, f"unzip {URL} (md5 {ZIP_MD5}) into {folder}")
    if check_flag("download", download):
        _download(folder, hint)
    require_files(NAME, tree, ["wnids.txt", "val/val_annotations.txt"], hint)
    wnids = _read_wnids(tree / "wnids.txt", hint)
    missing = [f"train/{wnid}/images/" for wnid in wnids if not (tree / "train" / wnid / "images").is_dir()]
    if missing:
        raise missing_error(NAME, tree, missing, hint)
    key = source_key(folder, folders=[tree / "train", tree / "val"], files=[tree / "wnids.txt"], suffixes=(".jpeg", ".txt"))
    splits = cached_splits(folder, NAME, {}, key, lambda: _decode(tree, wnids, hint))
    return ImageDataset(
        name=NAME,
        train=Split(splits["train_images"], splits["train_labels"]),
        test=Split(splits["test_images"], splits["test_labels"]),
        num_classes=NUM_CLASSES,
        mean=TINY_MEAN,
        std=TINY_STD,
        hflip=bool(hflip),
        crop_padding=crop_padding,
    )


load_tiny_imagenet.aliases = ("tiny", "tinyimagenet")  # dataset=tiny (backdoorbench/registry.py)


def _read_wnids(path: Path, hint: str) -> list[str]:
    """The 200 class ids, sorted."""
    try:
        wnids = path.read_text(encoding="ascii").split()
    except UnicodeDecodeError as exc:
        raise corrupt_error(NAME, path, "not a text file of WordNet ids", hint) from exc
    bad = [wnid for wnid in wnids if not WNID.fullmatch(wnid)]
    if bad or len(set(wnids)) != NUM_CLASSES or len(wnids) != NUM_CLASSES:
        problem = f"{bad[0]!r} is not a WordNet id" if bad else f"it lists {len(set(wnids))} distinct of {len(wnids)} ids, expected {NUM_CLASSES}"
        raise corrupt_error(NAME, path, problem, hint)
    return sorted(wnids)


def _decode(tree: Path, wnids: list[str], hint: str) -> dict[str, torch.Tensor]:
    label_of = {wnid: label for label, wnid in enumerate(wnids)}
    train_paths, train_labels = [], []
    for wnid in wnids:
        images = sorted((tree / "train" / wnid / "images").glob("*.JPEG"))
        if not images:
            raise missing_error(NAME, tree / "train" / wnid / "images", ["*.JPEG"], hint)
        train_paths += images
        train_labels += [label_of[wnid]] * len(images)
    test_paths, test_labels = _read_val_annotations(tree / "val", label_of, hint)
    return {
        "train_images": decode_images(train_paths, IMAGE_SIZE, resize=False, dataset=NAME, how_to_get=hint,
                                      desc="decoding TinyImageNet train"),
        "train_labels": torch.tensor(train_labels, dtype=torch.int64),
        "test_images": decode_images(test_paths, IMAGE_SIZE, resize=False, dataset=NAME, how_to_get=hint,
                                     desc="decoding TinyImageNet val"),
        "test_labels": torch.tensor(test_labels, dtype=torch.int64),
    }


def _read_val_annotations(val: Path, label_of: dict[str, int], hint: str) -> tuple[list[Path], list[int]]:
    """val_annotations.txt: one tab-separated line per image: file name, wnid, then its bounding box."""
    path = val / "val_annotations.txt"
    try:
        lines = path.read_text(encoding="ascii").splitlines()
    except UnicodeDecodeError as exc:
        raise corrupt_error(NAME, path, "not a text file", hint) from exc
    paths, labels = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in label_of:
            raise corrupt_error(NAME, path, f"line {number} is not '<file>\\t<wnid from wnids.txt>\\t...': {line[:60]!r}", hint)
        paths.append(val / "images" / fields[0])
        labels.append(label_of[fields[1]])
    if not paths:
        raise corrupt_error(NAME, path, "it lists no images", hint)
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise missing_error(NAME, val / "images", missing, f"they are listed in {path}; {hint}")
    return paths, labels


def _download(folder: Path, hint: str) -> None:
    """Fetch and unzip the official archive unless the tree is already there."""
    if (folder / FOLDER / "wnids.txt").is_file():
        return
    try:
        download_url(URL, str(folder), filename=f"{FOLDER}.zip", md5=ZIP_MD5)  # raises on an md5 mismatch
    except Exception as exc:  # URLError, timeouts, md5 mismatch
        raise DataError(
            f"dataset {NAME}: downloading {URL} into {folder} failed ({' '.join(str(exc).split())}); "
            f"check the network, or place {FOLDER}.zip (md5 {ZIP_MD5}) there and run again"
        ) from exc
    archive = folder / f"{FOLDER}.zip"
    staging = Path(tempfile.mkdtemp(dir=folder, prefix=f".{FOLDER}."))
    try:
        with zipfile.ZipFile(archive) as bundle:
            bundle.extractall(staging)  # zipfile drops absolute paths and '..', so nothing lands outside
        if not (staging / FOLDER / "wnids.txt").is_file():
            raise corrupt_error(NAME, archive, f"the archive holds no {FOLDER}/wnids.txt", hint)
        if (folder / FOLDER).exists():
            raise DataError(f"dataset {NAME}: {folder / FOLDER} exists but has no wnids.txt (an incomplete "
                            "copy); remove it and run again to unzip the archive")
        (staging / FOLDER).rename(folder / FOLDER)
    except (zipfile.BadZipFile, OSError) as exc:
        raise corrupt_error(NAME, archive, f"cannot unzip: {exc}", hint) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
