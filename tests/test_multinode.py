"""``resources: {nodes: N, gpus: M}``: the layouts refused at validation, the Kubernetes indexed Job a
stage renders to (Prefect's own rendering of infra/prefect/gpu-k8s-job-template.json, checked against
the Kubernetes API schema by kubernetes-validate), the torchrun/accelerate command of each node, and
the hand-over of the rank file from node 0 to the others. Nothing here runs on a cluster."""

from __future__ import annotations

import asyncio
import copy
import json
import shlex
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, run_cli, write

TEMPLATE = ROOT / "infra" / "prefect" / "gpu-k8s-job-template.json"
SERVICE = ROOT / "infra" / "k8s" / "rendezvous-service.yaml"
KUBERNETES_VERSION = "1.33.0"  # the schema kubernetes-validate checks against (indexed Jobs are GA since 1.24)

PIPELINE = """\
name: nodes
model: {{init: tiny, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}}
data:
  train: {{generator: arithmetic, n: 64, role: train}}
  probe: {{generator: arithmetic, n: 8, role: probe}}
rewards:
  verifier: {{fn: exact_answer}}
stages:
  sft: {{kind: sft, data: train, max_steps: 2, batch_size: 8, resources: {sft}}}
  ppo: {{kind: rl, algorithm: ppo, policy: sft, data: train, rewards: [verifier], max_steps: 2,
        prompts_per_step: 4, sampling: {{attempts: 2}}, minibatch_size: 8, resources: {ppo}}}
  eval_probe: {{kind: eval, model: sft, data: probe}}
{iterate}"""


def validate(tmp_path, capsys, sft="{pool: gpu, nodes: 2, gpus: 4}", ppo="{processes: 1}", iterate=""):
    path = write(tmp_path / "nodes.yaml", PIPELINE.format(sft=sft, ppo=ppo, iterate=iterate))
    code = run_cli("validate", str(path))
    return code, capsys.readouterr().err


def test_a_multi_node_layout_validates(home, tmp_path, capsys):
    code, err = validate(tmp_path, capsys)
    assert code == 0, err


@pytest.mark.parametrize("sft, ppo, iterate, message", [
    ("{nodes: 2, gpus: 4}", "{processes: 1}", "",
     "stage 'sft' (sft) on 2 nodes x 4 processes: nodes: 2 needs a Kubernetes work pool"),
    ("{pool: gpu, nodes: 2}", "{processes: 1}", "", "several nodes train on GPUs: set `gpus: M` (per node)"),
    ("{pool: gpu, nodes: 2, gpus: 1, processes: 2}", "{processes: 1}", "",
     "`processes` counts CPU processes on one machine"),
    ("{processes: 1}", "{pool: gpu, nodes: 2, gpus: 1}", "",
     "stage 'ppo' (rl) on 2 nodes x 1 processes: ppo trains on several CPU processes (`processes: N`, DDP) only"),
    ("{pool: gpu, nodes: 2, gpus: 1}", "{processes: 1}", "iterate: {rounds: 2, collect: eval_probe, train: sft}",
     "the stage `iterate` retrains is refused on several nodes"),
])
def test_layouts_that_cannot_work_are_refused(home, tmp_path, capsys, sft, ppo, iterate, message):
    code, err = validate(tmp_path, capsys, sft, ppo, iterate)
    assert code == 2 and message in err, err


# ------------------------------------------------------------------ the Job a Kubernetes worker creates


def render(prefect_server, resources) -> dict:
    """The Job manifest a Kubernetes worker of the pool would create for this stage: Prefect's own
    rendering (``BaseJobConfiguration.from_template_and_values``, on the test server) of the base job
    template with the job variables posttrain sends (``run_stage_on_pool``), then the steps of
    prefect-kubernetes 0.8.0's ``prepare_for_flow_run`` that change the container: the flow run's env
    prepended to the template's list (``_populate_env_in_manifest``) and the command string split
    (``_populate_command_if_not_present``). prefect-kubernetes itself is not installed here: it
    requires prefect 3.9, this venv has 3.7."""
    from prefect.workers.base import BaseJobConfiguration

    from flows.execution.deployment import stage_job_variables

    class KubernetesJobConfiguration(BaseJobConfiguration):  # the fields prefect-kubernetes' class adds
        job_manifest: dict
        namespace: str

    values = {**(stage_job_variables(resources) or {}), "name": "posttrain-stage",
              "env": {"MLFLOW_TRACKING_URI": "http://mlflow:5000", "PREFECT__FLOW_RUN_ID": "1234"},
              "command": "prefect flow-run execute"}
    config = asyncio.run(KubernetesJobConfiguration.from_template_and_values(json.loads(TEMPLATE.read_text()),
                                                                             values))
    manifest = config.job_manifest
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": k, "value": v} for k, v in config.env.items()] + container["env"]
    container["args"] = shlex.split(container["args"])
    manifest["metadata"]["generateName"] = "posttrain-stage-"
    return manifest


