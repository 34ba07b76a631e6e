"""MLflow as its users expect: model-training experiments, dataset inputs, logged models with
their eval scores, and `posttrain ui` read in headless Chromium after a small real run."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from browser import Browser, chromium_path
from conftest import ROOT, run_cli, write
from stages.context import StageInputs

PIPELINE = """\
name: looking
model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}
data:
  train: {generator: arithmetic, n: 32, max_operand: 9, role: train}
  heldout: {generator: arithmetic, n: 4, seed: 5, max_operand: 9, role: heldout}
rewards:
  number: {fn: regex_format}
stages:
  sft: {kind: sft, data: train, max_steps: 1, batch_size: 8}
  eval_sft: {kind: eval, model: sft, data: heldout, rewards: [number], sampling: {max_tokens: 2, attempts: 2}}
"""


@pytest.fixture(scope="module")
def ran(tmp_path_factory, prefect_server):
    """One real run of PIPELINE in its own home: (home, {stage: run}, the pipeline run)."""
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("ui")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("POSTTRAIN_HOME", str(root / "home"))
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        patch.chdir(root)
        assert run_cli("run", str(write(root / "looking.yaml", PIPELINE))) == 0
        client = MlflowClient()
        experiment = client.get_experiment_by_name("looking")
        runs = client.search_runs([experiment.experiment_id], "tags.`posttrain.role` = 'stage'")
        pipeline = client.search_runs([experiment.experiment_id], "tags.`posttrain.role` = 'pipeline'")[0]
        runs = {r.data.tags["posttrain.stage"]: client.get_run(r.info.run_id) for r in runs}
        yield root / "home", runs, pipeline, client


@pytest.mark.slow
def test_experiments_are_model_training_and_runs_show_their_datasets(ran):
    home, runs, pipeline, client = ran
    experiment = client.get_experiment(runs["sft"].info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"

    for stage, name, rows in (("sft", "train", 32), ("eval_sft", "heldout", 4)):
        (entry,) = runs[stage].inputs.dataset_inputs
        dataset = entry.dataset
        assert (dataset.name, {t.key: t.value for t in entry.tags}) == (name, {"mlflow.data.context": name})
        source = Path(json.loads(dataset.source)["uri"].removeprefix("file://"))
        assert dataset.source_type == "local" and source.parent == home / "cache" / "data"
        assert dataset.digest == hashlib.sha256(source.read_bytes()).hexdigest()[:16]
        profile = json.loads(dataset.profile)
        assert profile["num_rows"] == rows and profile["spec"]["generator"] == "arithmetic"
    # the pipeline run lists what its stages read, once each (the run list's row for it shows them)
    pipeline_inputs = client.get_run(pipeline.info.run_id).inputs.dataset_inputs
    assert sorted((i.dataset.name, i.dataset.digest) for i in pipeline_inputs) == \
        sorted((r.inputs.dataset_inputs[0].dataset.name, r.inputs.dataset_inputs[0].dataset.digest) for r in runs.values())
    # lineage by search: which runs read the heldout set, with this digest
    digest = runs["eval_sft"].inputs.dataset_inputs[0].dataset.digest
    found = client.search_runs([experiment.experiment_id],
                               f"datasets.name = 'heldout' and datasets.digest = '{digest}'")
    assert {r.info.run_id for r in found} == {runs["eval_sft"].info.run_id, pipeline.info.run_id}


@pytest.mark.slow
def test_evaluated_checkpoints_are_logged_models_with_their_scores(ran):
    _, runs, _, client = ran
    (model,) = client.search_logged_models([runs["sft"].info.experiment_id])
    assert model.model_id == runs["sft"].data.tags["posttrain.model_id"] and model.source_run_id == runs["sft"].info.run_id
    linked = {m.key: m for m in model.metrics}
    assert linked["pass_at_1"].value == runs["eval_sft"].data.metrics["pass_at_1"]
    assert linked["pass_at_1"].run_id == runs["eval_sft"].info.run_id
    # the eval run lists the checkpoint it scored as its model input, the sft run as its output
    assert [m.model_id for m in runs["eval_sft"].inputs.model_inputs] == [model.model_id]
    assert [m.model_id for m in runs["sft"].outputs.model_outputs] == [model.model_id]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _address(proc: subprocess.Popen, timeout: float = 240) -> tuple[str, str]:
    """(the MLflow UI's address, the whole banner) from `posttrain ui`'s stdout, read for at most ``timeout``
    seconds (by a thread, since a read waits for a line: it ends at the banner's last line or when ``_stop``
    ends the process)."""
    read: queue.Queue = queue.Queue()

    def reader():
        for line in proc.stdout:
            read.put(line)
            if line.startswith("Ctrl-C"):
                break
        read.put(None)

    threading.Thread(target=reader, daemon=True).start()
    lines, deadline = [], time.monotonic() + timeout
    while True:
        try:
            line = read.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        lines.append(line)
        if line.startswith("Ctrl-C"):
            break
    banner = "".join(lines)
    found = re.search(r"MLflow UI: (http://127\.0\.0\.1:\d+)", banner)
    assert found, f"no address within {timeout:g} s in: {banner!r}; exit {proc.poll()}"
    return found.group(1), banner


def _need_chromium() -> None:
    if chromium_path() is None:  # CI (.ci/run) installs it and sets POSTTRAIN_REQUIRE_HOST_TOOLS=1
        if os.environ.get("POSTTRAIN_REQUIRE_HOST_TOOLS") == "1":
            pytest.fail("POSTTRAIN_REQUIRE_HOST_TOOLS=1 and chromium is not installed (apt-get install chromium)")
        pytest.skip("needs Debian's chromium (apt-get install chromium) [CI requires it]")


def _stop(proc: subprocess.Popen) -> None:
    # Launched as a background job of a non-interactive shell, `posttrain ui` once inherited SIGINT ignored
    # and outlived Ctrl-C by 60 s (flows/servers/ui.py now installs its own handler). Killed, its server dies with it.
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its process group: the MLflow server it started too
        proc.communicate(timeout=30)


@pytest.mark.slow
def test_posttrain_ui_shows_the_runs_their_scores_and_datasets_in_chromium(ran):
    _need_chromium()
    home, runs, pipeline, _ = ran
    experiment_id = pipeline.info.experiment_id
    env = dict(os.environ, POSTTRAIN_HOME=str(home), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("PREFECT_API_URL", None)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "ui", "--port", str(port)], cwd=home.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        address, banner = _address(proc)
        link = f"{address}/#/experiments/{experiment_id}?workflowType=machine_learning"
        assert address == f"http://127.0.0.1:{port}" and f"looking: {link}" in banner, banner
        with Browser() as browser:
            # the printed link opens the experiment's runs (not the GenAI overview): the pipeline run is there
            text = browser.page_text(link, lambda text: pipeline.info.run_name in text)
            assert pipeline.info.run_name in text and "Detect Issues" not in text, text[:2000]
            # the pipeline run lists its stage runs
            page = f"{address}/#/experiments/{experiment_id}/runs/{pipeline.info.run_id}?workflowType=machine_learning"
            child_runs = re.compile(r"\nChild runs\n(.*?)\nSource\n", re.S)
            text = browser.page_text(page, lambda text: (found := child_runs.search(text)) and "loading" not in found[1])
            children = child_runs.search(text)
            assert children and set(re.split(r"[\s,]+", children[1].strip())) == set(runs), text[:2000]
            # the eval run shows its pass@1 and the dataset it read (name, digest, context)
            eval_run = runs["eval_sft"]
            score = re.compile(rf"pass_at_1\s+{re.escape(format(eval_run.data.metrics['pass_at_1'], 'g'))}\s")
            digest = eval_run.inputs.dataset_inputs[0].dataset.digest
            page = f"{address}/#/experiments/{experiment_id}/runs/{eval_run.info.run_id}?workflowType=machine_learning"
            text = browser.page_text(page, lambda text: score.search(text) and f"heldout ({digest})" in text)
            assert score.search(text) and f"heldout ({digest})" in text, text[:3000]
    finally:
        _stop(proc)


@pytest.mark.slow
def test_posttrain_ui_names_prefects_ui_which_shows_the_pipelines_flow_run_in_chromium(tmp_path):
    """A run on posttrain's own Prefect server (no PREFECT_API_URL): `posttrain ui` prints that server's UI
    beside MLflow's, and the page lists the pipeline's flow and its run."""
    _need_chromium()
    # the server outlives the run until `server stop` below (the suite's 20 s idle stop could beat `posttrain ui`)
    # and none of the session's Prefect settings (its test server's URL and database) reach it
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_TRACKING_URI"))}
    env.update(POSTTRAIN_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
               POSTTRAIN_PREFECT_IDLE_SECONDS="600")
    env.pop("POSTTRAIN_PREFECT_UI", None)
    cli = [sys.executable, "-m", "flows.cli"]
    done = subprocess.run([*cli, "run", str(write(tmp_path / "looking.yaml", PIPELINE))], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    proc = subprocess.Popen([*cli, "ui", "--port", str(_free_port())], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _, banner = _address(proc)
        server = json.loads((tmp_path / "home" / "prefect" / "server.json").read_text())
        prefect = f"http://127.0.0.1:{server['port']}"
        assert f"Prefect UI: {prefect}" in banner, banner
        with Browser() as browser:
            text = browser.page_text(f"{prefect}/runs", lambda text: "posttrain-pipeline" in text and "1 run" in text)
            assert "posttrain-pipeline" in text and "1 run" in text, text[:2000]
    finally:
        _stop(proc)
        subprocess.run([*cli, "server", "stop"], cwd=tmp_path, env=env, capture_output=True, timeout=120)


def test_posttrain_ui_refuses_a_home_without_runs_and_a_busy_port(home, capsys):
    assert run_cli("ui") == 2
    assert "holds no MLflow store yet" in capsys.readouterr().err
    (home / "mlflow.db").parent.mkdir(parents=True)
    (home / "mlflow.db").touch()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        assert run_cli("ui", "--port", str(port)) == 2
    assert f"127.0.0.1:{port} is already in use" in capsys.readouterr().err


def test_dataset_inputs_wait_in_the_journal_while_the_store_is_unreachable(home, tmp_path):
    """An outage journals a stage's dataset inputs like its other writes; `posttrain sync` records them."""
    from flows.recording.data_inputs import stage_datasets
    from flows.recording.home import configure_environment
    from flows.recording.journal import Recorder, pending_runs, replay_pending
    from flows.spec.loading import load_pipeline
    from flows.recording.tracking import Tracker
    from stages.data.sources import materialize

    configure_environment()
    loaded = load_pipeline(write(tmp_path / "looking.yaml", PIPELINE))
    heldout = materialize(loaded.spec.data["heldout"], loaded.base_dir, home / "cache" / "data")
    tracker = Tracker(home)
    experiment = tracker.experiment_id("looking", None)
    run_id = tracker.start_stage_run(experiment, tracker.start_pipeline_run(experiment, "looking", {}), "eval_sft", {})
    recorder = Recorder(tracker.client, run_id, home)
    recorder.unavailable = "ConnectionError: simulated outage"  # what the first failed write sets
    recorder.datasets(stage_datasets(loaded, StageInputs(datasets={"heldout": heldout})))
    assert pending_runs(home) == [run_id] and not tracker.get_run(run_id).inputs.dataset_inputs
    assert recorder.summary() == "1 dataset input batches"

    assert replay_pending(tracker.client, home) == ([run_id], [])
    (entry,) = tracker.get_run(run_id).inputs.dataset_inputs
    assert (entry.dataset.name, json.loads(entry.dataset.profile)["num_rows"]) == ("heldout", 4)
    assert entry.dataset.digest == hashlib.sha256(heldout.read_bytes()).hexdigest()[:16]


def test_the_prefect_ui_address_is_printed_only_when_its_server_answers(prefect_server, home, monkeypatch):
    from prefect.settings import get_current_settings

    from flows.servers.ui import prefect_ui_address

    api = get_current_settings().api.url  # the session's real Prefect server
    monkeypatch.setenv("PREFECT_API_URL", api)
    assert prefect_ui_address() == api.removesuffix("/api")
    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{_free_port()}/api")  # nothing listens there
    assert prefect_ui_address() is None
    monkeypatch.delenv("PREFECT_API_URL")
    assert prefect_ui_address() is None
