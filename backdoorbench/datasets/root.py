"""Where dataset files live, the one-line errors for files that are missing or unreadable, and the
check of the dataset switches every loader shares (number ranges: `backdoorbench.checks`).

Every loader resolves its folder with `data_root(dataset.root)`: the configured value if set,
else the environment variable BACKDOORBENCH_DATA, else ~/.cache/backdoorbench/data.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from backdoorbench.errors import ConfigError, DataError

ENV_VAR = "BACKDOORBENCH_DATA"
DEFAULT_ROOT = "~/.cache/backdoorbench/data"


def data_root(root: str | os.PathLike[str] | None) -> Path:
    """The data folder: `root` if given, else $BACKDOORBENCH_DATA, else ~/.cache/backdoorbench/data."""
    if root is not None and not isinstance(root, (str, os.PathLike)):
        raise ConfigError(f"dataset.root={root!r} is not a path; give a folder, or null for the default")
    chosen = os.fspath(root) if root not in (None, "") else os.environ.get(ENV_VAR) or DEFAULT_ROOT
    return Path(chosen).expanduser().absolute()


def check_flag(name: str, value: object) -> bool:
    """A config switch must be a real boolean: `download=yes` would otherwise read as truthy."""
    if not isinstance(value, bool):
        raise ConfigError(f"dataset.{name}={value!r} is invalid; use true or false")
    return value


def require_files(dataset: str, folder: Path, names: Iterable[str], how_to_get: str) -> None:
    """Raise one DataError listing every file of `names` (relative to `folder`) that is absent."""
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise missing_error(dataset, folder, missing, how_to_get)


def missing_error(dataset: str, folder: Path, missing: Sequence[str], how_to_get: str) -> DataError:
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    return DataError(f"dataset {dataset}: missing {shown} in {folder}; {how_to_get}")


def corrupt_error(dataset: str, path: Path, problem: str, how_to_get: str) -> DataError:
    """A file that exists but can't be read as what it should be (truncated, wrong format, ...)."""
    problem = " ".join(str(problem).split())  # messages from decoders may span lines
    return DataError(f"dataset {dataset}: {path} is unreadable ({problem}); {how_to_get}")


def download_hint(dataset: str, by_hand: str) -> str:
    """The second half of every missing/corrupt message: the command that fetches the files."""
    return f"get the files with `python -m backdoorbench dataset={dataset} dataset.download=true`, or by hand: {by_hand}"
