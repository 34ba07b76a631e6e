"""``posttrain ui``: MLflow's UI on this home's store, on loopback, until Ctrl-C.

It runs MLflow's own server (``mlflow server``, one worker, no job runner) on
``$POSTTRAIN_HOME/mlflow.db`` in a session of its own, so Ctrl-C reaches posttrain alone,
which then stops the server by its process group; like the embedded Prefect server
(``flows/servers/prefect_server.py``), the server is told to die with posttrain, so even a
``kill -9`` leaves none behind. Its log is ``$POSTTRAIN_HOME/ui/mlflow-server.log``.

MLflow 3.17's UI does not open an experiment by its ``mlflow.experimentKind`` tag (which
posttrain sets, flows/recording/tracking.py): it opens the GenAI view unless the address carries
``workflowType=machine_learning`` or the browser remembers the "Model training" switch for
this address. So the links printed here carry it, and the default port is fixed (5000,
MLflow's own) so the switch, once made, is remembered; a busy 5000 falls back to a free port.

With ``MLFLOW_TRACKING_URI`` pointing at a tracking server, that server already serves the
UI: its address is printed and nothing is started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

DEFAULT_PORT = 5000
MODEL_TRAINING_VIEW = "workflowType=machine_learning"



# Run in the server's own interpreter before it becomes MLflow's: ask the kernel for SIGTERM when
# posttrain dies (PR_SET_PDEATHSIG = 1), then exec. (No preexec_fn: unsafe with threads.)
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "try:\n    ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM)\nexcept OSError:\n    pass\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)

class UiError(Exception):
    """``posttrain ui`` cannot start (no store yet, a busy port): exit status 2."""


def experiment_link(base: str, experiment_id: str) -> str:
    """An experiment's page in MLflow's UI, opened on its runs (the model-training view)."""
    return f"{base}/#/experiments/{quote(str(experiment_id))}?{MODEL_TRAINING_VIEW}"


def run_link(base: str, experiment_id: str, run_id: str) -> str:
    return f"{base}/#/experiments/{quote(str(experiment_id))}/runs/{quote(run_id)}?{MODEL_TRAINING_VIEW}"


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def choose_port(requested: int | None) -> int:
    """``--port`` if free (else UiError); without it 5000 if free, else any free port."""
    if requested is not None:
        if not 1 <= requested <= 65535:
            raise UiError(f"--port {requested} is not a TCP port (1-65535)")
        if not port_is_free(requested):
            raise UiError(f"--port {requested}: 127.0.0.1:{requested} is already in use; choose another, or leave "
                          "--port out to get a free one")
        return requested
    if port_is_free(DEFAULT_PORT):
        return DEFAULT_PORT
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prefect_ui_address() -> str | None:
    """The Prefect UI's address when a Prefect server answers: the one at ``PREFECT_API_URL``, else
    the one posttrain keeps for this home (flows/servers/prefect_server.py) if it is up; else None."""
    api = os.environ.get("PREFECT_API_URL", "").rstrip("/")
    if not api:
        from flows.recording.home import posttrain_home
        from flows.servers.prefect_server import read_state

        own, _ = read_state(posttrain_home())
        if own is None:
            return None
        api = own.api_url
    import requests

    try:
        if requests.get(f"{api}/health", timeout=3).status_code != 200:
            return None
    except requests.exceptions.RequestException:
        return None
    return api[: -len("/api")] if api.endswith("/api") else api


class MlflowUiServer:
    """``mlflow server`` on the home's SQLite store, on 127.0.0.1:``port``, in its own session."""

    def __init__(self, home: Path, port: int):
        self.home = home
        self.port = port
        self.log_path = home / "ui" / "mlflow-server.log"
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> None:
        from flows.recording.home import artifact_root
        from flows.recording.locks import file_lock

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-c", _DIE_WITH_PARENT, "-m", "mlflow", "server",
                   "--backend-store-uri", os.environ["MLFLOW_TRACKING_URI"],
                   "--default-artifact-root", artifact_root(self.home),
                   "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"]
        # the job runner (scorers, trace archival) is for GenAI work; the UI needs none of it
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        with file_lock(self.home / "locks" / "mlflow-store.lock"):  # the server may migrate the store
            with open(self.log_path, "ab") as log:
                self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
            self._wait_healthy(timeout)

    def _wait_healthy(self, timeout: float) -> None:
        import requests

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"MLflow's server exited with status {self.process.returncode}; its log: "
                                   f"{self.log_path}")
            try:
                if requests.get(f"{self.address}/health", timeout=2).status_code == 200:
                    return
            except requests.exceptions.RequestException:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"MLflow's server did not answer within {timeout:.0f} s; its log: {self.log_path}")

    def stop(self) -> None:
        """SIGTERM to the server's process group (mlflow's CLI and its uvicorn), SIGKILL after 10 s."""
        if self.process is None:
            return
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self.process = None


def ui_command(port: int | None, console) -> int:
    """Serve the UI until Ctrl-C (0), or say why not (2: bad input, 1: the server failed)."""
    from flows.recording.home import posttrain_home, uses_local_mlflow

    if not uses_local_mlflow():
        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        console.print(f"MLflow UI: {uri} (the tracking server serves it; nothing to start)", highlight=False)
        _print_prefect(console)
        return 0
    home = posttrain_home()
    if not (home / "mlflow.db").exists():
        raise UiError(f"POSTTRAIN_HOME {str(home)!r} holds no MLflow store yet; `posttrain run` a pipeline first "
                      "(or set POSTTRAIN_HOME to the home that holds your runs)")
    server = MlflowUiServer(home, choose_port(port))
    previous = signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the server as Ctrl-C does
    # Ctrl-C too, even when this process was started with SIGINT ignored (a non-interactive shell's
    # background job inherits that, and Python then never raises KeyboardInterrupt)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server.start(float(os.environ.get("POSTTRAIN_UI_STARTUP_TIMEOUT_SECONDS", "180")))
        _print_addresses(server.address, console)
        status = server.process.wait()
        print(f"posttrain ui: MLflow's server exited with status {status}; its log: {server.log_path}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        server.stop()
        console.print("posttrain ui: stopped")
        return 0
    except RuntimeError as error:
        print(f"posttrain ui: {error}", file=sys.stderr)
        return 1
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _print_addresses(address: str, console) -> None:
    from mlflow.tracking import MlflowClient

    console.print(f"MLflow UI: {address}", highlight=False)
    experiments = [e for e in MlflowClient().search_experiments() if e.name != "Default"]
    for experiment in sorted(experiments, key=lambda e: e.name):
        console.print(f"  {experiment.name}: {experiment_link(address, experiment.experiment_id)}", highlight=False)
    _print_prefect(console)
    console.print("Ctrl-C stops it.", highlight=False)
    sys.stdout.flush()  # the addresses are read while the server runs (a pipe is block-buffered)


def _print_prefect(console) -> None:
    prefect = prefect_ui_address()
    if prefect:
        console.print(f"Prefect UI: {prefect}", highlight=False)
