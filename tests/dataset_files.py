"""Writers of tiny datasets in the real on-disk formats (IDX+gzip, CIFAR pickles, PPM+CSV, JPEG trees).

Each writer lays its files out under `root` exactly as the official archive extracts (and as
torchvision reads them), and returns the labels and images it wrote so tests can compare.
Images are seeded random noise, except where a test needs to know the decoded value.
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import numpy as np
from PIL import Image


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file of unsigned bytes: magic 0x0000080N, N big-endian dimensions, the raw data."""
    header = bytes((0, 0, 0x08, array.ndim)) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_mnist(root: Path, train_per_class: int = 4, test_per_class: int = 2, gz: bool = True, seed: int = 0) -> dict:
    """`root/MNIST/raw/*-ubyte.gz` (as downloaded) or the decompressed files (`gz=False`)."""
    rng = np.random.default_rng(seed)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, per_class in (("train", train_per_class), ("t10k", test_per_class)):
        labels = np.tile(np.arange(10, dtype=np.uint8), per_class)
        images = rng.integers(0, 256, size=(len(labels), 28, 28), dtype=np.uint8)
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            name = f"{split}-{kind}-ubyte"
            data = idx_bytes(array)
            if gz:
                (raw / f"{name}.gz").write_bytes(gzip.compress(data))
            else:
                (raw / name).write_bytes(data)
        written[split] = (images, labels)
    return written


def write_cifar10(root: Path, per_batch: int = 8, n_test: int = 20, seed: int = 0) -> dict:
    """`root/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}` as protocol-2 pickles."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for index, name in enumerate(names):
        n = n_test if name == "test_batch" else per_batch
        labels = [(index + i) % 10 for i in range(n)]
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        entry = {"batch_label": f"{name} of 6", "labels": labels, "data": data,
                 "filenames": [f"img_{index}_{i}.png" for i in range(n)]}
        with open(folder / name, "wb") as handle:
            pickle.dump(entry, handle, protocol=2)
        written[name] = (data, np.asarray(labels))
    meta = {"label_names": ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"],
            "num_cases_per_batch": per_batch, "num_vis": 3072}
    with open(folder / "batches.meta", "wb") as handle:
        pickle.dump(meta, handle, protocol=2)
    return written


GTSRB_SIZES = [(29, 30), (40, 36), (32, 32), (53, 61)]  # real GTSRB images range from 15 to 250 px


def write_gtsrb(root: Path, train_per_class: int = 2, n_test: int = 20, seed: int = 0) -> dict:
    """`root/gtsrb/GTSRB/Training/000NN/*.ppm` (+ GT-000NN.csv), `Final_Test/Images/*.ppm`, `GT-final_test.csv`."""
    rng = np.random.default_rng(seed)
    base = root / "gtsrb"
    written = {"train": [], "test": []}
    for label in range(43):
        folder = base / "GTSRB" / "Training" / f"{label:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        rows = ["Filename;Width;Height;Roi.X1;Roi.Y1;Roi.X2;Roi.Y2;ClassId"]
        for i in range(train_per_class):
            name = f"00000_{i:05d}.ppm"
            image = _noise(rng, GTSRB_SIZES[(label + i) % len(GTSRB_SIZES)])
            image.save(folder / name, format="PPM")
            rows.append(f"{name};{image.width};{image.height};5;5;{image.width - 5};{image.height - 5};{label}")
            written["train"].append((folder / name, label))
        (folder / f"GT-{label:05d}.csv").write_text("\n".join(rows) + "\n")
    images = base / "GTSRB" / "Final_Test" / "Images"
    images.mkdir(parents=True, exist_ok=True)
    rows = ["Filename;Width;Height;Roi.X1;Roi.Y1;Roi.X2;Roi.Y2;ClassId"]
    for i in range(n_test):
        name, label = f"{i:05d}.ppm", (7 * i) % 43
        image = _noise(rng, GTSRB_SIZES[i % len(GTSRB_SIZES)])
        image.save(images / name, format="PPM")
        rows.append(f"{name};{image.width};{image.height};5;5;{image.width - 5};{image.height - 5};{label}")
        written["test"].append((images / name, label))
    (base / "GT-final_test.csv").write_text("\n".join(rows) + "\n")
    return written


def tiny_wnids(count: int = 200) -> list[str]:
    return [f"n{10_000_000 + 7919 * i:08d}" for i in range(count)]


def write_tiny_imagenet(root: Path, train_per_class: int = 1, n_val: int = 20, seed: int = 0) -> dict:
    """`root/tiny-imagenet-200/{wnids.txt, words.txt, train/<wnid>/images/*.JPEG, val/...}`.

    wnids.txt is written in a shuffled order, as the official one is not sorted, and the first
    training image is grayscale, as some official ones are.
    """
    rng = np.random.default_rng(seed)
    tree = root / "tiny-imagenet-200"
    wnids = tiny_wnids()
    shuffled = [wnids[i] for i in rng.permutation(len(wnids))]
    tree.mkdir(parents=True, exist_ok=True)
    (tree / "wnids.txt").write_text("\n".join(shuffled) + "\n")
    (tree / "words.txt").write_text("".join(f"{w}\tthing {i}\n" for i, w in enumerate(wnids)))
    written = {"train": [], "val": []}
    for label, wnid in enumerate(wnids):
        images = tree / "train" / wnid / "images"
        images.mkdir(parents=True, exist_ok=True)
        boxes = []
        for i in range(train_per_class):
            name = f"{wnid}_{i}.JPEG"
            image = _noise(rng, (64, 64))
            if label == 0 and i == 0:
                image = image.convert("L")
            image.save(images / name, format="JPEG", quality=95)
            boxes.append(f"{name}\t0\t0\t63\t63")
            written["train"].append((images / name, label))
        (tree / "train" / wnid / f"{wnid}_boxes.txt").write_text("\n".join(boxes) + "\n")
    val_images = tree / "val" / "images"
    val_images.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n_val):
        name, label = f"val_{i}.JPEG", (11 * i) % len(wnids)
        _noise(rng, (64, 64)).save(val_images / name, format="JPEG", quality=95)
        lines.append(f"{name}\t{wnids[label]}\t1\t2\t60\t61")
        written["val"].append((val_images / name, label))
    (tree / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    test_images = tree / "test" / "images"  # unlabelled in the official archive; never read
    test_images.mkdir(parents=True, exist_ok=True)
    _noise(rng, (64, 64)).save(test_images / "test_0.JPEG", format="JPEG")
    return written


def _noise(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """Smooth random colours (noise upsampled), so JPEG keeps them close and resizing changes them."""
    width, height = size
    coarse = rng.integers(0, 256, size=(max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)
