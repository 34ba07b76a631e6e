"""posttrain's Prefect API server: started on first use, reused, shown, stopped by pid, stopped
when idle, and a stale pid file is not trusted. Real server processes, real `posttrain server`."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import run_cli
from flows.servers.prefect_server import prefect_api, prefect_dir, read_state, stop_server


@pytest.fixture()
def own_server(home, monkeypatch):
    """A home with no PREFECT_API_URL, so posttrain starts its own server there."""
    from flows.recording.home import configure_environment

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(home / "prefect"))
    configure_environment()
    if "prefect" not in sys.modules:  # nothing to set aside: no harness can be active
        yield home
        stop_server(home)
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # the suite's session-wide test harness (conftest.prefect_server) sets an API URL in this
    # process's Prefect settings; here the process must look like one with none configured
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        yield home
    stop_server(home)


def test_started_on_first_use_reused_shown_and_stopped_by_pid(own_server, capsys):
    home = own_server
    with prefect_api(home):
        first, _ = read_state(home)
        assert first is not None and first.healthy()
    with prefect_api(home):  # the next run finds it
        again, _ = read_state(home)
        assert again.pid == first.pid
    capsys.readouterr()
    assert run_cli("server", "status") == 0
    out = capsys.readouterr().out
    assert f"pid {first.pid}" in out and "answering" in out and first.api_url in out

    assert run_cli("server", "stop") == 0
    assert f"stopped the Prefect API server (pid {first.pid})" in capsys.readouterr().out
    assert not first.alive() and not (prefect_dir(home) / "server.json").exists()
    assert run_cli("server", "status") == 0
    assert "no Prefect API server runs" in capsys.readouterr().out


def test_a_stale_pid_file_is_removed_never_trusted(own_server, capsys):
    home = own_server
    gone = subprocess.Popen(["true"])
    gone.wait()
    state = prefect_dir(home) / "server.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"pid": gone.pid, "port": 9, "process_start": 1.0, "idle_seconds": 600}))
    assert run_cli("server", "status") == 0
    out = capsys.readouterr().out
    assert f"removed a stale {state}: pid {gone.pid} is gone" in out and "no Prefect API server runs" in out
    assert not state.exists()
    assert run_cli("server", "stop") == 0  # nothing to stop, nothing killed
    assert "no Prefect API server runs" in capsys.readouterr().out


def test_stops_itself_when_no_run_has_used_it_for_the_idle_time(own_server, monkeypatch):
    home = own_server
    monkeypatch.setenv("POSTTRAIN_PREFECT_IDLE_SECONDS", "3")
    with prefect_api(home):
        server, _ = read_state(home)
        time.sleep(6)  # twice the idle time, but a run holds it
        assert server.alive() and server.healthy()
    deadline = time.monotonic() + 60
    while server.alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not server.alive()
    assert not (prefect_dir(home) / "server.json").exists()


def test_the_homes_server_serves_prefects_ui_and_posttrain_ui_names_it(own_server):
    import httpx

    from flows.servers.ui import prefect_ui_address

    home = own_server
    assert prefect_ui_address() is None  # no server up for this home yet
    with prefect_api(home):
        info, _ = read_state(home)
    address = prefect_ui_address()  # the run is over; its server is still up
    assert address == f"http://127.0.0.1:{info.port}"
    page = httpx.get(f"{address}/", headers={"Accept": "text/html"}, follow_redirects=True, timeout=30)
    assert page.status_code == 200 and "<title>Prefect Server</title>" in page.text
    settings = httpx.get(f"{address}/ui-settings", timeout=30).json()
    assert settings["api_url"] == info.api_url  # the UI in a browser calls this server, not Prefect's default port


def test_flows_on_the_homes_server_send_no_heartbeats(own_server):
    """A flow's end joins its heartbeat thread, which sleeps in 1 s steps: on posttrain's own server,
    where nothing acts on heartbeats, there is none (a configured server keeps Prefect's default)."""
    from prefect.settings import get_current_settings

    assert get_current_settings().flows.heartbeat_frequency is not None  # Prefect's default: 180 s
    with prefect_api(own_server):
        assert get_current_settings().flows.heartbeat_frequency is None
    assert get_current_settings().flows.heartbeat_frequency is not None


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's")
def test_a_projects_own_flows_package_in_the_callers_directory_does_not_shadow_posttrains(own_server, tmp_path,
                                                                                        monkeypatch):
    """The server runs as ``python -m flows.servers.prefect_server``; a user's project may well have a flows/ of its own."""
    project = tmp_path / "project"
    (project / "flows").mkdir(parents=True)
    (project / "flows" / "__init__.py").write_text("raise SystemExit('the project\\'s flows package was imported')\n")
    monkeypatch.chdir(project)
    with prefect_api(own_server):
        server, _ = read_state(own_server)
        assert server is not None and server.healthy()
    assert "project's flows package" not in (prefect_dir(own_server) / "server.log").read_text()
