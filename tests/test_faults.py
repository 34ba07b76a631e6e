"""Faults injected into real runs: kill -9 mid-SFT, Ctrl-C, the tracking server unreachable
at start or lost mid-stage, and two runs at once. Each runs the real CLI in a separate
process (``python -m flows.cli``) against a real store; nothing is mocked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, gone, group_of, kill_left_behind, run_cli, write
from servers import MlflowServer, free_port

pytestmark = pytest.mark.slow

STEPS = 400

PIPELINE = f"""\
name: faults
model: {{init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}}
data:
  train: {{generator: arithmetic, n: 512, role: train}}
  heldout: {{generator: arithmetic, n: 8, seed: 5, role: heldout}}
stages:
  sft: {{kind: sft, data: train, max_steps: {STEPS}, save_steps: 20, batch_size: 8, logging_steps: 10}}
  eval_sft: {{kind: eval, model: sft, data: heldout, sampling: {{attempts: 2, max_tokens: 3}}}}
"""


_LAUNCHED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test():
    yield
    kill_left_behind(_LAUNCHED, group=True)


def launch(home: Path, *argv: str, env: dict | None = None, log: Path) -> subprocess.Popen:
    """``posttrain ARGV`` in its own process group, as a terminal would run it."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_TRACKING_URI"))}
    environ.update(POSTTRAIN_HOME=str(home), POSTTRAIN_TORCH_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "flows.cli", *argv], cwd=home.parent, env=environ,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    _LAUNCHED.append(proc)
    return proc


def wait_for(predicate, proc: subprocess.Popen, log: Path, timeout: float = 240, what: str = ""):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = predicate()
        if found:
            return found
        if proc.poll() is not None:
            pytest.fail(f"posttrain exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")


def checkpoints(home: Path) -> list[Path]:
    return sorted(home.glob("resume/*/sft-*/checkpoint-*/trainer_state.json"))


def stage_runs(client, experiment: str, stage: str):
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id], f"tags.`posttrain.stage` = '{stage}'",
                              order_by=["attributes.start_time ASC"])


def finish(proc: subprocess.Popen, log: Path, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"posttrain did not finish:\n{log.read_text()[-3000:]}")


def test_kill_9_mid_sft_is_marked_failed_never_reused_and_resumed(home, prefect_server, tmp_path):
    from mlflow.tracking import MlflowClient

    path = write(tmp_path / "faults.yaml", PIPELINE)
    home.mkdir()
    log = tmp_path / "killed.log"
    proc = launch(home, "run", str(path), log=log)
    wait_for(lambda: checkpoints(home), proc, log, what="a trainer checkpoint")
    os.kill(proc.pid, signal.SIGKILL)  # the orchestrating process only: an OOM kill, a lost job
    proc.wait()
    # what it started in its process group (the reward worker: PR_SET_PDEATHSIG) follows it
    assert gone(proc.pid), f"processes of the killed run left: {group_of(proc.pid)}"

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    (dead,) = stage_runs(client, "faults", "sft")
    assert dead.info.status == "RUNNING"  # what kill -9 leaves behind
    assert "posttrain.outputs" not in dead.data.tags
    killed_at = int(json.loads(checkpoints(home)[-1].read_text())["global_step"])
    assert 0 < killed_at < STEPS

    assert run_cli("run", str(path)) == 0
    dead = client.get_run(dead.info.run_id)
    assert dead.info.status == "FAILED"
    assert "died" in dead.data.tags["posttrain.error"]
    assert not (home / "outputs" / "faults" / "sft" / dead.info.run_id).exists()  # nothing published

    _, resumed = stage_runs(client, "faults", "sft")
    assert resumed.info.status == "FINISHED"
    assert resumed.data.metrics["resumed_from_step"] >= 20
    assert resumed.data.metrics["steps"] == STEPS  # the same optimizer steps as an uninterrupted run
    assert resumed.data.params["resumed_from"].endswith(f"checkpoint-{int(resumed.data.metrics['resumed_from_step'])}")
    link = json.loads(resumed.data.tags["posttrain.resumed_from"])  # the run that stopped, and where
    assert link["run"] == dead.info.run_id and link["step"] == resumed.data.metrics["resumed_from_step"]
    (evaluated,) = stage_runs(client, "faults", "eval_sft")
    assert json.loads(evaluated.data.tags["posttrain.upstream"]) == {"sft": resumed.info.run_id}
    assert not list(home.glob("resume/*/sft-*"))  # the resume state goes once the stage is published
    pipeline_runs = client.search_runs([dead.info.experiment_id], "tags.`posttrain.role` = 'pipeline'")
    assert sorted(r.info.status for r in pipeline_runs) == ["FAILED", "FINISHED"]


