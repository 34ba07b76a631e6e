"""posttrain's warm process (flows/servers/warm.py): started by a cold run, it runs later `posttrain run`s
as forked children that write to the caller's own stdout and exit with the caller's status;
it computes what a cold run computes; it refuses a changed environment; Ctrl-C reaches the
run and a killed caller takes its run down; an edited module retires it. Real CLI processes,
real warm process, real Prefect server and MLflow store; nothing mocked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import QUICKSTART, ROOT, kill_left_behind
from flows.recording.tags import TAG_PID
from flows.recording.tracking import process_alive
from test_run_output import SMALL

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def environment(home: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "POSTTRAIN_HOME": str(home), "POSTTRAIN_WARM": "1", "POSTTRAIN_PREFECT_IDLE_SECONDS": "600",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]), **extra}
    for key in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", "PREFECT_HOME", "PYTEST_CURRENT_TEST"):  # the last: per phase
        env.pop(key, None)
    return env


_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_caller_outlives_its_test():
    """A caller a failed test left running is killed (a killed caller takes its warm run down with it)."""
    yield
    kill_left_behind(_STARTED, group=False)


def start(home: Path, *argv: str, **extra: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "flows.cli", *argv], env=environment(home, **extra),
                               cwd=home.parent, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _STARTED.append(process)
    return process


def posttrain(home: Path, *argv: str, **extra: str) -> tuple[int, str]:
    process = start(home, *argv, **extra)
    out, _ = process.communicate(timeout=1200)
    return process.returncode, out


def served(home: Path) -> int:
    return json.loads((home / "warm" / "warm.json").read_text())["served"]


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def stage_runs(home: Path, stage: str, status: str | None = None):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{home}/mlflow.db")
    experiments = [e.experiment_id for e in client.search_experiments()]
    query = f"tags.`posttrain.stage` = '{stage}'" + (f" and attributes.status = '{status}'" if status else "")
    return client.search_runs(experiments, query, order_by=["attributes.start_time DESC"])


@pytest.fixture(scope="module")
def warm_home(tmp_path_factory):
    """A home whose small quickstart ran cold, and whose warm process that run started is ready."""
    home = tmp_path_factory.mktemp("warm") / "home"
    status, out = posttrain(home, "run", str(QUICKSTART), *SMALL)
    assert status == 0, out
    wait_until(lambda: (home / "warm" / "warm.sock").exists(), 600, "the warm process")
    assert served(home) == 0
    yield home
    posttrain(home, "server", "stop")


def test_a_warm_run_writes_to_the_callers_output_exits_with_its_status_and_computes_what_a_cold_run_did(warm_home):
    home = warm_home
    cold = stage_runs(home, "eval_grpo")[0].data.metrics["pass_at_1"]
    status, out = posttrain(home, "run", str(QUICKSTART), *SMALL, "--only", "eval_grpo")
    assert status == 0, out
    assert served(home) == 1
    lines = out.splitlines()
    assert lines[0] == "plan for quickstart:" and any(line.split()[:2] == ["eval_grpo", "done"] for line in lines), out
    assert stage_runs(home, "eval_grpo")[0].data.metrics["pass_at_1"] == cold  # same checkpoint, seed, settings

    status, out = posttrain(home, "run", str(QUICKSTART), *SMALL, "--only", "no_such_stage")
    assert status == 2 and "no_such_stage" in out, out  # refused input: the same words and status as cold
    assert served(home) == 2

    status, out = posttrain(home, "server", "status")
    assert f"warm process for {home}" in out and "served 2 run(s)" in out, out


def test_a_changed_environment_is_run_cold_and_leaves_the_warm_process_serving(warm_home):
    home = warm_home
    before = served(home)
    status, out = posttrain(home, "run", str(QUICKSTART), *SMALL, "--only", "eval_sft", POSTTRAIN_EXTRA_SETTING="x")
    assert status == 0, out
    assert served(home) == before
    assert "environment differs (POSTTRAIN_EXTRA_SETTING)" in (home / "warm" / "warm.log").read_text()
    assert (home / "warm" / "warm.sock").exists()


def test_ctrl_c_reaches_the_run_and_a_killed_caller_takes_its_run_down(warm_home):
    home = warm_home
    longer = ["--set", "stages.grpo.max_steps=400", "--only", "grpo"]
    caller = start(home, "run", str(QUICKSTART), *SMALL, *longer)
    # Ctrl-C once the stage trains (its first step logged), not at a guess of how long its start takes
    wait_until(lambda: any(run.data.metrics for run in stage_runs(home, "grpo", "RUNNING")), 300,
               "the grpo stage to log its first step")
    caller.send_signal(signal.SIGINT)
    out, _ = caller.communicate(timeout=120)
    assert caller.returncode == 130, out
    assert "interrupted" in out and stage_runs(home, "grpo")[0].info.status == "KILLED", out

    caller = start(home, "run", str(QUICKSTART), *SMALL, *longer)
    wait_until(lambda: stage_runs(home, "grpo", "RUNNING"), 300, "the grpo stage to start again")
    child = int(stage_runs(home, "grpo", "RUNNING")[0].data.tags[TAG_PID])
    assert child != caller.pid  # the run is the warm process's child, not the caller
    caller.kill()
    caller.communicate()
    wait_until(lambda: not process_alive(child, None), 30, "the warm child to be killed with its caller")


def test_an_edited_module_retires_the_warm_process_and_the_run_goes_cold(warm_home):
    home = warm_home
    module = ROOT / "flows" / "planning" / "graph.py"  # imported by the warm process
    stat = module.stat()
    os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    try:
        status, out = posttrain(home, "run", str(QUICKSTART), *SMALL, "--only", "eval_sft")
        assert status == 0, out
        assert f"{module} changed since the warm process started" in (home / "warm" / "warm.log").read_text()
        # the retired process served nothing more; the cold run started a fresh one as it ended
        wait_until(lambda: (home / "warm" / "warm.sock").exists() and served(home) == 0, 600,
                   "a new warm process")
    finally:
        os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns))
