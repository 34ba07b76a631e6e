"""Beyond one machine: scheduled pipeline deployments, and stages sent to Prefect work pools.

- ``posttrain deploy FILE --cron ... --pool P`` registers the pipeline flow
  (``flows.deployment.pipeline_flow``) as a deployment on pool P with that schedule; its
  parameters are the pipeline file and the ``--set`` overrides.
- A stage whose ``resources.pool`` is set runs through the deployment
  ``posttrain-stage/<pool>`` (``flows.deployment.stage_flow``, registered on first use):
  ``run_deployment`` with idempotency key ``<pipeline run>:<stage>``, so a retried
  orchestrator never starts the same stage twice. The worker's flow run executes the stage
  exactly as the orchestrator would (``execute_stage``) against the same MLflow store, and
  writes the stage run it produced (or reused) onto the pipeline run as the tag
  ``posttrain.dispatched.<stage>``; the orchestrator reads the outputs back from MLflow.
  Cache hits are decided before anything is sent.

Deployments use module-path entrypoints: a worker needs posttrain installed (the GPU
worker image in ``infra/`` does that) and sees the pipeline file at the same path (a
shared filesystem or the same image). The deploying shell's ``MLFLOW_TRACKING_URI`` and
``POSTTRAIN_HOME`` travel as the deployment's ``env`` job variables, so a worker records
into the same store.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from flows.tags import (
    TAG_DISPATCHED,
    TAG_POOL,
    TAG_PREFECT_FLOW_RUN,
)
STAGE_DEPLOYMENT_FLOW = "posttrain-stage"


class DeployError(Exception):
    """The deployment cannot be made (exit status 2): no server, no such pool, a bad schedule."""


def _job_env() -> dict[str, str]:
    """What a worker's flow run needs to record into the same store as the deploying shell."""
    env = {}
    for key in ("MLFLOW_TRACKING_URI", "POSTTRAIN_HOME", "POSTTRAIN_TORCH_THREADS"):
        if os.environ.get(key):
            env[key] = os.environ[key]
    if "POSTTRAIN_HOME" in env:
        env["POSTTRAIN_HOME"] = str(Path(env["POSTTRAIN_HOME"]).resolve())
    return env


