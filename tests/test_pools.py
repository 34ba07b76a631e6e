"""Beyond one machine, against real servers on loopback: a `prefect server` with process
workers on two pools ("cpu", and "gpu" standing in for a GPU pool) and an `mlflow server`.
`posttrain deploy` makes a scheduled deployment; triggered, a cpu worker runs the
pipeline, and the stage with `resources.pool: gpu` runs on the gpu worker; every result
lands in the MLflow server."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from conftest import ROOT, run_cli, write
from servers import MlflowServer, PrefectServer

pytestmark = pytest.mark.slow

PIPELINE = """\
name: pools
model: {init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}
data:
  train: {generator: arithmetic, n: 256, role: train}
  heldout: {generator: arithmetic, n: 8, seed: 5, role: heldout}
stages:
  sft: {kind: sft, data: train, max_steps: 10, batch_size: 8, resources: {pool: gpu}}
  eval_sft: {kind: eval, model: sft, data: heldout, sampling: {attempts: 2, max_tokens: 3}}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("stack")
    mlflow = MlflowServer(root / "mlflow")
    prefect = PrefectServer(root / "prefect")
    try:
        mlflow.start()
        prefect.start()
        for pool in ("cpu", "gpu"):
            created = prefect.cli("work-pool", "create", pool, "--type", "process")
            assert created.returncode == 0, created.stdout + created.stderr
        home = root / "home"
        env = {"POSTTRAIN_HOME": str(home), "MLFLOW_TRACKING_URI": mlflow.url, "POSTTRAIN_TORCH_THREADS": "1",
               "PYTHONPATH": str(ROOT)}
        for pool in ("cpu", "gpu"):
            prefect.worker(pool, env)
        yield {"root": root, "home": home, "mlflow": mlflow, "prefect": prefect, "env": env}
    finally:
        prefect.stop()
        mlflow.stop()


def posttrain(stack, *argv, timeout=600) -> subprocess.CompletedProcess:
    env = {**stack["prefect"].env, **stack["env"]}
    return subprocess.run([sys.executable, "-m", "flows.cli", *argv], env=env, cwd=stack["root"],
                          capture_output=True, text=True, timeout=timeout, check=False)


def flow_run(stack, flow_run_id: str) -> dict:
    return httpx.get(f"{stack['prefect'].api_url}/flow_runs/{flow_run_id}", timeout=10).json()


# The quickstart itself, shortened (its three evaluations on 16 held-out questions), with its sft stage sent to the
# gpu pool.
QUICKSTART_ON_POOLS = ["--set", "stages.sft.max_steps=10", "--set", "stages.grpo.max_steps=2",
                       "--set", "stages.grpo.prompts_per_step=4", "--set", "data.heldout.n=16",
                       "--set", "stages.sft.resources.pool=gpu"]


def test_deployed_quickstart_runs_through_workers_with_a_stage_on_the_other_pool(stack):
    from mlflow.tracking import MlflowClient

    quickstart = str(ROOT / "pipelines" / "quickstart.yaml")
    deployed = posttrain(stack, "deploy", quickstart, *QUICKSTART_ON_POOLS, "--cron", "0 3 * * *", "--pool", "cpu",
                         "--name", "pools")
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    assert "posttrain-pipeline/pools" in deployed.stdout

    inspected = stack["prefect"].cli("deployment", "inspect", "posttrain-pipeline/pools")
    assert "0 3 * * *" in inspected.stdout and "'cpu'" in inspected.stdout

    started = time.perf_counter()
    triggered = stack["prefect"].cli("deployment", "run", "posttrain-pipeline/pools", "--watch",
                                     "--watch-timeout", "600", timeout=660)
    seconds = time.perf_counter() - started
    logs = "\n".join(p.read_text()[-3000:] for p in stack["prefect"].root.glob("worker-*.log"))
    assert triggered.returncode == 0, triggered.stdout + triggered.stderr + logs
    print(f"deployed quickstart (shortened) through workers: {seconds:.1f} s wall")

    client = MlflowClient(stack["mlflow"].url)
    experiment = client.get_experiment_by_name("quickstart").experiment_id
    (parent,) = client.search_runs([experiment], "tags.`posttrain.role` = 'pipeline'")
    assert parent.info.status == "FINISHED"
    stages = {r.data.tags["posttrain.stage"]: r for r in
              client.search_runs([experiment], "tags.`posttrain.role` = 'stage'")}
    assert {s: r.info.status for s, r in stages.items()} == dict.fromkeys(
        ["eval_base", "sft", "eval_sft", "grpo", "eval_grpo"], "FINISHED")
    assert json.loads(stages["eval_sft"].data.tags["posttrain.upstream"]) == {"sft": stages["sft"].info.run_id}

    # where each ran, from Prefect's own records
    assert flow_run(stack, parent.data.tags["posttrain.prefect_flow_run_id"])["work_pool_name"] == "cpu"
    sft_flow_run = flow_run(stack, stages["sft"].data.tags["posttrain.prefect_flow_run_id"])
    assert sft_flow_run["work_pool_name"] == "gpu"
    assert sft_flow_run["idempotency_key"] == f"{parent.info.run_id}:sft"
    assert stages["sft"].data.tags["posttrain.pool"] == "gpu"

    # run again from the command line: everything is cached, nothing is sent anywhere
    again = posttrain(stack, "run", quickstart, *QUICKSTART_ON_POOLS)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "every selected stage is cached" in again.stdout


