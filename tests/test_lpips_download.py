"""eval.lpips=auto fetches the AlexNet weights once, checked against the hash in their file name,
from a stand-in served on 127.0.0.1 (never the internet); offline, off and a path."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import logging
import re
import socket
import threading
import warnings
from pathlib import Path

import pytest
import torch

from backdoorbench.errors import ConfigError
from backdoorbench.metrics import lpips_weights
from backdoorbench.metrics.lpips_weights import (
    LPIPS_URL_ENV,
    check_lpips_setting,
    resolve_alexnet_weights,
)
from backdoorbench.metrics.stealth import LpipsUnavailableWarning, stealth_metrics

# AlexNet's `features` (what LPIPS uses): torchvision's keys and shapes, ~10 MB instead of 240.
ALEXNET_FEATURES = {0: (64, 3, 11, 11), 3: (192, 64, 5, 5), 6: (384, 192, 3, 3), 8: (256, 384, 3, 3),
                    10: (256, 256, 3, 3)}


@pytest.fixture(scope="module")
def standin() -> tuple[bytes, str]:
    """A seeded stand-in weight file and the name torch hub's check expects: alexnet-owt-<sha256[:8]>.pth."""
    g = torch.Generator().manual_seed(0)
    state = {}
    for index, shape in ALEXNET_FEATURES.items():
        state[f"features.{index}.weight"] = torch.randn(shape, generator=g) * 0.05
        state[f"features.{index}.bias"] = torch.randn(shape[0], generator=g) * 0.01
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    return data, f"alexnet-owt-{hashlib.sha256(data).hexdigest()[:8]}.pth"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # the requests are counted, not printed
        self.server.requests.append(self.path)


