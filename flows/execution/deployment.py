"""Prefect, all of it: the pipeline flow, its stage task, deployments, and stages sent to work pools.

- ``posttrain run`` (``flows/cli.py``) runs ``pipeline_flow`` through ``run_flow``: one flow
  run per pipeline run, one task per stage (``execute`` of its ``StageJob``), in graph
  order, with retries for transient failures and a markdown artifact summarising the run.
- ``posttrain deploy FILE --cron ... --pool P`` registers ``pipeline_flow`` as a deployment on
  pool P with that schedule; its parameters are the pipeline file and the ``--set`` overrides.
- A stage whose ``resources.pool`` is set runs through the deployment
  ``posttrain-stage/<pool>`` (``stage_flow``, registered on first use): ``run_deployment``
  with idempotency key ``<pipeline run>:<stage>``, so a retried orchestrator never starts
  the same stage twice. The worker receives the stage's ``StageJob`` as JSON (it does not
  read the pipeline file), executes it exactly as the orchestrator would, against the same
  MLflow store, and writes the stage run it produced (or reused) onto the pipeline run as
  the tag ``posttrain.dispatched.<stage>``; the orchestrator reads the outputs back from
  MLflow. Cache hits are decided before anything is sent. The job variables sent are the
  stage's ``gpus`` (per pod) and ``nodes``: a Kubernetes pool's template runs ``nodes`` pods
  as one indexed Job (``flows/execution/node.py``), and a pool of another type is refused for
  ``nodes`` > 1 (``require_pool``).

Deployments use module-path entrypoints (``flows.deployment.pipeline_flow``,
``flows.deployment.stage_flow``): a worker needs posttrain installed (the GPU worker image
in ``infra/`` does that). The deploying shell's ``MLFLOW_TRACKING_URI`` and
``POSTTRAIN_HOME`` travel as the deployment's ``env`` job variables, so a worker records
into the same store. Prefect reads its API URL when it is first imported, so this module is
imported only once that is set (``flows.prefect_server.prefect_api``, a worker, ``deploy``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.execution.execute import StageFailed, StageRow, execute, headline_metrics, reuse_finished
from flows.recording.home import artifact_root, configure_environment
from flows.planning.job import StageJob
from flows.planning.lineage import Decision, RunOptions
from flows.execution.pipeline import PipelineReport, prepare_store, run_pipeline, summary_markdown
from flows.spec.loading import LoadedPipeline, load_pipeline
from flows.recording.tags import TAG_DISPATCHED, TAG_POOL, TAG_PREFECT_FLOW_RUN
from flows.recording.tracking import Tracker

STAGE_DEPLOYMENT_FLOW = "posttrain-stage"


class DeployError(Exception):
    """The deployment cannot be made (exit status 2): no server, no such pool, a bad schedule."""


# ------------------------------------------------------------------ the pipeline flow


def _is_transient(task, task_run, state) -> bool:
    """Retry only what a retry can fix: a tracking server or network hiccup, not a bug."""
    try:
        error = state.result(raise_on_failure=False)
    except Exception:
        return False
    cause = error.__cause__ if isinstance(error, StageFailed) else error
    return isinstance(cause, (ConnectionError, TimeoutError))


@task(name="stage", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5, retry_condition_fn=_is_transient)
def stage_task(job: StageJob, home: Path) -> StageRow:
    if job.resources.pool:  # a worker of that pool runs it
        return run_stage_on_pool(job, home)
    return execute(job, Tracker(home))


@flow(name="posttrain-pipeline", log_prints=False, validate_parameters=True)
def pipeline_flow(pipeline_file: str, overrides: list[str] | None = None, only: str | None = None,
                  from_stage: str | None = None, force: list[str] | None = None, no_cache: bool = False,
                  plan: list[dict] | None = None):
    """Run a posttrain pipeline file: plan from MLflow (unless ``plan`` was made just before by
    the CLI), then each stage as a task in graph order."""
    from prefect.runtime import flow_run

    home = configure_environment()
    loaded = load_pipeline(pipeline_file, overrides or [])
    if not plan:  # started by a deployment or its schedule: first what `posttrain run` does first
        from rich.console import Console

        tracker = prepare_store(home, Console(stderr=True))
        tracker.reap_dead_runs(tracker.experiment_id(loaded.spec.name, artifact_root(home)))
    options = RunOptions(only=only, from_stage=from_stage, force=list(force or []), no_cache=no_cache)
    report = run_pipeline(
        loaded, options, home,
        stage_call=lambda job: stage_task.with_options(task_run_name=job.stage)(job, home),
        flow_run_id=str(flow_run.get_id()),
        decisions=[Decision(**d) for d in plan] if plan else None,
    )
    _prefect_summary(report)
    if report.failed:
        failed = next(row for row in report.rows if row.status == "failed")
        raise StageFailed(f"stage {failed.stage!r} failed: {failed.note}", report)
    return report


def run_flow(loaded: LoadedPipeline, options: RunOptions, decisions: list[Decision]) -> PipelineReport:
    """Run the pipeline flow on the plan just made; its report, also when a stage failed."""
    plan = [{**asdict(d), "action": d.action.value} for d in decisions]
    state = pipeline_flow(str(loaded.path), loaded.overrides, options.only, options.from_stage, options.force,
                          options.no_cache, plan=plan, return_state=True)
    result = state.result(raise_on_failure=False)
    if isinstance(result, StageFailed) and result.report is not None:
        return result.report
    if isinstance(result, BaseException):
        raise result
    return result


@flow(name="posttrain-sweep", log_prints=False, validate_parameters=True)
def sweep_flow(pipeline_file: str, variants: list[dict], parallel: int = 1) -> list[PipelineReport]:
    """A sweep (flows/sweep.py) as one flow: each variant a pipeline run planned just before it starts, so a stage
    a variant already ran with the same fingerprint is a cache hit (it runs once); each stage is a task, sent to
    its work pool where it names one. One variant after another, or ``parallel`` side by side (``SharedStages``).
    No variant starts after one failed."""
    from prefect.runtime import flow_run

    home = configure_environment()
    flow_run_id = str(flow_run.get_id())

    def run_variant(variant: dict, stage_call) -> PipelineReport:
        loaded = load_pipeline(pipeline_file, variant["overrides"])
        report = run_pipeline(loaded, RunOptions(), home, stage_call=stage_call, flow_run_id=flow_run_id,
                              run_tags=variant["run_tags"], stage_tags=variant["stage_tags"])
        _prefect_summary(report)
        return report

    if parallel > 1:
        return _side_by_side(variants, parallel, run_variant, SharedStages(home))
    reports = []
    for variant in variants:
        reports.append(run_variant(variant, lambda job, name=variant["name"]: stage_task.with_options(
            task_run_name=f"{job.stage} {name}")(job, home)))
        if reports[-1].failed:
            break
    return reports


class SharedStages:
    """The stage calls of variants run side by side: one execution per stage fingerprint at a time, whose
    result the variants that waited on it reuse (the stage lock of ``execute`` does this across processes, but
    a pooled stage's lock is taken on a worker, whose disk may not be this one's), and the stages that run in
    this process one at a time (they would share its cores and its signal handling)."""

    def __init__(self, home: Path):
        self.home = home
        self._guard = threading.Lock()
        self._fingerprints: dict[tuple[str, str, str], threading.Lock] = {}
        self._here = threading.Lock()

    def call(self, job: StageJob, variant: str) -> StageRow:
        with self._guard:
            lock = self._fingerprints.setdefault((job.experiment_id, job.stage, job.fingerprint), threading.Lock())
        with lock:
            reused = reuse_finished(job, Tracker(self.home), "finished meanwhile by another variant of this sweep")
            if reused is not None:
                return reused
            task = stage_task.with_options(task_run_name=f"{job.stage} {variant}")
            if job.resources.pool:
                return task(job, self.home)
            with self._here:
                return task(job, self.home)


def _side_by_side(variants: list[dict], parallel: int, run_variant, shared: SharedStages) -> list[PipelineReport]:
    """Run ``parallel`` variants at a time, each in a thread of this flow run (daemon threads: a Ctrl-C of the
    sweep ends them with the process, and the rerun resumes); the reports in the variants' order."""
    import contextvars

    reports: list[PipelineReport | None] = [None] * len(variants)
    errors: list[BaseException] = []
    slots = threading.Semaphore(parallel)
    stop = threading.Event()

    def run(index: int, variant: dict) -> None:
        try:
            reports[index] = run_variant(variant, lambda job: shared.call(job, variant["name"]))
            if reports[index].failed:
                stop.set()
        except BaseException as error:  # re-raised in the flow's thread
            errors.append(error)
            stop.set()
        finally:
            slots.release()

    threads = []
    for index, variant in enumerate(variants):
        while not slots.acquire(timeout=0.5):
            pass
        if stop.is_set():
            slots.release()
            break
        thread = threading.Thread(target=contextvars.copy_context().run, args=(run, index, variant), daemon=True,
                                  name=f"variant {variant['name']}")
        thread.start()
        threads.append(thread)
    for thread in threads:
        while thread.is_alive():  # joined with a timeout: a Ctrl-C reaches the flow's thread at once
            thread.join(0.5)
    if errors:
        raise errors[0]
    return [report for report in reports if report is not None]


