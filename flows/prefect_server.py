"""The embedded Prefect API server, started by posttrain in its own session.

With no ``PREFECT_API_URL``, Prefect would start its own temporary server as a child in
the same process group, so a Ctrl-C in the terminal reaches it too: the server dies
first, and the interrupted flow then spends a minute retrying to report that it stopped
(measured: 70 s, ending in ``httpx.ConnectError``). posttrain starts the same server
(Prefect's ASGI app under uvicorn, on the same SQLite database in ``$PREFECT_HOME``) in a
new session, so Ctrl-C reaches posttrain alone; the server is told to die with its parent
(``PR_SET_PDEATHSIG``), so even a ``kill -9`` of posttrain leaves no server behind, and it
is stopped by PID when the run ends.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

# Run in the server's own interpreter before it becomes uvicorn: ask the kernel for SIGTERM
# when posttrain dies (PR_SET_PDEATHSIG = 1), then exec. (No preexec_fn: unsafe with threads.)
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n    ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM)\nexcept OSError:\n    pass\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedPrefectServer:
    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.process: subprocess.Popen | None = None
        self.port: int | None = None

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def start(self, timeout: float) -> None:
        import httpx

        prefect_dir = Path(importlib.util.find_spec("prefect").origin).parent
        self.port = _free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
               "PREFECT__SERVER_FINAL": "1"}
        env.pop("PREFECT_API_URL", None)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _DIE_WITH_PARENT, "-m", "uvicorn", "--app-dir", str(prefect_dir.parent), "--factory",
                 "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                 "--log-level", "error", "--lifespan", "on"],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        with httpx.Client() as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the Prefect API server exited with status {self.process.returncode}; "
                                       f"its log: {self.log_path}")
                try:
                    if client.get(f"{self.api_url}/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the Prefect API server did not answer within {timeout:.0f} s; its log: {self.log_path}")

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


def _configured_api_url() -> str | None:
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    if "prefect" in sys.modules:  # e.g. inside prefect_test_harness
        from prefect.settings import get_current_settings

        return get_current_settings().api.url
    return None


@contextlib.contextmanager
def prefect_api(home: Path):
    """A Prefect API for the flow: the configured one, else an embedded server for this run."""
    if _configured_api_url():
        yield
        return
    from flows.locks import file_lock

    server = EmbeddedPrefectServer(home / "prefect" / "server.log")
    with file_lock(home / "locks" / "prefect-store.lock"):  # one server at a time migrates the database
        server.start(float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")))
    os.environ["PREFECT_API_URL"] = server.api_url  # read when Prefect is first imported
    try:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):  # if it was imported before
            yield
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        server.stop()
