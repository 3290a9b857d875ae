"""Atomic file writes and writable-folder checks: a crash never leaves half a result behind."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from backdoorbench.errors import ConfigError


def _umask_mode() -> int:
    """The mode a plain open() would give a new file (mkstemp's 0600 would hide shared results)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` to a temp file beside `path`, flush it to disk, then rename it over `path`."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to a temp file beside `path`, flush it to disk, then rename it over `path`."""
    return _atomic_write(path, lambda handle: handle.write(data))


def write_new_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically, but only if `path` does not exist: FileExistsError
    otherwise, and the existing file is untouched (a run's record never replaces another's)."""
    return _atomic_write(path, lambda handle: handle.write(data), exclusive=True)


def _publish_new(tmp: str, path: Path) -> None:
    """Give the finished temp file the name `path` unless that name exists (FileExistsError).
    A hard link is atomic and never replaces; where the file system has none (some network and
    FUSE mounts), the name is claimed with O_EXCL and the whole file renamed over the claim."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def _atomic_write(path: str | Path, write: Callable[[BinaryIO], object], exclusive: bool = False) -> Path:
    """`write(handle)` into a temp file beside `path`, fsync, give it the usual file mode, then
    rename it over `path`: readers see the old file or the whole new one, never a part.
    `exclusive`: never over an existing `path` (FileExistsError instead)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, _umask_mode())
        if exclusive:
            _publish_new(tmp, path)
        else:
            os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def ensure_writable_dir(path: str | Path, what: str = "results_dir") -> Path:
    """Create `path` if needed and prove a file can be written in it; else one clear ConfigError."""
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{what}={str(path)!r} cannot be written ({exc.strerror or exc}); choose a folder you can write to"
        ) from exc
    return path


def atomic_torch_save(obj: object, path: str | Path) -> Path:
    """`torch.save` to a temp file beside `path`, fsync, then rename: readers see all or nothing."""
    import torch

    return _atomic_write(path, lambda handle: torch.save(obj, handle))