def run_sweep_flow(pipeline_file: str, variants: list[dict], parallel: int = 1) -> list[PipelineReport]:
    """Run the sweep flow; the reports of the variants it ran, also when one failed."""
    state = sweep_flow(pipeline_file, variants, parallel, return_state=True)
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException):
        raise result
    return result


def _prefect_summary(report: PipelineReport) -> None:
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(markdown=summary_markdown(report), key="posttrain-summary",
                             description=f"posttrain pipeline {report.pipeline}")


# ------------------------------------------------------------------ deployments and work pools


def _job_env() -> dict[str, str]:
    """What a worker's flow run needs to record into the same store as the deploying shell."""
    env = {}
    for key in ("MLFLOW_TRACKING_URI", "POSTTRAIN_HOME", "POSTTRAIN_TORCH_THREADS"):
        if os.environ.get(key):
            env[key] = os.environ[key]
    if "POSTTRAIN_HOME" in env:
        env["POSTTRAIN_HOME"] = str(Path(env["POSTTRAIN_HOME"]).resolve())
    return env


def require_pool(pool: str, nodes: int = 1) -> None:
    """The work pool exists, and is a Kubernetes pool if a stage sent to it runs on ``nodes`` > 1 machines."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            work_pool = client.read_work_pool(pool)
        except ObjectNotFound:
            names = [p.name for p in client.read_work_pools()]
            raise DeployError(
                f"work pool {pool!r} does not exist (pools: {', '.join(names) or 'none'}); create it with "
                f"`prefect work-pool create {pool} --type process` (or from infra/ for Kubernetes)"
            ) from None
    if nodes > 1 and work_pool.type != "kubernetes":
        raise DeployError(
            f"a stage on {nodes} nodes needs a Kubernetes work pool (an indexed Job of {nodes} pods); work pool "
            f"{pool!r} is of type {work_pool.type!r}, whose workers start one process on one machine: create it "
            "with `prefect work-pool create NAME --type kubernetes --base-job-template "
            "infra/prefect/gpu-k8s-job-template.json`"
        )


def stage_job_variables(resources) -> dict | None:
    """The job variables a stage sends its pool: GPUs per pod, and pods (nodes) of the indexed Job."""
    variables = {}
    if resources.gpus:
        variables["gpus"] = resources.gpus
    if resources.nodes > 1:
        variables["nodes"] = resources.nodes
    return variables or None


def deploy_pipeline(pipeline_file: Path, overrides: list[str], name: str, cron: str | None, pool: str,
                    timezone: str | None = None) -> str:
    """Create or update the pipeline's deployment; returns ``flow/deployment``."""
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.deployments.runner import EntrypointType

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
    deployment.apply(work_pool_name=pool)
    return f"{pipeline_flow.name}/{name}"