def require_pool(pool: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            names = [p.name for p in client.read_work_pools()]
            raise DeployError(
                f"work pool {pool!r} does not exist (pools: {', '.join(names) or 'none'}); create it with "
                f"`prefect work-pool create {pool} --type process` (or from infra/ for Kubernetes)"
            ) from None


def deploy_pipeline(pipeline_file: Path, overrides: list[str], name: str, cron: str | None, pool: str,
                    timezone: str | None = None) -> str:
    """Create or update the pipeline's deployment; returns ``flow/deployment``."""
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.deployments.runner import EntrypointType

    from flows.deployment import pipeline_flow

    require_pool(pool)
    schedules = []
    if cron:
        try:
            schedules = [CronSchedule(cron=cron, timezone=timezone or "UTC")]
        except ValueError as error:
            raise DeployError(f"--cron {cron!r}: {error}") from None
    deployment = pipeline_flow.to_deployment(
        name=name,
        parameters={"pipeline_file": str(pipeline_file.resolve()), "overrides": list(overrides)},
        schedules=schedules,
        job_variables={"env": _job_env()},
        entrypoint_type=EntrypointType.MODULE_PATH,
        description=f"posttrain pipeline {pipeline_file.name}",
        tags=["posttrain"],
    )
    deployment.entrypoint = "flows.deployment.pipeline_flow"  # the flow function itself lives in flows.pipeline
    deployment.apply(work_pool_name=pool)
    return f"{pipeline_flow.name}/{name}"


def ensure_stage_deployment(pool: str) -> str:
    """The ``posttrain-stage/<pool>`` deployment (created or refreshed)."""
    from prefect.deployments.runner import EntrypointType

    from flows.deployment import stage_flow

    require_pool(pool)
    deployment = stage_flow.to_deployment(
        name=pool, job_variables={"env": _job_env()}, entrypoint_type=EntrypointType.MODULE_PATH,
        description=f"posttrain stages on work pool {pool}", tags=["posttrain"],
    )
    deployment.apply(work_pool_name=pool)
    return f"{STAGE_DEPLOYMENT_FLOW}/{pool}"


def run_stage_on_pool(loaded, stage: str, upstream_runs: dict, experiment_id: str, parent_run_id: str, home: Path,
                      may_reuse: bool):
    """Send one stage to its work pool and wait; the StageRow comes back through MLflow."""
    from prefect.deployments import run_deployment

    from flows.pipeline import StageFailed, StageRow, headline_metrics
    from flows.tracking import Tracker

    resources = loaded.spec.resources_for(stage)
    kind = loaded.spec.stages[stage].kind
    name = ensure_stage_deployment(resources.pool)
    started = time.perf_counter()
    flow_run = run_deployment(
        name,
        parameters={"pipeline_file": str(loaded.path), "overrides": list(loaded.overrides), "stage": stage,
                    "upstream_runs": upstream_runs, "experiment_id": experiment_id,
                    "parent_run_id": parent_run_id, "may_reuse": may_reuse},
        idempotency_key=f"{parent_run_id}:{stage}",
        job_variables={"gpus": resources.gpus} if resources.gpus else None,
        timeout=None, poll_interval=1, as_subflow=True,
        flow_run_name=f"{loaded.spec.name}:{stage}",
    )
    tracker = Tracker(home)
    dispatched = tracker.get_run(parent_run_id).data.tags.get(TAG_DISPATCHED + stage)
    result = json.loads(dispatched) if dispatched else {}
    run_id = result.get("run_id")
    if not flow_run.state.is_completed() or not run_id:
        reason = result.get("error") or (flow_run.state.message if flow_run.state else "no state")
        raise StageFailed(f"stage {stage!r} failed on work pool {resources.pool!r}: {reason}", run_id=run_id)
    run = tracker.get_run(run_id)
    status = "cached" if result.get("status") == "cached" else "ran"
    return StageRow(stage, kind, status, time.perf_counter() - started, run_id,
                    headline_metrics(tracker, run_id, kind), f"on work pool {resources.pool}",
                    tracker.outputs_of(run))


def execute_dispatched_stage(pipeline_file: str, overrides: list[str], stage: str, upstream_runs: dict,
                             experiment_id: str, parent_run_id: str, may_reuse: bool) -> str:
    """What the worker runs: the stage, exactly as in-process, reported onto the pipeline run."""
    from prefect.runtime import flow_run

    from flows.home import configure_environment
    from flows.pipeline import StageFailed, execute_stage
    from flows.spec import load_pipeline
    from flows.tracking import Tracker

    home = configure_environment()
    loaded = load_pipeline(pipeline_file, overrides)
    pool = loaded.spec.resources_for(stage).pool
    tracker = Tracker(home)
    upstream_outputs = {u: tracker.outputs_of(tracker.get_run(run_id)) for u, run_id in upstream_runs.items()}
    try:
        row = execute_stage(loaded, stage, upstream_runs, upstream_outputs, tracker, experiment_id, parent_run_id,
                            home, may_reuse=may_reuse,
                            extra_tags={TAG_POOL: pool or "", TAG_PREFECT_FLOW_RUN: str(flow_run.get_id())})
    except StageFailed as error:
        tracker.client.set_tag(parent_run_id, TAG_DISPATCHED + stage,
                               json.dumps({"run_id": error.run_id, "status": "failed", "error": str(error)[:2000]}))
        raise
    tracker.client.set_tag(parent_run_id, TAG_DISPATCHED + stage, json.dumps({"run_id": row.run_id, "status": row.status}))
    return row.run_id