def test_deploy_refuses_a_missing_pool_and_a_missing_server(stack, tmp_path):
    path = write(tmp_path / "pools.yaml", PIPELINE)
    missing = posttrain(stack, "deploy", str(path), "--pool", "nowhere")
    assert missing.returncode == 2 and "work pool 'nowhere' does not exist" in missing.stderr
    env = {k: v for k, v in {**stack["prefect"].env, **stack["env"]}.items() if k != "PREFECT_API_URL"}
    no_server = subprocess.run([sys.executable, "-m", "flows.cli", "deploy", str(path)], env=env, cwd=tmp_path,
                               capture_output=True, text=True, timeout=120, check=False)
    assert no_server.returncode == 2 and "set PREFECT_API_URL" in no_server.stderr


def test_a_stage_on_several_nodes_is_refused_on_a_process_pool(stack, tmp_path):
    text = PIPELINE.replace("resources: {pool: gpu}", "resources: {pool: gpu, nodes: 2, gpus: 1}")
    for command in (["run"], ["deploy", "--pool", "cpu"]):
        refused = posttrain(stack, command[0], str(write(tmp_path / "nodes.yaml", text)), *command[1:])
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "a stage on 2 nodes needs a Kubernetes work pool" in refused.stderr, refused.stderr
        assert "work pool 'gpu' is of type 'process'" in refused.stderr


def test_prefect_accepts_the_gpu_base_job_template(stack):
    template = json.loads((ROOT / "infra" / "prefect" / "gpu-k8s-job-template.json").read_text())
    api = stack["prefect"].api_url
    created = httpx.post(f"{api}/work_pools/", json={"name": "gpu-k8s", "type": "kubernetes",
                                                     "base_job_template": template}, timeout=30)
    assert created.status_code == 201, created.text
    pool = httpx.get(f"{api}/work_pools/gpu-k8s", timeout=10).json()
    manifest = pool["base_job_template"]["job_configuration"]["job_manifest"]
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert manifest["spec"]["completions"] == manifest["spec"]["parallelism"] == "{{ nodes }}"
    assert pool["base_job_template"]["variables"]["properties"]["gpus"]["default"] == 1


def test_a_pool_stage_without_a_prefect_server_is_refused_before_anything_runs(home, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert run_cli("run", str(write(tmp_path / "pools.yaml", PIPELINE))) == 2
    assert "needs a Prefect server with workers" in capsys.readouterr().err
    assert not (home / "outputs").exists()


def test_infra_prefect_yaml_deploys_onto_the_server(stack):
    """`prefect deploy` accepts infra/prefect.yaml: the nightly quickstart and posttrain-stage/gpu."""
    deployed = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--prefect-file",
                               str(ROOT / "infra" / "prefect.yaml"), "--all"], env=stack["prefect"].env, cwd=ROOT,
                              capture_output=True, text=True, timeout=300, check=False)
    assert deployed.returncode == 0, deployed.stdout + deployed.stderr
    nightly = stack["prefect"].cli("deployment", "inspect", "posttrain-pipeline/quickstart")
    assert "0 3 * * *" in nightly.stdout
    assert stack["prefect"].cli("deployment", "inspect", "posttrain-stage/gpu").returncode == 0


SWEPT_ON_A_POOL = PIPELINE.replace("name: pools", "name: sweep-pool").replace("stages:", """\
sweep:
  grid: {stages.tuned.lr: [1.0e-3, 1.0e-4]}
stages:""").replace("resources: {pool: gpu}", "resources: {pool: sweep}") + """\
  tuned: {kind: sft, model: sft, data: train, max_steps: 200, batch_size: 8, lr: 1.0e-3, resources: {pool: sweep}}
"""


def test_a_sweep_on_a_work_pool_runs_its_variants_side_by_side_and_a_shared_stage_once(stack, tmp_path):
    """Two grid points of `tuned` on a pool: both variants plan `sft` (their common upstream) at once; it runs
    once and the other variant reuses it; the two `tuned` stages then train at the same time on the worker."""
    from mlflow.tracking import MlflowClient

    created = stack["prefect"].cli("work-pool", "create", "sweep", "--type", "process")
    assert created.returncode == 0, created.stdout + created.stderr
    # polling every second: the two variants' stages, sent within a second, start within about one
    stack["prefect"].worker("sweep", {**stack["env"], "PREFECT_WORKER_QUERY_SECONDS": "1"})
    swept = posttrain(stack, "sweep", str(write(tmp_path / "sweep.yaml", SWEPT_ON_A_POOL)))
    assert swept.returncode == 0, swept.stdout + swept.stderr
    assert "run side by side, at most 2 at once (work pool(s) sweep)" in swept.stdout
    assert "stage executions: 4 ran, 2 cached" in swept.stdout, swept.stdout  # sft and eval_sft reused

    client = MlflowClient(stack["mlflow"].url)
    experiment = client.get_experiment_by_name("sweep-pool").experiment_id

    def finished(stage):
        return client.search_runs([experiment], f"tags.`posttrain.stage` = '{stage}' and attributes.status = "
                                  "'FINISHED'")

    assert len(finished("sft")) == 1  # shared by both grid points: trained once
    tuned = finished("tuned")
    assert sorted(r.data.tags["posttrain.variant"] for r in tuned) == ["stages.tuned.lr=0.0001",
                                                                      "stages.tuned.lr=0.001"]
    assert all(r.data.tags["posttrain.pool"] == "sweep" for r in tuned)
    first, second = sorted(tuned, key=lambda r: r.info.start_time)
    assert second.info.start_time < first.info.end_time, "the two variants' stages did not overlap"
    assert len(finished("eval_sft")) == 1 and all(r.data.tags.get("posttrain.pool") is None
                                                   for r in finished("eval_sft"))
