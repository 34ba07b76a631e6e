"""infra/: the production stack binds to loopback unless told otherwise, and the
authentication the README describes really locks an MLflow server."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import yaml

from conftest import ROOT, run_cli, write
from servers import free_port

INFRA = ROOT / "infra"


def _resolve(value: str, env: dict) -> str:
    """Compose's ${VAR:-default} / ${VAR:?message} interpolation, for the values checked here."""
    def sub(match):
        name, op, rest = match.group(1), match.group(2), match.group(3)
        if env.get(name):
            return env[name]
        if op == ":-":
            return rest
        raise KeyError(f"{name} must be set ({rest})")
    return re.sub(r"\$\{(\w+)(:-|:\?)?([^}]*)\}", sub, str(value))


def _published(compose: dict, env: dict) -> dict[str, list[tuple[str, str]]]:
    found = {}
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            if isinstance(port, dict):
                found.setdefault(name, []).append((_resolve(port.get("host_ip", "0.0.0.0"), env), str(port["published"])))
            else:  # "HOST:PUBLISHED:TARGET" or shorter, which binds every interface
                parts = _resolve(port, env).split(":")
                found.setdefault(name, []).append((parts[0] if len(parts) == 3 else "0.0.0.0", parts[-2]))
    return found


def test_compose_publishes_only_the_two_servers_and_only_on_loopback():
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    published = _published(compose, env={})
    assert published == {"prefect": [("127.0.0.1", "4200")], "mlflow": [("127.0.0.1", "5000")]}
    assert all(service.get("network_mode") != "host" for service in compose["services"].values())
    # configured otherwise: an explicit interface
    assert _published(compose, {"POSTTRAIN_BIND": "10.0.0.5"})["mlflow"] == [("10.0.0.5", "5000")]


def test_auth_overlay_turns_on_both_servers_auth_and_refuses_to_start_without_secrets():
    overlay = yaml.safe_load((INFRA / "compose.auth.yaml").read_text())["services"]
    assert "PREFECT_SERVER_API_AUTH_STRING" in overlay["prefect"]["environment"]
    assert "--app-name basic-auth" in overlay["mlflow"]["command"]
    with pytest.raises(KeyError, match="PREFECT_AUTH"):
        _resolve(overlay["prefect"]["environment"]["PREFECT_SERVER_API_AUTH_STRING"], {})
    ini = (INFRA / "mlflow" / "basic_auth.ini").read_text()
    assert "default_permission = NO_PERMISSIONS" in ini


PIPELINE = """\
name: locked
model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2}
data:
  train: {generator: arithmetic, n: 64, role: train}
  heldout: {generator: arithmetic, n: 8, seed: 5, role: heldout}
stages:
  sft: {kind: sft, data: train, max_steps: 2, batch_size: 8}
"""


@pytest.mark.slow
def test_mlflow_basic_auth_as_the_readme_sets_it_up(home, prefect_server, tmp_path, monkeypatch, capsys):
    """The README's MLflow auth: unauthenticated requests are refused; posttrain with the
    credentials in MLFLOW_TRACKING_USERNAME / _PASSWORD records its runs."""
    ini = tmp_path / "basic_auth.ini"
    ini.write_text((INFRA / "mlflow" / "basic_auth.ini").read_text().replace(
        "sqlite:////var/lib/mlflow-auth/basic_auth.db", f"sqlite:///{tmp_path}/auth.db"))
    port = free_port()
    env = dict(os.environ, MLFLOW_AUTH_CONFIG_PATH=str(ini), MLFLOW_AUTH_ADMIN_PASSWORD="s3cret-for-tests",
               MLFLOW_FLASK_SERVER_SECRET_KEY="test-key", MLFLOW_DISABLE_TELEMETRY="true",
               MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")  # no job runner (tests/servers.py MlflowServer)
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth", "--backend-store-uri",
             f"sqlite:///{tmp_path}/mlflow.db", "--artifacts-destination", str(tmp_path / "artifacts"),
             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except urllib.error.HTTPError:
                break  # answering, with auth
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    pytest.fail("mlflow server did not start:\n" + (tmp_path / "server.log").read_text()[-3000:])
                time.sleep(0.5)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/search?max_results=1", timeout=10)
        assert refused.value.code == 401
        request = urllib.request.Request(f"{url}/api/2.0/mlflow/experiments/search?max_results=1", headers={
            "Authorization": "Basic " + base64.b64encode(b"admin:s3cret-for-tests").decode()})
        assert urllib.request.urlopen(request, timeout=10).status == 200

        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        path = write(tmp_path / "locked.yaml", PIPELINE)
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret-for-tests")
        assert run_cli("run", str(path)) == 0
        from mlflow.tracking import MlflowClient

        experiment = MlflowClient(url).get_experiment_by_name("locked")
        (sft,) = MlflowClient(url).search_runs([experiment.experiment_id], "tags.`posttrain.stage` = 'sft'")
        assert sft.info.status == "FINISHED"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, 15)
            server.wait(timeout=30)
        shutil.rmtree(tmp_path / "artifacts", ignore_errors=True)
