"""Headless Chromium (Debian's `chromium`) driven over the Chrome DevTools protocol, for UI tests.

No browser download: the system's `chromium` runs headless with a throwaway profile and
DevTools on a free loopback port; pages are read as the user sees them
(``document.body.innerText``), polled until what a test looks for is there.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self):
        self.profile = Path(tempfile.mkdtemp(prefix="posttrain-chromium-"))
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._ids = itertools.count(1)

    def __enter__(self) -> "Browser":
        self.proc = subprocess.Popen(
            [chromium_path(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             f"--user-data-dir={self.profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
        shutil.rmtree(self.profile, ignore_errors=True)

    def page_text(self, url: str, ready, timeout: float = 60) -> str:
        """Open ``url`` in a new tab; its visible text once ``ready(text)`` holds (or, at ``timeout``,
        whatever it shows then: the test's assertion then says what is missing)."""
        from websockets.sync.client import connect

        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(request, timeout=10) as response:
            target = json.loads(response.read())
        with connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=20) as ws:
            self._call(ws, "Page.navigate", url=url)
            deadline = time.monotonic() + timeout
            while True:
                text = self._call(ws, "Runtime.evaluate", expression="document.body ? document.body.innerText : ''",
                                  returnByValue=True)["result"].get("value", "")
                if ready(text) or time.monotonic() > deadline:
                    return text
                time.sleep(0.3)

    def _call(self, ws, method: str, **params) -> dict:
        call_id = next(self._ids)
        ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(ws.recv(timeout=30))
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