@pytest.fixture(scope="module")
def server(standin, tmp_path_factory):
    """An HTTP server on 127.0.0.1 serving the stand-in under its own name and under a wrong one."""
    data, name = standin
    folder = tmp_path_factory.mktemp("served")
    (folder / name).write_bytes(data)
    (folder / "alexnet-owt-00000000.pth").write_bytes(data)  # a name whose hash the file does not have
    (folder / "alexnet.pth").write_bytes(data)  # no hash in the name: nothing to check it against
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(folder)))
    httpd.requests = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty torch hub folder for this test, and no weights file named by the environment."""
    monkeypatch.setattr(torch.hub, "_hub_dir", torch.hub._hub_dir)  # set_dir's global, restored after
    torch.hub.set_dir(str(tmp_path / "hub"))
    monkeypatch.delenv(lpips_weights.LPIPS_WEIGHTS_ENV, raising=False)
    return tmp_path / "hub" / "checkpoints"


def _url(server, name: str) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}/{name}"


def _images() -> tuple[torch.Tensor, torch.Tensor]:
    clean = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return clean, clean.flip(-1)


def _lpips_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, LpipsUnavailableWarning)]


def test_auto_downloads_once_into_the_torch_hub_cache(standin, server, hub, monkeypatch, caplog) -> None:
    data, name = standin
    monkeypatch.setenv(LPIPS_URL_ENV, _url(server, name))
    before = len(server.requests)
    caplog.set_level(logging.INFO, logger=lpips_weights.__name__)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LpipsUnavailableWarning)
        first = stealth_metrics(*_images())
        second = stealth_metrics(*_images())
    assert server.requests[before:] == [f"/{name}"]  # fetched once, then read from the cache
    assert sorted(p.name for p in hub.iterdir()) == [name]  # no temp file left beside it
    assert (hub / name).read_bytes() == data
    assert first["lpips"] is not None and first["lpips_reason"] is None and first["lpips"]["mean"] > 0
    assert second["lpips"] == first["lpips"]
    (line,) = [r.getMessage() for r in caplog.records if r.name == lpips_weights.__name__]
    assert line.startswith("LPIPS: downloaded the AlexNet ImageNet weights") and str(hub / name) in line


@pytest.mark.parametrize(("served", "message"), [
    ("alexnet-owt-00000000.pth", "was refused: its sha256 does not start with 00000000"),
    ("alexnet.pth", "its file name carries no sha256 prefix to check"),
    ("alexnet-owt-12345678.pth", r"could not be downloaded from .*HTTP Error 404"),
])
def test_a_wrong_file_is_refused_in_one_line(served, message, server, hub, monkeypatch) -> None:
    monkeypatch.setenv(LPIPS_URL_ENV, _url(server, served))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = stealth_metrics(*_images())
    (line,) = _lpips_warnings(caught)
    assert line.startswith("LPIPS not computed: ") and "\n" not in line
    assert re.search(message, line)
    assert result["lpips"] is None and result["lpips_reason"] in line
    assert not hub.exists() or list(hub.iterdir()) == []  # nothing kept under the name, no partial file


def test_offline_says_so_in_one_line(hub, monkeypatch, caplog) -> None:
    with socket.socket() as probe:  # a port that was free a moment ago: nobody answers there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/{lpips_weights.ALEXNET_FILE}"
    monkeypatch.setenv(LPIPS_URL_ENV, url)
    caplog.set_level(logging.DEBUG, logger=lpips_weights.__name__)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = stealth_metrics(*_images())
    (line,) = _lpips_warnings(caught)
    assert not caplog.records  # the warning is the one line
    assert "\n" not in line and f"could not be downloaded from {url}: the network did not answer" in line
    assert str(hub / lpips_weights.ALEXNET_FILE) in line and "eval.lpips=<path>" in line
    assert result["lpips"] is None and result["lpips_reason"] in line
    assert result["ssim"] is not None  # the other metrics are still measured


@pytest.mark.parametrize("off", ["off", "OFF", "False"])  # "False": YAML's reading of a bare off
def test_off_skips_lpips_without_a_request_or_a_warning(off, server, hub, monkeypatch, standin) -> None:
    monkeypatch.setenv(LPIPS_URL_ENV, _url(server, standin[1]))
    before = len(server.requests)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LpipsUnavailableWarning)
        result = stealth_metrics(*_images(), lpips=off)
    assert result["lpips"] is None and result["lpips_reason"] == "off"
    assert len(server.requests) == before and not hub.exists()


def test_a_path_is_used_as_given_without_a_request(standin, server, hub, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(LPIPS_URL_ENV, _url(server, standin[1]))
    path = tmp_path / "my_alexnet.pth"
    path.write_bytes(standin[0])
    before = len(server.requests)
    assert resolve_alexnet_weights(str(path)) == (path, None)  # stealth_metrics(lpips=path) loads it: test_stealth
    assert len(server.requests) == before and not hub.exists()


def test_the_setting_is_checked_before_a_run(tmp_path, monkeypatch) -> None:
    for good in ("auto", "off", "False", None):
        check_lpips_setting(good)
    weights = tmp_path / "alexnet.pth"
    weights.write_bytes(b"")
    check_lpips_setting(str(weights))
    with pytest.raises(ConfigError, match=r"eval.lpips='.*nope.pth' is not a file; use auto .*, off, or the path"):
        check_lpips_setting(str(tmp_path / "nope.pth"))
    monkeypatch.setenv(lpips_weights.LPIPS_WEIGHTS_ENV, str(tmp_path / "gone.pth"))
    with pytest.raises(ConfigError, match=f"{lpips_weights.LPIPS_WEIGHTS_ENV}='.*gone.pth' is not a file"):
        check_lpips_setting("auto")


def test_the_old_key_gets_its_new_name_and_run_ids_stay() -> None:
    from omegaconf import OmegaConf

    import backdoorbench
    from backdoorbench.config import run_config_hash
    from backdoorbench.suggest import key_hint

    # cli's near-miss line: "eval.lpips_weights is not a setting; <this>" (run end to end in the slow test)
    assert key_hint("eval.lpips_weights", OmegaConf.create({"eval": {"lpips": "auto"}})) == \
        "it was renamed: write eval.lpips=<path> (or auto, off)"
    defaults = OmegaConf.load(Path(backdoorbench.__file__).parent / "conf" / "config.yaml")
    assert defaults.eval.lpips == "auto"
    config = {"seed": 0, "attack": {"name": "badnets"}, "eval": OmegaConf.to_container(defaults.eval)}
    old = json.loads(json.dumps(config))  # a record made before eval.lpips: eval.lpips_weights null
    del old["eval"]["lpips"]
    old["eval"]["lpips_weights"] = None
    off = json.loads(json.dumps(config))
    off["eval"]["lpips"] = "off"
    assert run_config_hash(config) == run_config_hash(old) == run_config_hash(off)


@pytest.mark.slow
def test_a_run_records_lpips_from_the_download_and_null_offline(standin, server, tmp_path, monkeypatch) -> None:
    """`python -m backdoorbench` end to end: the record's LPIPS comes from the loopback download;
    offline the run says so in one line and records null with the reason."""
    from tests.conftest import run_cli

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.delenv(lpips_weights.LPIPS_WEIGHTS_ENV, raising=False)

    def run(url: str, name: str) -> tuple[dict, str]:
        monkeypatch.setenv(LPIPS_URL_ENV, url)
        done = run_cli("trainer.epochs=0", "eval.stealth_images=8", f"results_dir={tmp_path / name}")
        assert done.returncode == 0, done.stderr[-2000:]
        (record,) = (tmp_path / name / "runs").rglob("*.json")
        return json.loads(record.read_text()), done.stdout + done.stderr

    online, _ = run(_url(server, standin[1]), "online")
    assert online["stealth"]["lpips"] is not None and online["stealth"]["lpips_reason"] is None
    assert (tmp_path / "torch" / "hub" / "checkpoints" / standin[1]).read_bytes() == standin[0]
    offline, output = run(f"http://127.0.0.1:0/{lpips_weights.ALEXNET_FILE}", "offline")
    assert offline["stealth"]["lpips"] is None and "the network did not answer" in offline["stealth"]["lpips_reason"]
    (line,) = [line for line in output.splitlines() if "LPIPS" in line]  # offline: one line says so
    assert "LPIPS not computed" in line
    old = run_cli("eval.lpips_weights=/some/alexnet.pth", f"results_dir={tmp_path / 'old'}")
    assert old.returncode == 2 and old.stderr.strip().splitlines()[-1] == (
        "error: eval.lpips_weights is not a setting; it was renamed: write eval.lpips=<path> (or auto, off)")
    assert not (tmp_path / "old").exists()  # refused before anything ran


def test_the_written_out_url_is_torchvisions():
    from torchvision.models import AlexNet_Weights

    from backdoorbench.metrics.lpips_weights import ALEXNET_URL
    assert ALEXNET_URL == AlexNet_Weights.IMAGENET1K_V1.url
