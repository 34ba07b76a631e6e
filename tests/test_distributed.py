"""``resources: {processes: 2}``: SFT really trains as two gloo processes on CPU, and its
loss matches the single-process run's (same global batch) within tolerance."""

from __future__ import annotations

import pytest

from conftest import run_cli, write

pytestmark = pytest.mark.slow

PIPELINE = """\
name: {name}
model: {{init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}}
data:
  train: {{generator: arithmetic, n: 1024, role: train}}
stages:
  sft: {{kind: sft, data: train, max_steps: 40, batch_size: 16, lr: 3.0e-3, logging_steps: 10,
        resources: {{processes: {processes}}}}}
"""


def test_sft_on_two_processes_matches_one(home, prefect_server, tmp_path):
    from mlflow.tracking import MlflowClient

    runs = {}
    for processes in (1, 2):
        name = f"ddp{processes}"
        path = write(tmp_path / f"{name}.yaml", PIPELINE.format(name=name, processes=processes))
        assert run_cli("run", str(path)) == 0
        client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
        experiment = client.get_experiment_by_name(name).experiment_id
        (runs[processes],) = client.search_runs([experiment], "tags.`posttrain.stage` = 'sft'")
    assert runs[1].data.params["world_size"] == "1"
    assert runs[2].data.params["world_size"] == "2"  # both processes joined the gloo process group
    assert runs[2].data.metrics["steps"] == runs[1].data.metrics["steps"] == 40
    one, two = runs[1].data.metrics["final_loss"], runs[2].data.metrics["final_loss"]
    assert runs[2].data.metrics["first_loss"] == pytest.approx(runs[1].data.metrics["first_loss"], rel=0.05)
    assert two == pytest.approx(one, rel=0.1), (one, two)


def test_more_processes_than_sft_supports_is_refused(home, tmp_path, capsys):
    text = PIPELINE.format(name="bad", processes=3)
    assert run_cli("validate", str(write(tmp_path / "bad.yaml", text))) == 2
    assert "batch_size 16 must divide evenly over 3 processes" in capsys.readouterr().err
