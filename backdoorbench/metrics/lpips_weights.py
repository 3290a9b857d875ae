"""Where LPIPS's AlexNet ImageNet weights come from: `eval.lpips` is `auto`, `off` or a file's path.

`auto` (the default) takes, in turn, the file named by $BACKDOORBENCH_LPIPS_ALEXNET, the one in
torch hub's checkpoint folder (`torch.hub.get_dir()/checkpoints`, where torchvision keeps it), and
otherwise downloads torchvision's `AlexNet_Weights.IMAGENET1K_V1` there once, as torchvision's
weights API does: into a temp file beside the target, renamed only once its sha256 matches the
prefix in the file name (alexnet-owt-**7be5be79**.pth). $BACKDOORBENCH_LPIPS_URL names another
source (a mirror); its file name must carry the hash prefix too. Where the download fails (no
network, a refused file), LPIPS is null with the reason, never a number from an untrained network.
The file is read with `fileio.torch_load` (weights only) by `stealth.load_lpips`.
"""

from __future__ import annotations

import http.client
import logging
import os
import socket
import sys
import urllib.error
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import torch

from backdoorbench.errors import ConfigError, DataError

log = logging.getLogger(__name__)


# torchvision's `AlexNet_Weights.IMAGENET1K_V1.url`, written out: importing torchvision.models costs ~3 s and
# every command's preflight imports this module (tests/test_lpips_download.py holds the two equal).
ALEXNET_URL = "https://download.pytorch.org/models/alexnet-owt-7be5be79.pth"
ALEXNET_FILE = ALEXNET_URL.rsplit("/", 1)[-1]
LPIPS_WEIGHTS_ENV = "BACKDOORBENCH_LPIPS_ALEXNET"
LPIPS_URL_ENV = "BACKDOORBENCH_LPIPS_URL"
DOWNLOAD_TIMEOUT_S = 60.0  # per connect and per read: a network that drops packets must not hang the run
# YAML reads a bare `off` as false, which the string schema then holds as "False".
OFF_VALUES = ("off", "false")


def lpips_source_url() -> str:
    """The URL `auto` downloads from: $BACKDOORBENCH_LPIPS_URL, else torchvision's."""
    return os.environ.get(LPIPS_URL_ENV) or ALEXNET_URL


def _file_name(url: str) -> str:
    return Path(urlparse(url).path).name


def alexnet_hub_path(url: str | None = None) -> Path:
    """Where torchvision itself keeps (and `auto` downloads) the weights of `url` (default: the source)."""
    return Path(torch.hub.get_dir()) / "checkpoints" / _file_name(url or lpips_source_url())


def is_off(setting: object) -> bool:
    """Whether `eval.lpips` switches LPIPS off."""
    return str(setting).strip().lower() in OFF_VALUES


def check_lpips_setting(setting: object) -> None:
    """Refuse, before any data loads, an `eval.lpips` that is neither auto, off nor an existing file."""
    if is_off(setting):
        return
    if setting is None or str(setting).strip().lower() == "auto":
        env = os.environ.get(LPIPS_WEIGHTS_ENV)
        if env and not Path(env).expanduser().is_file():
            raise ConfigError(f"{LPIPS_WEIGHTS_ENV}={env!r} is not a file; give the path of {ALEXNET_FILE} "
                              f"({ALEXNET_URL}), or unset it to use torch hub's cache")
        return
    if not Path(str(setting)).expanduser().is_file():
        raise ConfigError(f"eval.lpips={str(setting)!r} is not a file; use auto (torch hub's cache, downloaded once), "
                          f"off, or the path of {ALEXNET_FILE} ({ALEXNET_URL})")


def _explicit_file(source: str, value: str | os.PathLike) -> Path:
    path = Path(value).expanduser()
    if not path.is_file():
        # a typo must fail loudly rather than quietly drop LPIPS
        raise DataError(f"{source}={str(path)!r} is not a file; give the path of {ALEXNET_FILE} ({ALEXNET_URL})")
    return path


def resolve_alexnet_weights(setting: str | os.PathLike | None = "auto") -> tuple[Path | None, str | None]:
    """(the weights file, None), or (None, why LPIPS can't be computed) for `eval.lpips` = `setting`.

    `auto` (or None) may download once; `off` gives the reason "off"; a path must be a file.
    """
    if setting is not None and is_off(setting):
        return None, "off"
    if setting is not None and str(setting).strip().lower() != "auto":
        return _explicit_file("eval.lpips", setting), None
    if os.environ.get(LPIPS_WEIGHTS_ENV):
        return _explicit_file(LPIPS_WEIGHTS_ENV, os.environ[LPIPS_WEIGHTS_ENV]), None
    url = lpips_source_url()
    hub = alexnet_hub_path(url)
    if hub.is_file():
        return hub, None
    try:
        return download_alexnet(url, hub), None
    except DownloadError as exc:
        return None, (f"AlexNet ImageNet weights not found and {exc}; place {hub.name} at {hub}, "
                      f"or give its path as eval.lpips=<path> or {LPIPS_WEIGHTS_ENV}")


class DownloadError(Exception):
    """The weights could not be fetched or were refused; the message says which and why."""


def _line(value: object) -> str:
    return " ".join(str(value).split())


@contextmanager
def _socket_timeout(seconds: float):
    # torch.hub's urlopen takes no timeout; its sockets take the process default, restored after.
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(previous)


def download_alexnet(url: str, target: Path) -> Path:
    """Fetch `url` to `target` through torch hub's downloader (temp file, sha256 prefix from the
    file name checked, then renamed): a wrong or partial file never takes the target's name."""
    match = torch.hub.HASH_REGEX.search(_file_name(url))
    if match is None or not match.group(1):
        raise DownloadError(f"{url} is not downloaded: its file name carries no sha256 prefix to check "
                            f"(torchvision's names do, e.g. {ALEXNET_FILE})")
    prefix = match.group(1)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _socket_timeout(DOWNLOAD_TIMEOUT_S):
            torch.hub.download_url_to_file(url, str(target), hash_prefix=prefix, progress=sys.stderr.isatty())
    except RuntimeError as exc:  # torch hub's 'invalid hash value (expected "...", got "...")'
        if "hash" not in str(exc):
            raise
        raise DownloadError(f"the file downloaded from {url} was refused: its sha256 does not start with {prefix} "
                            f"({_line(exc)})") from None
    except urllib.error.HTTPError as exc:  # the server answered, without the file
        raise DownloadError(f"could not be downloaded from {url} ({_line(exc)})") from None
    except urllib.error.URLError as exc:  # no network, no DNS, a refused connection
        raise DownloadError(f"could not be downloaded from {url}: the network did not answer ({_line(exc.reason)})") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:  # timeout, reset, read-only cache, bad URL
        raise DownloadError(f"could not be downloaded from {url} ({type(exc).__name__}: {_line(exc)})") from None
    # one line, after the fact: offline, the warning of stealth_metrics is then the only line
    log.info("LPIPS: downloaded the AlexNet ImageNet weights (%.0f MB, sha256 %s...) from %s into %s, once",
             target.stat().st_size / 2**20, prefix, url, target)
    return target


__all__ = [
    "ALEXNET_FILE",
    "ALEXNET_URL",
    "LPIPS_URL_ENV",
    "LPIPS_WEIGHTS_ENV",
    "alexnet_hub_path",
    "check_lpips_setting",
    "download_alexnet",
    "resolve_alexnet_weights",
]
