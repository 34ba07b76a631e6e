"""The flows Prefect deployments point at (module-path entrypoints, so a worker imports them
from its installed posttrain):

- ``flows.deployment.pipeline_flow``: a whole pipeline (``posttrain deploy`` schedules it);
- ``flows.deployment.stage_flow``: one stage of a pipeline run, sent to a work pool by the
  orchestrating flow (``flows/pools.py``).
"""

from __future__ import annotations

from prefect import flow

from flows.pipeline import _build_flow
from flows.pools import STAGE_DEPLOYMENT_FLOW, execute_dispatched_stage

pipeline_flow = _build_flow()


@flow(name=STAGE_DEPLOYMENT_FLOW, log_prints=False, validate_parameters=True)
def stage_flow(pipeline_file: str, overrides: list[str], stage: str, upstream_runs: dict[str, str],
               experiment_id: str, parent_run_id: str, may_reuse: bool = True) -> str:
    """Run one stage of a pipeline run on this worker; returns its MLflow run id."""
    return execute_dispatched_stage(pipeline_file, overrides, stage, upstream_runs, experiment_id, parent_run_id,
                                    may_reuse)
