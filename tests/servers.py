"""Real servers for tests, on loopback only, started and stopped by PID."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlflowServer:
    """``mlflow server`` with a SQLite backend and artifact serving; can be stopped and restarted
    on the same port and store (a server lost and brought back)."""

    def __init__(self, root: Path, port: int | None = None):
        self.root = root
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 240) -> "MlflowServer":
        self.root.mkdir(parents=True, exist_ok=True)
        log = open(self.root / "server.log", "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db",
             "--artifacts-destination", str(self.root / "artifacts"), "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            # without MLflow's job runner (8 more processes, for GenAI jobs: posttrain runs none), as `posttrain ui`
            env=dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
        )
        log.close()
        deadline = time.time() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError("mlflow server did not start:\n" + (self.root / "server.log").read_text()[-3000:])
            time.sleep(0.5)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"{url} did not come up:\n" + log.read_text()[-3000:])
        time.sleep(0.5)


class PrefectServer:
    """``prefect server start`` on loopback with its own PREFECT_HOME, plus process workers."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.procs: list[subprocess.Popen] = []
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        self.env.update(PREFECT_HOME=str(root / "prefect-home"), PREFECT_API_URL=self.api_url,
                        PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED="false",
                        DO_NOT_TRACK="1")

    def _spawn(self, argv: list[str], log_name: str, env: dict | None = None) -> subprocess.Popen:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / log_name, "a") as log:
            proc = subprocess.Popen([sys.executable, "-m", "prefect", *argv], env={**self.env, **(env or {})},
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start(self, timeout: float = 240) -> "PrefectServer":
        proc = self._spawn(["server", "start", "--host", "127.0.0.1", "--port", str(self.port)], "server.log")
        _wait_healthy(f"{self.api_url}/health", proc, self.root / "server.log", timeout)
        return self

    def cli(self, *argv: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "prefect", *argv], env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout, check=False)

    def worker(self, pool: str, env: dict) -> subprocess.Popen:
        return self._spawn(["worker", "start", "--pool", pool, "--type", "process", "--limit", "4"],
                           f"worker-{pool}.log", env)

    def stop(self, grace: float = 5) -> None:
        """SIGTERM to every process group at once, SIGKILL to those left after ``grace`` seconds: a worker
        passes SIGTERM on to its child as SIGINT and then took over 20 s to go (two workers and the server,
        one at a time with 20 s each, took 45 s to stop)."""
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()