def schema_errors(manifest: dict) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{'.'.join(map(str, error.path))}: {error.message}"]
    return []


def test_a_two_node_stage_renders_to_an_indexed_job_with_a_rendezvous_on_pod_0(prefect_server):
    from flows.execution.distributed import NodeRole, launch_command
    from stages.context import Resources

    resources = Resources(pool="gpu", nodes=2, gpus=4, strategy="fsdp")
    job = render(prefect_server, resources)
    assert schema_errors(job) == []
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 2, 2)
    assert spec["backoffLimit"] == 0  # one failed pod fails the stage, once
    pod = spec["template"]
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4  # per node
    assert container["command"] == ["python", "-m", "flows.execution.node"]
    assert container["args"] == ["prefect", "flow-run", "execute"]  # flows.execution.node runs it on pod 0 only

    # the headless Service selects these pods and is the pods' subdomain: pod 0 is <job>-0.posttrain-nodes
    service = yaml.safe_load(SERVICE.read_text())
    assert schema_errors(service) == []
    assert service["spec"]["clusterIP"] == "None"
    assert pod["spec"]["subdomain"] == service["metadata"]["name"] == "posttrain-nodes"
    assert all(pod["metadata"]["labels"].get(k) == v for k, v in service["spec"]["selector"].items())
    assert {p["port"] for p in service["spec"]["ports"]} == {p["containerPort"] for p in container["ports"]}

    env = container["env"]
    names = [e["name"] for e in env]
    by_name = {e["name"]: e for e in env}
    assert by_name["MLFLOW_TRACKING_URI"]["value"] == "http://mlflow:5000"  # the flow run's env comes first
    assert by_name["POSTTRAIN_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert by_name["POSTTRAIN_JOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['job-name']"
    assert by_name["MASTER_ADDR"]["value"] == "$(POSTTRAIN_JOB_NAME)-0.posttrain-nodes"
    assert names.index("POSTTRAIN_JOB_NAME") < names.index("MASTER_ADDR")  # Kubernetes expands earlier vars only
    assert by_name["MASTER_PORT"]["value"] == "29500"

    # what node 1 launches with that environment, as torchrun receives it from accelerate: accelerate's own
    # argument handling and torchrun's config (what `accelerate launch` does before starting the processes)
    node = NodeRole(rank=1, master_addr="posttrain-stage-x7k2p-0.posttrain-nodes", master_port=29500)
    config, entry = torchrun_config(launch_command(resources, Path("rank.json"), node))
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 4)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("static", f"{node.master_addr}:29500")
    assert config.rdzv_configs["rank"] == 1
    assert entry[-3:] == ["-m", "flows.execution.rank", "rank.json"]


def torchrun_config(command: list[str]):
    """(torchrun's LaunchConfig, the command each process runs) for an ``accelerate launch`` command line,
    through accelerate's ``multi_gpu_launcher`` steps short of starting anything."""
    import torch.distributed.run as torchrun
    from accelerate.commands.launch import _filter_args, _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    assert command[1:3] == ["-m", "accelerate.commands.launch"]
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(command[3:]))
    assert args.use_fsdp  # the strategy's config was read: accelerate runs it through multi_gpu_launcher
    environment = prepare_multi_gpu_env(args)
    assert environment["ACCELERATE_USE_FSDP"] == "true"
    args = _filter_args(args, torchrun.get_args_parser(),
                        ["--training_script", args.training_script, "--training_script_args", args.training_script_args])
    config, program, program_args = torchrun.config_from_args(args)
    return config, [program, *program_args]