def test_ctrl_c_stops_cleanly_marks_killed_and_keeps_the_checkpoint(home, prefect_server, tmp_path):
    from mlflow.tracking import MlflowClient

    path = write(tmp_path / "faults.yaml", PIPELINE)
    home.mkdir()
    log = tmp_path / "interrupted.log"
    proc = launch(home, "run", str(path), "--set", "stages.sft.save_steps=null", log=log)
    db = home / "mlflow.db"

    def sft_running():
        if not list(home.glob("work/*")):  # the store exists (and is migrated) once a stage started
            return False
        client = MlflowClient(f"sqlite:///{db}")
        return bool(client.search_runs([e.experiment_id for e in client.search_experiments()],
                                       "tags.`posttrain.stage` = 'sft' and metrics.loss > 0"))

    wait_for(sft_running, proc, log, what="SFT logging its loss")
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    assert finish(proc, log, timeout=120) == 130, log.read_text()[-3000:]
    output = log.read_text()
    assert "interrupted" in output

    client = MlflowClient(f"sqlite:///{db}")
    (sft,) = stage_runs(client, "faults", "sft")
    assert sft.info.status == "KILLED"
    assert "checkpoint" in sft.data.tags["posttrain.error"]
    (pipeline_run,) = client.search_runs([sft.info.experiment_id], "tags.`posttrain.role` = 'pipeline'")
    assert pipeline_run.info.status == "KILLED"
    saved = checkpoints(home)  # save_steps is off: this one was written on the interrupt
    assert len(saved) == 1
    step = json.loads(saved[0].read_text())["global_step"]
    assert 0 < step < STEPS
    assert list(saved[0].parent.glob("*.safetensors"))
    assert stage_runs(client, "faults", "eval_sft") == []


