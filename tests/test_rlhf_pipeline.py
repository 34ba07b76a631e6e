"""pipelines/rlhf.yaml and pipelines/dpo.yaml shrunk through overrides and run stage by stage
(no Prefect): the reward model's stage is an upstream of the stages that score with it, in
MLflow's lineage tags and in the cache."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT

SHRINK = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=64",
          "data.train.n=200", "data.prefs.n=200", "data.heldout.n=8", "stages.sft.max_steps=10"]
EVAL = ["sampling.attempts=2", "sampling.max_tokens=3", "max_prompts=8"]


def shrunk(stages: dict[str, list[str]]) -> list[str]:
    return SHRINK + [f"stages.{stage}.{item}" for stage, items in stages.items() for item in items]


@pytest.fixture()
def one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(loaded, home, **options):
    from flows.planning.lineage import RunOptions
    from flows.execution.pipeline import run_pipeline

    return run_pipeline(loaded, RunOptions(**options), home)


@pytest.mark.slow
def test_rlhf_pipeline_lineage_runs_through_the_reward_model(home, one_thread):
    from flows.recording.home import configure_environment
    from flows.spec.loading import load_pipeline

    home = configure_environment()
    overrides = shrunk({
        "rm": ["max_steps=10", "eval_every=5"],
        "ppo": ["max_steps=2", "prompts_per_step=4"],
        "eval_sft": EVAL, "eval_ppo": EVAL,
    })
    loaded = load_pipeline(ROOT / "pipelines" / "rlhf.yaml", overrides)
    report = run(loaded, home)
    rows = {row.stage: row for row in report.rows}
    assert not report.failed, [(r.stage, r.note) for r in report.rows]
    assert [r.stage for r in report.rows] == ["sft", "rm", "eval_sft", "ppo", "eval_ppo"]
    assert "heldout_pairwise_accuracy" in rows["rm"].metrics
    assert "best_of_n_accuracy" in rows["eval_sft"].metrics and "best_of_n_accuracy" in rows["eval_ppo"].metrics

    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    upstream = json.loads(client.get_run(rows["ppo"].run_id).data.tags["posttrain.upstream"])
    assert upstream == {"sft": rows["sft"].run_id, "rm": rows["rm"].run_id}
    ppo_metrics = client.get_run(rows["ppo"].run_id).data.metrics
    assert {"reward/rm_score/mean", "reward/verifier/mean"} <= set(ppo_metrics)

    # a retrained reward model makes every stage that scores or selects with it stale
    again = run(loaded, home, force=["rm"])
    statuses = {row.stage: row.status for row in again.rows}
    assert statuses == {"sft": "cached", "rm": "ran", "eval_sft": "ran", "ppo": "ran", "eval_ppo": "ran"}


@pytest.mark.slow
def test_dpo_pipeline_runs_and_publishes_a_policy(home, one_thread):
    from flows.recording.home import configure_environment
    from flows.spec.loading import load_pipeline

    home = configure_environment()
    overrides = shrunk({"dpo": ["max_steps=5"], "eval_sft": EVAL, "eval_dpo": EVAL})
    report = run(load_pipeline(ROOT / "pipelines" / "dpo.yaml", overrides), home)
    rows = {row.stage: row for row in report.rows}
    assert not report.failed, [(r.stage, r.note) for r in report.rows]
    assert {"heldout_pairwise_accuracy", "rewards/margin"} <= set(rows["dpo"].metrics)
    assert "pass_at_1" in rows["eval_dpo"].metrics
