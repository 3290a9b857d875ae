"""Headless Chromium driven over the DevTools protocol on a pipe: the standard library only, so a
browser test needs nothing from PyPI, no driver binary and no network port.

Chromium reads commands on its fd 3 and writes replies and events on its fd 4, one JSON message
each, terminated by a NUL byte (`--remote-debugging-pipe`).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe")


def find_chromium() -> str | None:
    for name in NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


class BrowserError(RuntimeError):
    pass


class Chromium:
    """One headless browser with one page. `errors` collects every uncaught script exception."""

    def __init__(self, executable: str, width: int = 1400, height: int = 900, timeout: float = 60.0):
        self.timeout, self.errors, self._next_id, self._buffer = timeout, [], 0, b""
        self._session: str | None = None
        self._profile = tempfile.mkdtemp(prefix="chromium-profile-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def as_fd3_and_fd4():  # in the child: dup first, so that dup2 never meets its own fd
            read_end, write_end = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(read_end, 3)
            os.dup2(write_end, 4)

        self._process = subprocess.Popen(
            [executable, *FLAGS, f"--user-data-dir={self._profile}", f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=False, preexec_fn=as_fd3_and_fd4)
        os.close(to_browser_r)
        os.close(from_browser_w)
        try:
            page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
            self._session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
            self.page("Runtime.enable")
            self.page("Page.enable")
            self.page("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        except BaseException:
            self.close()
            raise

    def _send(self, method: str, params: dict[str, Any], session: str | None) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if reply.get("method") == "Runtime.exceptionThrown":
                details = reply["params"]["exceptionDetails"]
                self.errors.append(details.get("exception", {}).get("description") or details.get("text"))

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise BrowserError(f"no reply from chromium within {self.timeout:g} s")
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise BrowserError("chromium closed its pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """A browser-level command."""
        return self._send(method, params, None)

    def page(self, method: str, **params: Any) -> dict[str, Any]:
        """A command to the page."""
        return self._send(method, params, self._session)

    def open(self, path: Path) -> None:
        self.page("Page.navigate", url=Path(path).resolve().as_uri())
        deadline = time.monotonic() + self.timeout
        while self.evaluate("document.readyState") != "complete":
            if time.monotonic() > deadline:
                raise BrowserError(f"{path} did not finish loading")
            time.sleep(0.05)

    def evaluate(self, expression: str) -> Any:
        result = self.page("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise BrowserError(f"{expression[:60]}...: {details.get('exception', {}).get('description') or details.get('text')}")
        return result["result"].get("value")

    def click(self, x: float, y: float) -> None:
        """A real left click at viewport coordinates: press and release, as a mouse does."""
        for kind in ("mousePressed", "mouseReleased"):
            self.page("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def screenshot(self, path: Path, full_page: bool = True) -> None:
        params: dict[str, Any] = {"format": "png", "captureBeyondViewport": full_page}
        if full_page:
            size = self.page("Page.getLayoutMetrics")["cssContentSize"]
            params["clip"] = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        Path(path).write_bytes(base64.b64decode(self.page("Page.captureScreenshot", **params)["data"]))

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (BrowserError, OSError):
            pass
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
