"""Decoded datasets cached as plain uint8 tensors under `<root>/.cache/`, keyed by their sources.

Decoding 110,000 JPEGs takes minutes; mapping one tensor file back takes milliseconds. The
cache file is `<root>/.cache/<name>-<settings key>-<source key>.pt`: the settings key hashes the
cache version and the decode settings (e.g. the resize), the source key hashes the relative path,
size and modification time of every source file, so a re-extracted or edited file is re-read.
A newer cache for the same settings replaces the older one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from backdoorbench.fileio import atomic_torch_save, torch_load

log = logging.getLogger(__name__)

CACHE_VERSION = 1  # bump when a loader's decoding changes, so old caches are not reused
SPLIT_KEYS = ("train_images", "train_labels", "test_images", "test_labels")
Splits = dict[str, Tensor]


def source_key(base: Path, folders: Iterable[Path] = (), files: Iterable[Path] = (),
               suffixes: tuple[str, ...] | None = None) -> str:
    """sha256 (16 hex) over (path relative to `base`, size, mtime in ns) of `files` and of every file
    below `folders` whose name ends in one of `suffixes` (case-insensitive; all files if None).

    Strings and os.scandir instead of Path objects: TinyImageNet has 110,000 files to stat.
    """
    prefix = len(os.fspath(base)) + 1
    entries = []
    for path in files:
        info = os.stat(path)
        entries.append((os.fspath(path)[prefix:], info.st_size, info.st_mtime_ns))
    pending = [os.fspath(folder) for folder in folders]
    while pending:
        with os.scandir(pending.pop()) as listing:
            for entry in listing:
                if entry.is_dir():
                    pending.append(entry.path)
                elif suffixes is None or entry.name.lower().endswith(suffixes):
                    info = entry.stat()
                    entries.append((entry.path[prefix:], info.st_size, info.st_mtime_ns))
    entries.sort()
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]


def settings_key(name: str, settings: dict[str, Any]) -> str:
    blob = json.dumps({"cache_version": CACHE_VERSION, "name": name, **settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def cached_splits(root: Path, name: str, settings: dict[str, Any], sources_key: str, decode: Callable[[], Splits]) -> Splits:
    """The decoded splits of dataset `name`: from the cache when it matches, else `decode()` and store.

    A cache that can't be read is logged and rebuilt; a data root that can't be written is logged
    and the data used uncached, since read-only shared data folders are common on clusters.
    """
    folder = root / ".cache"
    prefix = f"{name}-{settings_key(name, settings)}-"
    path = folder / f"{prefix}{sources_key}.pt"
    if path.is_file():
        splits = _read(path)
        if splits is not None:
            log.info("dataset %s: loaded from cache %s", name, path)
            return splits
    splits = decode()
    try:
        _write_atomic(path, splits)
    except OSError as exc:
        log.warning("dataset %s: could not write the cache %s (%s); the next run decodes again", name, path, exc)
        return splits
    for stale in folder.glob(f"{prefix}*.pt"):
        if stale != path:
            stale.unlink(missing_ok=True)
    return splits


def _read(path: Path) -> Splits | None:
    try:
        # mmap: pages are read when first touched (e.g. on the copy to the GPU), not all up front
        splits = torch_load(path, map_location="cpu", mmap=True)
    except Exception as exc:  # truncated zip, bad pickle, ...: any failure means "rebuild"
        log.warning("cache %s is unreadable (%s); decoding the source files again", path, exc)
        return None
    if not isinstance(splits, dict) or set(splits) != set(SPLIT_KEYS) or not all(
        isinstance(splits[k], Tensor) and splits[k].dtype == (torch.uint8 if k.endswith("images") else torch.int64)
        for k in SPLIT_KEYS
    ):
        log.warning("cache %s does not hold the expected tensors; decoding the source files again", path)
        return None
    return splits


def _write_atomic(path: Path, splits: Splits) -> None:
    # readable by others sharing the data root (the umask's mode, not mkstemp's private 0600)
    atomic_torch_save({k: splits[k].contiguous() for k in SPLIT_KEYS}, path)
