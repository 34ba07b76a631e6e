"""`posttrain sweep`: every variant validated before anything runs; variants run as one flow in which a
stage they share (same fingerprint) runs once; runs tagged with variant and seed under a parent sweep run;
a rerun of the same sweep is all cache hits (an interrupted sweep resumes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli, write
from test_compare import WEAK  # its model, data and reward

# `base` is shared by both grid points (the grid changes only `tuned`, downstream of it)
SWEPT = WEAK.split("stages:")[0].replace("name: cmp", "name: swp") + """\
sweep:
  seeds: [0]
  grid: {stages.tuned.lr: [5.0e-3, 1.0e-7]}
stages:
  first: {kind: sft, data: train, max_steps: 2, batch_size: 8, lr: 1.0e-7}
  tuned: {kind: sft, model: first, data: train, max_steps: 40, batch_size: 16, lr: 5.0e-3}
  eval_first: {kind: eval, model: first, data: heldout, rewards: [number],
               sampling: {temperature: 1.0, max_tokens: 3, attempts: 4, seed: 1}}
  eval_tuned: {kind: eval, model: tuned, data: heldout, rewards: [number],
               sampling: {temperature: 1.0, max_tokens: 3, attempts: 4, seed: 1}}
"""


def test_a_bad_variant_refuses_the_sweep_before_anything_runs(home, tmp_path, capsys):
    path = write(tmp_path / "swp.yaml", SWEPT)
    code = run_cli("sweep", str(path), "--seeds", "0", "1", "--grid", "stages.tuned.max_steps=10,-3")
    assert code == 2
    err = capsys.readouterr().err
    assert "4 of 8 variants do not validate" in err  # 2 seeds x the file's 2 learning rates x 2 step counts
    assert "variant seed=0 stages.tuned.lr=0.005 stages.tuned.max_steps=-3:" in err
    assert "variant seed=1 stages.tuned.lr=1e-07 stages.tuned.max_steps=-3:" in err
    assert "stages.tuned.max_steps=10:" not in err
    assert "stages.tuned.max_steps" in err and "nothing was run" in err
    assert not home.exists()  # no store, no run: nothing started
    assert run_cli("sweep", str(path), "--grid", "stages.tuned.lr") == 2
    assert "expected PATH=V1,V2" in capsys.readouterr().err
    # side by side only where stages run on work pools (tests/test_pools.py runs it there)
    assert run_cli("sweep", str(path), "--parallel", "2") == 2
    err = capsys.readouterr().err
    assert "--parallel 2: variants run side by side only where stages run on work pools" in err, err
    assert run_cli("sweep", str(write(tmp_path / "par.yaml", SWEPT.replace("seeds: [0]", "seeds: [0]\n  parallel: 0")))) == 2
    assert "sweep.parallel" in capsys.readouterr().err
    assert not home.exists()


@pytest.mark.slow
def test_a_sweep_runs_a_shared_stage_once_tags_its_runs_and_resumes(home, prefect_server, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    path = write(tmp_path / "swp.yaml", SWEPT)
    assert run_cli("sweep", str(path)) == 0
    out = capsys.readouterr().out
    client = MlflowClient()
    experiment = client.get_experiment_by_name("swp").experiment_id

    def finished(stage):
        return client.search_runs([experiment], f"tags.`posttrain.stage` = '{stage}' and attributes.status = "
                                  "'FINISHED'")

    # `first` and its eval are shared by the two grid points: one run each; `tuned` ran once per grid point
    assert len(finished("first")) == 1 and len(finished("eval_first")) == 1
    tuned = finished("tuned")
    assert sorted(r.data.tags["posttrain.variant"] for r in tuned) == ["stages.tuned.lr=0.005",
                                                                      "stages.tuned.lr=1e-07"]
    assert finished("first")[0].data.tags["posttrain.variant"] == "-"  # no grid override reaches it
    assert all(r.data.tags["posttrain.seed"] == "0" for r in tuned)
    assert "stage executions: 6 ran, 2 cached" in out, out

    # a parent sweep run holds the summary; both pipeline runs are nested under it
    sweep = client.search_runs([experiment], "tags.`posttrain.role` = 'sweep'")[0]
    assert sweep.info.status == "FINISHED"
    pipelines = client.search_runs([experiment], f"tags.`posttrain.sweep` = '{sweep.info.run_id}' and "
                                   "tags.`posttrain.role` = 'pipeline'")
    assert len(pipelines) == 2 and all(p.data.tags["mlflow.parentRunId"] == sweep.info.run_id for p in pipelines)
    local = client.download_artifacts(sweep.info.run_id, "sweep.json", str(tmp_path))
    table = json.loads(Path(local).read_text(encoding="utf-8"))
    assert {"eval_tuned"} <= set(table["data"][i][table["columns"].index("eval")] for i in range(len(table["data"])))
    # mean ± SE per eval stage and variant, the paired gain over the eval upstream with its interval
    assert "eval_tuned [stages.tuned.lr=0.005]: pass_at_1 " in out and " ± " in out
    assert "gain eval_tuned [stages.tuned.lr=0.005] - eval_first: +" in out and "(paired z over 8 prompts" in out, out

    # the same sweep again (what an interrupted sweep's rerun does): every stage is a cache hit
    assert run_cli("sweep", str(path)) == 0
    assert "stage executions: 0 ran, 8 cached" in capsys.readouterr().out
    assert len(finished("tuned")) == 2

