"""Atomic file writes and writable-folder checks: a crash never leaves half a result behind.

Every write goes to a temp file beside its target, is flushed to disk and renamed over it, with
termination signals held back meanwhile (`interrupts.held`). A write that the file system refuses
(a full disk, a quota, a folder made read-only or taken away mid-run) removes its temp file and
raises one StorageError line naming the path, and for a full disk the bytes it needed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from backdoorbench import interrupts
from backdoorbench.errors import ConfigError, DataError, StorageError


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file's bytes (a user's resource file, named in the record)."""
    return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()


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
    return _atomic_write(path, lambda handle: handle.write(data), size=lambda: len(data))


def write_new_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically, but only if `path` does not exist: FileExistsError
    otherwise, and the existing file is untouched (a run's record never replaces another's)."""
    return _atomic_write(path, lambda handle: handle.write(data), exclusive=True, size=lambda: len(data))


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


def _atomic_write(path: str | Path, write: Callable[[BinaryIO], object], exclusive: bool = False,
                  size: Callable[[], int] | None = None) -> Path:
    """`write(handle)` into a temp file beside `path`, fsync, give it the usual file mode, then
    rename it over `path`: readers see the old file or the whole new one, never a part.
    `exclusive`: never over an existing `path` (FileExistsError instead). Termination signals
    wait for the end (interrupts.held); an OSError of the file system is one StorageError line,
    whose full-disk form counts the bytes with `size()`."""
    path = Path(path)
    with interrupts.held():
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(tmp, _umask_mode())
            if exclusive:
                _publish_new(tmp, path)
            else:
                os.replace(tmp, path)
        except BaseException as exc:
            if tmp is not None:
                try:
                    Path(tmp).unlink(missing_ok=True)
                except OSError:
                    pass  # the folder itself went away or became read-only: nothing was left in it
            cause = None if isinstance(exc, FileExistsError) and exclusive else _os_error(exc)
            if cause is not None:
                raise StorageError(storage_message(path, cause, size)) from exc
            raise
    return path


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: itself, or its cause or context (torch's zip writer reports a
    failed write as RuntimeError('unexpected pos ...') with the OSError as its context)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _free_bytes(folder: Path) -> int | None:
    for candidate in (folder, *folder.parents):
        try:
            stat = os.statvfs(candidate)
        except OSError:
            continue
        return stat.f_bavail * stat.f_frsize
    return None


def human_bytes(n: int) -> str:
    """1536 -> '1.5 kB' (powers of 1000, as df -H and most file browsers show them)."""
    value = float(n)
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{int(value)} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def storage_message(path: Path, error: OSError, size: Callable[[], int] | None = None) -> str:
    """One line for a write the file system refused: what happened, to which path, what to do."""
    if error.errno in NO_SPACE:
        what = "no space left on device" if error.errno == errno.ENOSPC else \
            "disk quota exceeded" if error.errno == errno.EDQUOT else "file too large for the file system"
        needed = None
        if size is not None:
            try:
                needed = size()
            except Exception:  # counting is a courtesy: the line must come out whatever happens
                needed = None
        free = _free_bytes(path.parent)
        amounts = [f"it needs {human_bytes(needed)}" if needed is not None else None,
                   f"{human_bytes(free)} free there" if free is not None else None]
        amounts = [a for a in amounts if a]
        detail = f" ({', '.join(amounts)})" if amounts else ""
        return f"{what} writing {path}{detail}; free some space or choose another results_dir"
    if error.errno == errno.EROFS:
        return f"cannot write {path}: the file system is read-only; choose a writable results_dir"
    if error.errno in (errno.EACCES, errno.EPERM):
        return f"cannot write {path}: permission denied; make the folder writable or choose another results_dir"
    if error.errno == errno.ENOENT:
        return f"cannot write {path}: its folder was removed during the run; choose a results_dir that stays"
    return f"cannot write {path}: {error.strerror or error}"


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


class _ByteCounter:
    """A write-only sink that counts what torch.save would write (the size of a file that did not fit)."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, data: bytes) -> int:
        self.n += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def _torch_size(obj: object) -> int:
    import torch

    counter = _ByteCounter()
    torch.save(obj, counter)
    return counter.n


def atomic_torch_save(obj: object, path: str | Path) -> Path:
    """`torch.save` to a temp file beside `path`, fsync, then rename: readers see all or nothing."""
    import torch

    return _atomic_write(path, lambda handle: torch.save(obj, handle), size=lambda: _torch_size(obj))


def torch_load(path: str | Path, **kwargs: Any) -> Any:
    """`torch.load(path, weights_only=True)` (tensors and plain containers, never arbitrary
    pickled objects), with termination signals held until it returns: a handler run inside
    torch's reader would surface as a RuntimeError that reads like a corrupt file."""
    import torch

    with interrupts.held():
        return torch.load(path, weights_only=True, **kwargs)


def load_arrays(path: str | Path) -> dict[str, Any]:
    """The numpy arrays of an .npz file (a run's artifacts), never unpickling; a DataError naming the
    file if it is missing or corrupt."""
    import numpy as np  # here: the rest of this module serves runs that never read an .npz

    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"artifacts file {path} is missing or unreadable ({exc}); rerun the run that wrote it") from exc
