"""Against a real `mlflow server` on loopback: same pipeline, no other change than the URI.

The server is the session's (conftest.py `mlflow_server`), started and stopped by its PID. Outputs published by one
machine are fetched from the server's artifact store by another (simulated by deleting
the local outputs before `--only`).
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import run_cli, write

PIPELINE = """\
name: remote
model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2}
data:
  train: {generator: arithmetic, n: 64, role: train}
  heldout: {generator: arithmetic, n: 8, seed: 5, role: heldout}
stages:
  sft: {kind: sft, data: train, max_steps: 4, batch_size: 8}
  eval_sft: {kind: eval, model: sft, data: heldout, sampling: {attempts: 2, max_tokens: 3}}
"""


@pytest.mark.slow
def test_pipeline_against_a_real_mlflow_server(mlflow_server, home, prefect_server, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    path = write(tmp_path / "remote.yaml", PIPELINE)
    assert run_cli("run", str(path)) == 0
    assert not (home / "mlflow.db").exists()  # nothing went to the local store

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("remote")
    runs = {r.data.tags["posttrain.stage"]: r for r in
            client.search_runs([experiment.experiment_id], "tags.`posttrain.role` = 'stage'")}
    assert {s: r.info.status for s, r in runs.items()} == {"sft": "FINISHED", "eval_sft": "FINISHED"}
    assert "pass_at_1" in runs["eval_sft"].data.metrics

    # another machine: no local outputs, so the cached checkpoint comes from the server
    shutil.rmtree(home / "outputs")
    assert run_cli("run", str(path), "--only", "eval_sft") == 0
    rerun = client.search_runs([experiment.experiment_id], "tags.`posttrain.stage` = 'eval_sft'",
                               order_by=["attributes.start_time DESC"], max_results=1)[0]
    assert rerun.info.run_id != runs["eval_sft"].info.run_id and rerun.info.status == "FINISHED"
    assert json.loads(rerun.data.tags["posttrain.upstream"]) == {"sft": runs["sft"].info.run_id}
    assert (home / "downloads" / runs["sft"].info.run_id).is_dir()