def test_a_one_node_stage_renders_to_a_one_pod_job(prefect_server):
    from stages.context import Resources

    job = render(prefect_server, Resources(pool="gpu", gpus=1))
    assert schema_errors(job) == []
    assert (job["spec"]["completions"], job["spec"]["parallelism"]) == (1, 1)
    broken = copy.deepcopy(job)  # the schema check bites: an env value must be a string
    broken["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "NODES", "value": 2})
    assert schema_errors(broken)


# ------------------------------------------------------------------ each pod's part


def in_function(thread: threading.Thread, name: str) -> bool:
    """Whether ``thread``'s innermost Python frame is function ``name`` (it is blocked in a call into C there)."""
    frame = sys._current_frames().get(thread.ident)
    return frame is not None and frame.f_code.co_name == name


def test_pod_0_runs_the_flow_run_and_the_others_wait_for_its_rank_file():
    from flows.execution.distributed import NodeRole, fetch_rank_file, serve_rank_file
    from flows.execution.node import node_command

    assert node_command(["prefect", "flow-run", "execute"], {"POSTTRAIN_NODE_RANK": "0"}) == \
        (["prefect", "flow-run", "execute"], None)
    assert node_command(["prefect", "flow-run", "execute"], {}) == (["prefect", "flow-run", "execute"], None)
    command, rank_file = node_command(["prefect", "flow-run", "execute"], {"POSTTRAIN_NODE_RANK": "1"})
    assert command == [] and rank_file.endswith("posttrain-rank-file.json")

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1] - 1  # the rank file is served on MASTER_PORT + 1
    node = NodeRole(rank=1, master_addr="127.0.0.1", master_port=port)
    fetched = {}
    waiting = threading.Thread(target=lambda: fetched.update(text=fetch_rank_file(node, timeout_s=60)))
    waiting.start()  # node 1 comes up first and waits
    deadline = time.monotonic() + 60
    while not in_function(waiting, "fetch_rank_file"):  # inside the store client's connect: nothing serves yet
        assert waiting.is_alive() and time.monotonic() < deadline, "node 1 never began to wait for its rank file"
        time.sleep(0.01)
    assert waiting.is_alive() and not fetched
    store = serve_rank_file(NodeRole(0, "127.0.0.1", port), '{"job": "the stage"}')
    waiting.join(timeout=30)
    assert fetched == {"text": '{"job": "the stage"}'}
    del store


def test_several_nodes_need_a_kubernetes_pool(prefect_server):
    """The pool's type is the Prefect server's to say: `posttrain run` and `deploy` ask it (require_pool)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from flows.execution.deployment import DeployError, require_pool

    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name="gpu-process", type="process"), overwrite=True)
        client.create_work_pool(WorkPoolCreate(name="gpu-k8s", type="kubernetes",
                                               base_job_template=json.loads(TEMPLATE.read_text())), overwrite=True)
    require_pool("gpu-process")  # one node: any pool
    require_pool("gpu-k8s", nodes=2)
    with pytest.raises(DeployError, match="a stage on 2 nodes needs a Kubernetes work pool .* work pool "
                                          "'gpu-process' is of type 'process'"):
        require_pool("gpu-process", nodes=2)


@pytest.mark.slow
def test_the_other_nodes_read_the_inputs_from_mlflow_not_from_node_0s_disk(home, prefect_server, tmp_path, monkeypatch):
    """A rank on node 1 gets node 0's rank file, whose paths are node 0's disk: it resolves the upstream
    checkpoint from the MLflow store (downloading it into its own home) and builds the datasets itself."""
    from mlflow.tracking import MlflowClient

    from flows.planning.job import StageJob
    from flows.execution.rank import rank_inputs
    from flows.spec.loading import load_pipeline

    text = PIPELINE.format(sft="{processes: 1}", ppo="{processes: 1}", iterate="").replace(
        "max_steps: 2, batch_size: 8", "max_steps: 1, batch_size: 8")
    path = write(tmp_path / "nodes.yaml", text)
    assert run_cli("run", str(path), "--only", "sft") == 0
    client = MlflowClient()
    (sft,) = client.search_runs([client.get_experiment_by_name("nodes").experiment_id],
                                "tags.`posttrain.stage` = 'sft'")
    (home / "outputs").rename(tmp_path / "node-0-only")  # node 1 does not see node 0's disk
    loaded = load_pipeline(str(path), [])
    node_0_paths = {"policy": "/node-0/outputs/sft/checkpoint", "data.train": "/node-0/cache/data/train"}
    job = StageJob(pipeline=loaded.spec, pipeline_file=loaded.path, overrides=(), stage="ppo", seed=0,
                   resources=loaded.spec.resources_for("ppo"), time_limit_seconds=None, experiment_id="1",
                   parent_run_id="p", upstream_runs={"sft": sft.info.run_id},
                   upstream_outputs={"sft": {"checkpoint": node_0_paths["policy"]}})
    described = {"paths": node_0_paths}

    on_node_0 = rank_inputs(job, described, home)
    assert (str(on_node_0.policy), str(on_node_0.data)) == (node_0_paths["policy"], node_0_paths["data.train"])
    node_1_home = tmp_path / "node-1-home"
    monkeypatch.setenv("POSTTRAIN_NODE_RANK", "1")
    inputs = rank_inputs(job, described, node_1_home)
    policy, data = inputs.policy, inputs.data
    assert policy.is_relative_to(node_1_home / "downloads" / sft.info.run_id) and (policy / "config.json").exists()
    assert data.is_relative_to(node_1_home / "cache" / "data") and data.exists()