def test_a_sweep_stopped_by_ctrl_c_resumes_where_it_stopped(home, tmp_path):
    """Ctrl-C in the second of two variants, then the same command again: the first variant's stages are cache
    hits, the stopped SFT resumes from the checkpoint it wrote on the interrupt, and the sweep finishes with the
    same optimizer steps as one never stopped."""
    from mlflow.tracking import MlflowClient

    path = write(tmp_path / "faults.yaml", PIPELINE + "sweep: {seeds: [0, 1]}\n")
    home.mkdir()
    log = tmp_path / "sweep-stopped.log"
    proc = launch(home, "sweep", str(path), log=log)
    db = home / "mlflow.db"

    def second_sft_running():  # seed 0's SFT and eval finished, seed 1's SFT past its first logged loss
        if not db.exists() or not list(home.glob("work/*")):
            return False
        client = MlflowClient(f"sqlite:///{db}")
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                  "tags.`posttrain.stage` = 'sft' and tags.`posttrain.seed` = '1' and metrics.loss > 0")
        return bool(runs) and runs[0].info.status == "RUNNING"

    wait_for(second_sft_running, proc, log, timeout=400, what="the second variant's SFT logging its loss")
    os.killpg(proc.pid, signal.SIGINT)
    assert finish(proc, log, timeout=120) == 130, log.read_text()[-3000:]
    assert "run the same command again to resume" in log.read_text()

    client = MlflowClient(f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("faults").experiment_id
    (stopped_sweep,) = client.search_runs([experiment], "tags.`posttrain.role` = 'sweep'")
    assert stopped_sweep.info.status == "KILLED"
    first, stopped = stage_runs(client, "faults", "sft")
    assert (first.info.status, first.data.tags["posttrain.seed"]) == ("FINISHED", "0")
    assert (stopped.info.status, stopped.data.tags["posttrain.seed"]) == ("KILLED", "1")
    assert [r.data.tags["posttrain.seed"] for r in stage_runs(client, "faults", "eval_sft")] == ["0"]

    log = tmp_path / "sweep-resumed.log"
    assert finish(launch(home, "sweep", str(path), log=log), log) == 0, log.read_text()[-3000:]
    assert "stage executions: 2 ran, 2 cached" in log.read_text()  # seed 1's SFT and eval; seed 0's from cache
    runs = stage_runs(client, "faults", "sft")
    assert [r.info.run_id for r in runs[:2]] == [first.info.run_id, stopped.info.run_id]  # no seed-0 SFT again
    resumed = runs[2]
    assert (resumed.info.status, resumed.data.tags["posttrain.seed"]) == ("FINISHED", "1")
    assert 0 < resumed.data.metrics["resumed_from_step"] < STEPS
    assert resumed.data.metrics["steps"] == STEPS
    assert json.loads(resumed.data.tags["posttrain.resumed_from"])["run"] == stopped.info.run_id
    sweeps = client.search_runs([experiment], "tags.`posttrain.role` = 'sweep'", order_by=["attributes.start_time ASC"])
    assert [s.info.status for s in sweeps] == ["KILLED", "FINISHED"]


def test_unreachable_tracking_server_is_refused_before_anything_runs(home, tmp_path, monkeypatch, capsys):
    path = write(tmp_path / "faults.yaml", PIPELINE)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    assert run_cli("run", str(path)) == 2
    err = capsys.readouterr().err
    assert "unreachable" in err and "nothing was run" in err
    assert not (home / "outputs").exists() and not (home / "work").exists()


def test_tracking_server_lost_mid_stage_loses_nothing(home, prefect_server, tmp_path):
    from mlflow.tracking import MlflowClient

    server = MlflowServer(tmp_path / "mlflow-server").start()
    try:
        path = write(tmp_path / "faults.yaml", PIPELINE)
        home.mkdir()
        log = tmp_path / "lost.log"
        env = {"MLFLOW_TRACKING_URI": server.url, "POSTTRAIN_TRACKING_RETRY_SECONDS": "3",
               "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"}  # give up on a dead server sooner
        proc = launch(home, "run", str(path), env=env, log=log)
        wait_for(lambda: checkpoints(home), proc, log, what="a trainer checkpoint")
        server.stop(signal.SIGKILL)
        assert finish(proc, log) == 1
        output = log.read_text()
        assert "not recorded in MLflow" in output and "posttrain sync" in output

        checkpoint_dirs = list(home.glob("outputs/faults/sft/*/checkpoint"))
        assert len(checkpoint_dirs) == 1 and list(checkpoint_dirs[0].glob("*.safetensors"))
        run_id = checkpoint_dirs[0].parent.name
        assert (home / "pending" / f"{run_id}.json").is_file()

        server.start()
        sync = subprocess.run([sys.executable, "-m", "flows.cli", "sync"], cwd=tmp_path, capture_output=True,
                              text=True, env={**os.environ, "POSTTRAIN_HOME": str(home), "MLFLOW_TRACKING_URI": server.url},
                              timeout=300)
        assert sync.returncode == 0, sync.stderr
        assert not list((home / "pending").glob("*.json"))
        client = MlflowClient(server.url)
        recorded = client.get_run(run_id)
        assert recorded.info.status == "FINISHED"
        assert recorded.data.metrics["steps"] == STEPS
        history = client.get_metric_history(run_id, "loss")
        assert [m.step for m in history] == list(range(10, STEPS + 1, 10))  # every logged step, none twice
        assert json.loads(recorded.data.tags["posttrain.outputs"])["checkpoint"] == str(checkpoint_dirs[0])
        assert {a.path for a in client.list_artifacts(run_id, "outputs")} == {"outputs/checkpoint"}

        proc = launch(home, "run", str(path), env=env, log=tmp_path / "after.log")
        assert finish(proc, tmp_path / "after.log") == 0
        after = (tmp_path / "after.log").read_text()
        assert "cached sft" in after
        (evaluated,) = [r for r in stage_runs(client, "faults", "eval_sft") if r.info.status == "FINISHED"]
        assert json.loads(evaluated.data.tags["posttrain.upstream"]) == {"sft": run_id}
    finally:
        server.stop()


SMALL = PIPELINE.replace(f"max_steps: {STEPS}, save_steps: 20", "max_steps: 40, save_steps: 20")


def test_same_pipeline_twice_at_once_runs_each_stage_once(home, tmp_path):
    from mlflow.tracking import MlflowClient

    path = write(tmp_path / "faults.yaml", SMALL)
    home.mkdir()
    procs = [launch(home, "run", str(path), log=tmp_path / f"twin{i}.log") for i in range(2)]
    codes = [finish(proc, tmp_path / f"twin{i}.log") for i, proc in enumerate(procs)]
    logs = [(tmp_path / f"twin{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], "\n".join(log[-2000:] for log in logs)

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    for stage in ("sft", "eval_sft"):
        runs = stage_runs(client, "faults", stage)
        assert [r.info.status for r in runs] == ["FINISHED"], f"{stage} ran {len(runs)} times"
    assert len(list(home.glob("outputs/faults/sft/*/checkpoint"))) == 1
    sft_rows = sorted(re.search(r"│ sft +│ sft +│ (\w+)", log).group(1) for log in logs)
    assert sft_rows == ["cached", "ran"]  # the second one waited for the first and reused its result
    experiment = client.get_experiment_by_name("faults").experiment_id
    parents = client.search_runs([experiment], "tags.`posttrain.role` = 'pipeline'")
    assert sorted(r.info.status for r in parents) == ["FINISHED", "FINISHED"]
    sft_run = stage_runs(client, "faults", "sft")[0].info.run_id
    for parent in parents:  # both pipeline runs point at the one execution
        assert json.loads(parent.data.tags["posttrain.stage_runs"])["sft"] == sft_run


EVALS = 6  # runs of one pipeline at once, beside another: 7 processes contending for one home on 2 cores
LOADED = """\
name: loaded
model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}
data:
  train: {generator: arithmetic, n: 64, role: train}
  heldout: {generator: arithmetic, n: 8, seed: 5, role: heldout}
stages:
  sft: {kind: sft, data: train, max_steps: 2, batch_size: 8}
""" + "".join(f"  eval_{i}: {{kind: eval, model: sft, data: heldout, sampling: {{attempts: 2, max_tokens: 3, seed: {i}}}}}\n"
              for i in range(EVALS))


def test_six_evals_and_another_pipeline_at_once_on_one_home_and_its_prefect_server(home, tmp_path):
    """Six `posttrain run --only eval_i` of one pipeline and a run of another, all at once, on one home and the
    Prefect server it keeps: every run recorded once in MLflow and in Prefect, no stage run twice, no
    database-locked error anywhere. Seven processes on two cores keep the home's SQLite writers waiting on one
    another, as the ten evals this test ran before did."""
    import sqlite3
    from contextlib import closing

    from mlflow.tracking import MlflowClient

    path, other = write(tmp_path / "loaded.yaml", LOADED), write(tmp_path / "other.yaml",
                                                                   SMALL.replace("name: faults", "name: other"))
    home.mkdir()
    assert finish(launch(home, "run", str(path), "--only", "sft", log=tmp_path / "sft.log"), tmp_path / "sft.log") == 0
    logs = [tmp_path / f"eval_{i}.log" for i in range(EVALS)] + [tmp_path / "other.log"]
    started = time.monotonic()
    procs = [launch(home, "run", str(path), "--only", f"eval_{i}", log=logs[i]) for i in range(EVALS)]
    procs.append(launch(home, "run", str(other), log=logs[EVALS]))
    try:
        codes = [finish(proc, log, timeout=900) for proc, log in zip(procs, logs)]
        wall = time.monotonic() - started
        texts = [log.read_text() for log in logs] + [p.read_text(errors="replace") for p in home.rglob("*.log")]
        assert codes == [0] * (EVALS + 1), "\n".join(text[-1500:] for code, text in zip(codes, texts) if code)
        assert not [t for t in texts if "database is locked" in t.lower()]

        client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
        for stage in ["sft", *(f"eval_{i}" for i in range(EVALS))]:
            assert [r.info.status for r in stage_runs(client, "loaded", stage)] == ["FINISHED"], stage
        for stage in ("sft", "eval_sft"):
            assert [r.info.status for r in stage_runs(client, "other", stage)] == ["FINISHED"], stage
        parents = client.search_runs([client.get_experiment_by_name("loaded").experiment_id],
                                     "tags.`posttrain.role` = 'pipeline'")
        assert sorted(r.info.status for r in parents) == ["FINISHED"] * (EVALS + 1)
        with closing(sqlite3.connect(home / "prefect" / "prefect.db")) as db:  # the one server all of them used
            states = db.execute("SELECT state_type, count(*) FROM flow_run GROUP BY state_type").fetchall()
        assert states == [("COMPLETED", EVALS + 2)], states
        print(f"\n{EVALS} evals and another pipeline at once: {wall:.0f} s wall, {EVALS + 2} flow runs, 0 errors")
    finally:
        finish(launch(home, "server", "stop", log=tmp_path / "stop.log"), tmp_path / "stop.log")


def test_two_pipelines_at_once_against_one_mlflow_server_keep_their_lineage_apart(home, tmp_path, mlflow_server):
    """Two pipelines launched at once against the session's MLflow server: each keeps its own experiment, parent
    run, stage runs and lineage."""
    from mlflow.tracking import MlflowClient

    home.mkdir()
    names = ["left", "right"]
    procs = []
    for i, name in enumerate(names):
        text = SMALL.replace("name: faults", f"name: {name}").replace("n: 512", f"n: {512 + i}")
        path = write(tmp_path / f"{name}.yaml", text)
        procs.append(launch(home, "run", str(path), env={"MLFLOW_TRACKING_URI": mlflow_server},
                            log=tmp_path / f"{name}.log"))
    codes = [finish(proc, tmp_path / f"{name}.log") for proc, name in zip(procs, names)]
    assert codes == [0, 0], "\n".join((tmp_path / f"{n}.log").read_text()[-2000:] for n in names)

    client = MlflowClient(mlflow_server)
    for name in names:
        experiment = client.get_experiment_by_name(name).experiment_id
        (parent,) = client.search_runs([experiment], "tags.`posttrain.role` = 'pipeline'")
        stages = client.search_runs([experiment], "tags.`posttrain.role` = 'stage'")
        assert {r.data.tags["posttrain.stage"] for r in stages} == {"sft", "eval_sft"}
        ids = {r.data.tags["posttrain.stage"]: r.info.run_id for r in stages}
        assert json.loads(parent.data.tags["posttrain.stage_runs"]) == ids
        for run in stages:
            assert run.info.status == "FINISHED"
            assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id
            assert run.info.experiment_id == experiment
        evaluated = next(r for r in stages if r.data.tags["posttrain.stage"] == "eval_sft")
        assert json.loads(evaluated.data.tags["posttrain.upstream"]) == {"sft": ids["sft"]}
        outputs = json.loads(client.get_run(ids["sft"]).data.tags["posttrain.outputs"])
        assert f"/outputs/{name}/sft/{ids['sft']}/" in outputs["checkpoint"]


def test_stage_past_its_time_limit_stops_with_a_checkpoint_and_resumes(home, prefect_server, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    path = write(tmp_path / "faults.yaml", PIPELINE)
    limited = ["--set", "stages.sft.max_steps=600", "--set", "stages.sft.time_limit_minutes=0.01"]
    assert run_cli("run", str(path), *limited) == 1
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    (stopped,) = stage_runs(client, "faults", "sft")
    assert stopped.info.status == "FAILED"
    error = stopped.data.tags["posttrain.error"]
    assert "StageTimeLimit: time limit reached after" in error and "of 600 optimizer steps" in error
    done = int(error.split("after ")[1].split(" of")[0])
    assert 0 < done < 600
    assert [int(json.loads(c.read_text())["global_step"]) for c in checkpoints(home)] == [done]
    assert stage_runs(client, "faults", "eval_sft") == []

    # the limit is how it runs, not what it computes: lifting it keeps the fingerprint and resumes
    capsys.readouterr()
    assert run_cli("run", str(path), "--set", "stages.sft.max_steps=600") == 0
    _, resumed = stage_runs(client, "faults", "sft")
    assert resumed.data.metrics["resumed_from_step"] == done and resumed.data.metrics["steps"] == 600
    assert f"resumed sft: from step {done} where run {stopped.info.run_id} stopped" in capsys.readouterr().out


def test_stage_that_cannot_stop_itself_is_stopped_after_the_grace(home, prefect_server, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("POSTTRAIN_TIME_LIMIT_GRACE_SECONDS", "1")
    path = write(tmp_path / "faults.yaml", PIPELINE.replace("n: 8, seed: 5", "n: 400, seed: 5"))
    slow_eval = ["--set", "stages.sft.max_steps=5", "--set", "stages.eval_sft.time_limit_minutes=0.005",
                 "--set", "stages.eval_sft.sampling.attempts=32", "--set", "stages.eval_sft.sampling.max_tokens=48"]
    started = time.monotonic()
    assert run_cli("run", str(path), *slow_eval) == 1
    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    (stopped,) = stage_runs(client, "faults", "eval_sft")
    assert stopped.info.status == "FAILED"
    assert "past its time limit of 0.005 min and was stopped" in stopped.data.tags["posttrain.error"]
    assert time.monotonic() - started < 120
