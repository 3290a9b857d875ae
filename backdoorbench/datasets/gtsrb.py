"""gtsrb: the German Traffic Sign Recognition Benchmark (Stallkamp et al., IJCNN 2011), 43 classes."""

from __future__ import annotations

import csv
from pathlib import Path

import torch
import torchvision

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

NAME = "gtsrb"
NUM_CLASSES = 43
CLASS_FOLDERS = [f"{label:05d}" for label in range(NUM_CLASSES)]
# The normalization commonly used for GTSRB at 32x32 (training-set statistics).
GTSRB_MEAN = (0.3403, 0.3121, 0.3214)
GTSRB_STD = (0.2724, 0.2608, 0.2669)
SOURCE = ("GTSRB-Training_fixed.zip, GTSRB_Final_Test_Images.zip and GTSRB_Final_Test_GT.zip from "
          "https://sid.erda.dk/public/archives/daaeac0d7ce1152aea9b61d9f1e19370/")


def load_gtsrb(
    root: str | None = None, download: bool = False, image_size: int = 32, crop_padding: int = 4
) -> ImageDataset:
    """The official GTSRB split: 39,209 training and 12,630 test signs, resized to `image_size`.

    Files: torchvision's layout, `<root>/gtsrb/GTSRB/Training/<00000..00042>/*.ppm`,
    `<root>/gtsrb/GTSRB/Final_Test/Images/*.ppm` and `<root>/gtsrb/GT-final_test.csv`;
    torchvision.datasets.GTSRB lists them (training labels from the class folders, test labels from
    the CSV's ClassId) and downloads them with `download=true`. Resize: each whole image, margin
    included, goes to image_size x image_size with PIL's antialiased bilinear filter, as the
    `transforms.Resize((32, 32))` on PIL images in the WaNet and BackdoorBench code does; we do not
    crop to the annotated ROI first, since those papers' numbers come from whole images.
    num_classes is 43 whatever the files hold, and all 43 class folders must be present: a missing
    folder would silently shift torchvision's folder-order labels.
    """
    checks.integer("dataset", "image_size", image_size, 16, 256, hint="32 in the papers")
    checks.integer("dataset", "crop_padding", crop_padding, 0, image_size // 2)
    folder = data_root(root)
    base = folder / "gtsrb"
    hint = download_hint(NAME, f"extract {SOURCE} into {base}")
    training, test_images, test_csv = base / "GTSRB" / "Training", base / "GTSRB" / "Final_Test" / "Images", base / "GT-final_test.csv"
    if check_flag("download", download):
        _download(folder)
    _check_layout(base, training, test_images, hint)
    require_files(NAME, base, [test_csv.name], hint)
    key = source_key(folder, folders=[training, test_images], files=[test_csv], suffixes=(".ppm",))
    splits = cached_splits(folder, NAME, {"image_size": image_size}, key, lambda: _decode(folder, image_size, hint))
    return ImageDataset(
        name=NAME,
        train=Split(splits["train_images"], splits["train_labels"]),
        test=Split(splits["test_images"], splits["test_labels"]),
        num_classes=NUM_CLASSES,
        mean=GTSRB_MEAN,
        std=GTSRB_STD,
        hflip=False,  # a mirrored sign can be another sign (keep left / keep right)
        crop_padding=crop_padding,
    )


def _check_layout(base: Path, training: Path, test_images: Path, hint: str) -> None:
    for path in (training, test_images):
        if not path.is_dir():
            raise missing_error(NAME, base, [str(path.relative_to(base)) + "/"], hint)
    present = {entry.name for entry in training.iterdir() if entry.is_dir()}
    missing = [name for name in CLASS_FOLDERS if name not in present]
    if missing:
        raise missing_error(NAME, training, [f"{name}/" for name in missing], hint)
    extra = sorted(present - set(CLASS_FOLDERS))
    if extra:
        raise DataError(f"dataset {NAME}: unexpected folders {', '.join(extra)} in {training}; it must hold "
                        f"only the class folders 00000..00042 (they define the labels), so move them out")


def _samples(folder: Path, split: str, hint: str) -> list[tuple[str, int]]:
    """(path, label) of every image of `split`, as torchvision parses the folders and the CSV."""
    base = folder / "gtsrb"
    try:
        dataset = torchvision.datasets.GTSRB(str(folder), split=split, download=False)
    except FileNotFoundError as exc:  # a class folder without any .ppm
        raise DataError(f"dataset {NAME}: {' '.join(str(exc).split())} under {base}; {hint}") from exc
    except (KeyError, ValueError, TypeError, csv.Error, UnicodeDecodeError) as exc:
        raise corrupt_error(NAME, base / "GT-final_test.csv", f"not the GTSRB test annotations "
                            f"(';'-separated, with Filename and ClassId columns): {exc!r}", hint) from exc
    # torchvision keeps the parsed list in `_samples` (stable since 0.12); reading it lets us decode
    # in threads and name any unreadable file, which its per-item __getitem__ does not.
    return list(dataset._samples)


def _decode(folder: Path, image_size: int, hint: str) -> dict[str, torch.Tensor]:
    out = {}
    for split in ("train", "test"):
        samples = _samples(folder, split, hint)
        paths = [Path(path) for path, _ in samples]
        labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
        if split == "test":
            _check_test_annotations(folder / "gtsrb", paths, labels, hint)
        out[f"{split}_images"] = decode_images(paths, image_size, resize=True, dataset=NAME, how_to_get=hint,
                                               desc=f"decoding GTSRB {split}")
        out[f"{split}_labels"] = labels
    return out


def _check_test_annotations(base: Path, paths: list[Path], labels: torch.Tensor, hint: str) -> None:
    csv_path = base / "GT-final_test.csv"
    if not paths:
        raise corrupt_error(NAME, csv_path, "it lists no images", hint)
    bad = labels[(labels < 0) | (labels >= NUM_CLASSES)]
    if len(bad):
        raise corrupt_error(NAME, csv_path, f"ClassId {int(bad[0])} is outside 0..{NUM_CLASSES - 1}", hint)
    missing = [path.name for path in paths if not path.is_file()]
    if missing:
        raise missing_error(NAME, paths[0].parent, missing, f"they are listed in {csv_path}; {hint}")


def _download(folder: Path) -> None:
    for split in ("train", "test"):
        try:
            torchvision.datasets.GTSRB(str(folder), split=split, download=True)
        except Exception as exc:  # URLError, timeouts, md5 mismatch, bad archive
            raise DataError(
                f"dataset {NAME}: downloading the {split} split into {folder / 'gtsrb'} failed "
                f"({' '.join(str(exc).split())}); check the network, or fetch {SOURCE}"
            ) from exc