def ensure_stage_deployment(pool: str) -> str:
    """The ``posttrain-stage/<pool>`` deployment (created or refreshed)."""
    from prefect.deployments.runner import EntrypointType

    require_pool(pool)
    deployment = stage_flow.to_deployment(
        name=pool, job_variables={"env": _job_env()}, entrypoint_type=EntrypointType.MODULE_PATH,
        description=f"posttrain stages on work pool {pool}", tags=["posttrain"],
    )
    deployment.apply(work_pool_name=pool)
    return f"{STAGE_DEPLOYMENT_FLOW}/{pool}"


def run_stage_on_pool(job: StageJob, home: Path) -> StageRow:
    """Send one stage's job to its work pool and wait; the StageRow comes back through MLflow."""
    from prefect.deployments import run_deployment

    pool = job.resources.pool
    name = ensure_stage_deployment(pool)
    started = time.perf_counter()
    flow_run = run_deployment(
        name,
        parameters={"job": replace(job, upstream_outputs=None).to_json()},  # the worker reads them from MLflow
        idempotency_key=f"{job.parent_run_id}:{job.stage}",
        job_variables=stage_job_variables(job.resources),
        timeout=None, poll_interval=1, as_subflow=True,
        flow_run_name=f"{job.pipeline.name}:{job.stage}",
    )
    tracker = Tracker(home)
    dispatched = tracker.get_run(job.parent_run_id).data.tags.get(TAG_DISPATCHED + job.stage)
    result = json.loads(dispatched) if dispatched else {}
    run_id = result.get("run_id")
    if not flow_run.state.is_completed() or not run_id:
        reason = result.get("error") or (flow_run.state.message if flow_run.state else "no state")
        raise StageFailed(f"stage {job.stage!r} failed on work pool {pool!r}: {reason}", run_id=run_id)
    run = tracker.get_run(run_id)
    status = "cached" if result.get("status") == "cached" else "ran"
    return StageRow(job.stage, job.kind, status, time.perf_counter() - started, run_id,
                    headline_metrics(run.data.metrics, job.kind), f"on work pool {pool}", tracker.outputs_of(run))


@flow(name=STAGE_DEPLOYMENT_FLOW, log_prints=False, validate_parameters=True)
def stage_flow(job: dict) -> str:
    """Run one stage of a pipeline run on this worker, from its job; returns its MLflow run id.

    The stage runs exactly as in-process; what it produced (or reused) is reported onto the
    pipeline run."""
    from prefect.runtime import flow_run

    home = configure_environment()
    tracker = Tracker(home)
    job = StageJob.from_json(job)
    job = replace(job, upstream_outputs={u: tracker.outputs_of(tracker.get_run(run_id))
                                         for u, run_id in job.upstream_runs.items()},
                  extra_tags={**job.extra_tags, TAG_POOL: job.resources.pool or "",
                              TAG_PREFECT_FLOW_RUN: str(flow_run.get_id())})
    try:
        row = execute(job, tracker)
    except StageFailed as error:
        tracker.client.set_tag(job.parent_run_id, TAG_DISPATCHED + job.stage,
                               json.dumps({"run_id": error.run_id, "status": "failed", "error": str(error)[:2000]}))
        raise
    tracker.client.set_tag(job.parent_run_id, TAG_DISPATCHED + job.stage,
                           json.dumps({"run_id": row.run_id, "status": row.status}))
    return row.run_id
