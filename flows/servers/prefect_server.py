"""posttrain's own Prefect API server: started on first use, shared by later runs, stopped when idle.

With no ``PREFECT_API_URL``, a ``posttrain run`` needs a Prefect API for its flow. Starting
one costs seconds (importing Prefect's server, migrating its SQLite database: 10-15 s of a
quickstart here), so posttrain starts it once per ``$POSTTRAIN_HOME`` and later runs reuse
it: Prefect's ASGI app under uvicorn on 127.0.0.1 (a free port), on the SQLite database in
``$PREFECT_HOME``, in its own session (a Ctrl-C in the terminal reaches posttrain, not the
server). ``$PREFECT_HOME/server.json`` records its pid (with the process's start time, so a
recycled pid is never taken for it), port and URL.

While a run uses the server it holds a shared ``flock`` on ``$PREFECT_HOME/clients.lock``
(released by the kernel even if the run is killed); the server stops itself once nobody
has held it for ``POSTTRAIN_PREFECT_IDLE_SECONDS`` (default 600). ``posttrain server
status`` / ``posttrain server stop`` show and stop it (by pid). A server.json whose process
is gone is removed and a new server started.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from flows.servers.db_templates import copy_template, save_template
from flows.recording.locks import process_start, still_running

IDLE_SECONDS = 600.0


def _idle_seconds() -> float:
    return float(os.environ.get("POSTTRAIN_PREFECT_IDLE_SECONDS", IDLE_SECONDS))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerInfo:
    pid: int
    port: int
    process_start: float  # the pid's start time: a recycled pid does not match
    idle_seconds: float

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def alive(self) -> bool:
        return still_running(self.pid, self.process_start)

    def healthy(self, timeout: float = 2.0) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.api_url}/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False


def prefect_dir(home: Path) -> Path:
    return Path(os.environ.get("PREFECT_HOME") or home / "prefect")


def _state_path(home: Path) -> Path:
    return prefect_dir(home) / "server.json"


def read_state(home: Path) -> tuple[ServerInfo | None, str | None]:
    """The recorded server if its process still runs; else None and, if a stale record was
    removed, what it said."""
    path = _state_path(home)
    try:
        info = ServerInfo(**json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return None, None
    except (ValueError, TypeError) as error:
        path.unlink(missing_ok=True)
        return None, f"removed an unreadable {path} ({error})"
    if info.alive():
        return info, None
    path.unlink(missing_ok=True)
    return None, f"removed a stale {path}: pid {info.pid} is gone"


# ------------------------------------------------------------------ starting and stopping


def start_server(home: Path) -> tuple[ServerInfo, subprocess.Popen | None]:
    """The running server, or a new one starting (not yet answering: see ``wait_healthy``)."""
    from flows.recording.locks import file_lock

    with file_lock(prefect_dir(home) / "server.lock"):
        info, _ = read_state(home)
        if info is not None:
            return info, None
        log_path = prefect_dir(home) / "server.log"
        port, idle = _free_port(), _idle_seconds()
        ui = os.environ.get("POSTTRAIN_PREFECT_UI", "1") != "0"
        env = {**os.environ, "PREFECT_UI_ENABLED": "1" if ui else "0", "PREFECT__SERVER_EPHEMERAL": "1",
               "PREFECT__SERVER_FINAL": "1", "PREFECT_HOME": str(prefect_dir(home)),
               "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",  # what the UI in a browser calls
               "PYTHONSAFEPATH": "1"}  # -m must not find a project's own flows/ in the caller's directory
        env.pop("PREFECT_API_URL", None)
        database = _database(home)
        if database is not None and copy_template("prefect", database):
            # already at this version's schema, its block types registered: nothing to redo
            env.update(PREFECT_SERVER_DATABASE_MIGRATE_ON_START="false", PREFECT_SERVER_REGISTER_BLOCKS_ON_START="false",
                       PREFECT_SERVER_MEMOIZE_BLOCK_AUTO_REGISTRATION="false")
        elif database is not None and not database.exists():
            _NEW_DATABASES.add(database)  # saved as the template once the server has built it
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "flows.servers.prefect_server", str(port), str(idle)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        info = ServerInfo(process.pid, port, process_start(process.pid) or 0.0, idle)
        _state_path(home).write_text(json.dumps(asdict(info)), encoding="utf-8")
        return info, process


_NEW_DATABASES: set[Path] = set()  # databases a server this process started is building from nothing


def _database(home: Path) -> Path | None:
    """The server's SQLite file if it is the home's own (not a database the user configured)."""
    from flows.recording.home import sqlite_uri

    database = prefect_dir(home) / "prefect.db"
    configured = os.environ.get("PREFECT_SERVER_DATABASE_CONNECTION_URL") or \
        os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL")
    return database if configured in (None, sqlite_uri(database, "sqlite+aiosqlite")) else None


def wait_healthy(info: ServerInfo, process: subprocess.Popen | None, home: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    log_path = prefect_dir(home) / "server.log"
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            _state_path(home).unlink(missing_ok=True)
            raise RuntimeError(f"the Prefect API server exited with status {process.returncode}; its log: {log_path}")
        if info.healthy():
            return
        time.sleep(0.1)
    stop_server(home)
    raise RuntimeError(f"the Prefect API server did not answer within {timeout:.0f} s; its log: {log_path}")


def stop_server(home: Path, timeout: float = 10.0) -> ServerInfo | None:
    """Stop the recorded server by its pid (SIGTERM, then SIGKILL); the one stopped, or None."""
    info, _ = read_state(home)
    if info is None:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(info.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while info.alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    if info.alive():
        with contextlib.suppress(ProcessLookupError):
            os.kill(info.pid, signal.SIGKILL)
    _state_path(home).unlink(missing_ok=True)
    return info


def early_start(home: Path) -> bool:
    """Start the server in the background if this run will want one (called before planning, so
    its start-up overlaps MLflow's); whether this call started it."""
    if _configured_api_url():
        return False
    return start_server(home)[1] is not None


_OUR_URLS: set[str] = set()  # URLs of our servers this process set; Prefect's settings may keep them


def _configured_api_url() -> str | None:
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    if "prefect" in sys.modules:  # e.g. inside prefect_test_harness
        from prefect.settings import get_current_settings

        url = get_current_settings().api.url
        return None if url in _OUR_URLS else url
    return None


@contextlib.contextmanager
def prefect_api(home: Path):
    """A Prefect API for the flow: the configured one, else posttrain's server for this home
    (started if none runs), held as a client for the duration."""
    if _configured_api_url():
        yield
        return
    clients = prefect_dir(home) / "clients.lock"
    clients.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(clients, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # the server does not stop while a run holds this
        info, process = start_server(home)
        _OUR_URLS.add(info.api_url)
        os.environ["PREFECT_API_URL"] = info.api_url  # read when Prefect is first imported
        # Prefect's client side imports (~1 s) while the server starts on the other core
        import prefect.flow_engine  # noqa: F401
        import prefect.task_engine  # noqa: F401
        from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

        wait_healthy(info, process, home, float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS",
                                                               "180")))
        if (database := _database(home)) in _NEW_DATABASES:
            _NEW_DATABASES.discard(database)
            save_template("prefect", database)  # before this run's flow writes to it

        # No flow-run heartbeats to this server: nothing here acts on them (posttrain finds runs whose
        # process died itself, flows/recording/tracking.py), and a flow's end joins the heartbeat thread, which
        # sleeps in 1 s steps: up to 1 s of every run. A server PREFECT_API_URL names keeps Prefect's default.
        with temporary_settings(updates={PREFECT_API_URL: info.api_url,  # if Prefect was imported before
                                         PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            try:
                yield
            finally:
                _flush_prefect_logs()
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _flush_prefect_logs() -> None:
    """Send Prefect's buffered run logs while the API is still set (not at interpreter exit)."""
    with contextlib.suppress(Exception):
        from prefect.logging.handlers import APILogHandler

        APILogHandler.flush()


def describe(home: Path) -> str:
    """``posttrain server status``, in words."""
    info, stale = read_state(home)
    lines = [stale] if stale else []
    if info is None:
        lines.append(f"no Prefect API server runs for {home} (the next `posttrain run` starts one)")
    else:
        up = time.time() - info.process_start
        health = "answering" if info.healthy() else "not answering"
        lines.append(f"Prefect API server for {home}: pid {info.pid}, {info.api_url} ({health}), up {up:.0f} s, "
                     f"stops after {info.idle_seconds:.0f} s without a posttrain run")
    return "\n".join(lines)


# ------------------------------------------------------------------ the server process


def _serve(port: int, idle_seconds: float) -> None:
    """Prefect's API app under uvicorn; exits after ``idle_seconds`` with no client holding the lock."""
    import uvicorn

    from prefect.server.api.server import create_app

    home = Path(os.environ["PREFECT_HOME"])
    app = create_app()
    if os.environ.get("PREFECT_UI_ENABLED") == "1":
        _serve_the_ui(app)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on"))
    threading.Thread(target=_stop_when_idle, args=(server, home / "clients.lock", idle_seconds), daemon=True).start()
    try:
        server.run()
    finally:
        state = home / "server.json"
        with contextlib.suppress(Exception):
            if json.loads(state.read_text(encoding="utf-8"))["pid"] == os.getpid():
                state.unlink()


def _serve_the_ui(app) -> None:
    """Mount Prefect's UI at ``/`` of the ephemeral-mode app.

    Prefect serves its UI only from a server that is not ephemeral, and a server that is not
    ephemeral also runs every background service (scheduler, late-run marker, ...), which a
    per-home server for local runs does not need. So the app is made ephemeral and its empty
    UI mount gets the UI app a full server would have (its static files are copied once per
    install, into Prefect's own ``server/ui_build``)."""
    from prefect.server.api.server import create_ui_app

    for route in app.routes:
        if getattr(route, "name", None) == "ui":
            route.app = route._base_app = create_ui_app(ephemeral=False)
            return


def _stop_when_idle(server, clients: Path, idle_seconds: float) -> None:
    fd = os.open(clients, os.O_RDWR | os.O_CREAT, 0o644)
    idle_since = time.monotonic()
    while not server.should_exit:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # succeeds only when no run holds it shared
            fcntl.flock(fd, fcntl.LOCK_UN)
            if time.monotonic() - idle_since >= idle_seconds:
                server.should_exit = True
        except BlockingIOError:
            idle_since = time.monotonic()
        time.sleep(min(1.0, idle_seconds / 4))


if __name__ == "__main__":
    _serve(int(sys.argv[1]), float(sys.argv[2]))
