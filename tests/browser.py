"""Headless Chromium (Debian's ``chromium``) driven over the DevTools protocol: one persistent page
that really runs its scripts and polls, read through ``Runtime.evaluate``, photographed with
``Page.captureScreenshot``; every request the page makes is recorded, and every exception its
scripts leave uncaught."""
from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import requests
import websocket

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0"]


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, tmp: Path, width: int = 1280, height: int = 1400, timeout_s: float = 30):
        profile = tmp / "chromium-profile"  # fresh: no state from any earlier run
        profile.mkdir(parents=True)
        self.log = open(tmp / "chromium.log", "w")
        self.proc = subprocess.Popen([chromium_path(), *FLAGS, f"--user-data-dir={profile}",
                                      f"--window-size={width},{height}", "about:blank"],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.ids = itertools.count(1)
        self.requests: list[str] = []
        self.exceptions: list[str] = []  # uncaught in the page's scripts (promises included)
        self.ws = websocket.create_connection(self._page_socket(profile, timeout_s), timeout=timeout_s,
                                              suppress_origin=True)
        self.call("Page.enable")
        self.call("Network.enable")
        self.call("Runtime.enable")

    def _page_socket(self, profile: Path, timeout_s: float) -> str:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while not port_file.is_file() or not port_file.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit {self.proc.poll()})")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = requests.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        return next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")

    def call(self, method: str, **params) -> dict:
        """One DevTools command; events that arrive meanwhile are looked at for requests."""
        call_id = next(self.ids)
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("method") == "Network.requestWillBeSent":
                self.requests.append(msg["params"]["request"]["url"])
            if msg.get("method") == "Runtime.exceptionThrown":
                details = msg["params"]["exceptionDetails"]
                self.exceptions.append(details.get("exception", {}).get("description") or details.get("text", ""))
            if msg.get("id") == call_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def viewport(self, width: int, height: int, mobile: bool = False, scale: float = 1) -> None:
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=scale,
                  mobile=mobile)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            _signal_group(self.proc.pid, signal.SIGTERM)  # chromium and the helpers it started
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            _signal_group(self.proc.pid, signal.SIGKILL)  # any helper that outlived the browser
            self.log.close()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
