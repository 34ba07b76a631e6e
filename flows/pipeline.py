"""Running a pipeline: one Prefect flow per pipeline run, one task per stage, in graph order.

The plan (which stages are cache hits) is made before anything launches. When every
selected stage is a cache hit there is nothing to launch, so no flow is started: the
pipeline run is still recorded in MLflow and summarised, which keeps a fully cached rerun
close to the cost of a few MLflow queries instead of Prefect's ~10 s server start-up.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flows.home import artifact_root, configure_environment
from flows.lineage import Decision, RunOptions, fingerprint, plan_run
from flows.spec import BASE, LoadedPipeline, load_pipeline
from flows.tracking import (
    TAG_FINGERPRINT,
    TAG_KIND,
    TAG_STAGE_RUNS,
    TAG_UPSTREAM,
    MlflowStageContext,
    Tracker,
)
from stages.data import materialize
from stages.models import resolve_base_checkpoint
from stages.registry import HEADLINE_METRICS, stage_runner


class StageFailed(Exception):
    """A stage raised at run time (exit status 1); carries the pipeline report when there is one."""

    def __init__(self, message: str, report: "PipelineReport | None" = None, run_id: str | None = None):
        super().__init__(message)
        self.report = report
        self.run_id = run_id


@dataclass
class StageRow:
    stage: str
    kind: str
    status: str  # ran, cached, failed, skipped, not run
    seconds: float = 0.0
    run_id: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    note: str = ""
    outputs: dict[str, str] = field(default_factory=dict)  # local paths of what the stage published


@dataclass
class PipelineReport:
    pipeline: str
    experiment_id: str
    parent_run_id: str
    rows: list[StageRow]
    seconds: float

    @property
    def failed(self) -> bool:
        return any(row.status == "failed" for row in self.rows)


# ------------------------------------------------------------------ stage execution (no Prefect here)


def resolve_inputs(loaded: LoadedPipeline, stage: str, upstream_outputs: dict[str, dict], home: Path) -> dict:
    """Local paths for everything a stage reads: checkpoints, datasets, reward specs."""
    spec = loaded.spec
    config = spec.stages[stage]
    inputs: dict = {"base_dir": str(loaded.base_dir)}
    for field_name, target in config.references().items():
        if target == BASE:
            path = resolve_base_checkpoint(spec.model, spec.seed, home / "cache" / "models", loaded.base_dir)
        else:
            path = upstream_outputs[target]["checkpoint"]
        inputs[field_name] = str(path)
    for i, name in enumerate(config.dataset_names()):
        path = materialize(spec.data[name], loaded.base_dir, home / "cache" / "data")
        inputs["data" if i == 0 else f"data_{name}"] = str(path)
    inputs["rewards"] = loaded.rewards_for(config.reward_names())
    inputs["reward_checks"] = {n: spec.reward_checks[n] for n in config.reward_names() if n in spec.reward_checks}
    return inputs


def _flat_params(prefix: str, value, out: dict) -> dict:
    if isinstance(value, dict):
        for key, item in value.items():
            _flat_params(f"{prefix}.{key}" if prefix else str(key), item, out)
    else:
        out[prefix] = value
    return out


def execute_stage(loaded, stage, upstream_runs, upstream_outputs, tracker, experiment_id, parent_run_id, home,
                  console=None) -> StageRow:
    """Run one stage in a fresh child run; publish its outputs only if it finished."""
    config = loaded.spec.stages[stage]
    fp = fingerprint(loaded, stage, upstream_runs)
    run_id = tracker.start_stage_run(
        experiment_id, parent_run_id, stage,
        {TAG_FINGERPRINT: fp, TAG_UPSTREAM: json.dumps(upstream_runs), TAG_KIND: config.kind},
    )
    tracker.log_params(run_id, _flat_params("", config.model_dump(mode="json"), {}))
    work_dir = home / "work" / run_id
    started = time.perf_counter()
    try:
        inputs = resolve_inputs(loaded, stage, upstream_outputs, home)
        tracker.log_params(run_id, {f"input.{k}": v for k, v in inputs.items()
                                    if k not in ("rewards", "reward_checks")})
        ctx = MlflowStageContext(tracker, run_id, work_dir, getattr(config, "seed", None) or loaded.spec.seed, console)
        stage_runner(config.kind)(config, inputs, ctx)
        ctx.flush()
        published = tracker.publish_outputs(run_id, loaded.spec.name, stage, ctx.staged)
        tracker.finish(run_id, "FINISHED")
    except KeyboardInterrupt:
        tracker.finish(run_id, "KILLED")
        raise
    except BaseException as error:
        try:  # record why; if the tracking server itself is what failed, the stage error still wins
            tracker.client.set_tag(run_id, "posttrain.error", f"{type(error).__name__}: {error}"[:5000])
            tracker.client.log_text(run_id, traceback.format_exc(), "error.txt")
            tracker.finish(run_id, "FAILED")
        except Exception:
            pass
        raise StageFailed(f"stage {stage!r} failed: {type(error).__name__}: {error}", run_id=run_id) from error
    shutil.rmtree(work_dir, ignore_errors=True)
    seconds = time.perf_counter() - started
    return StageRow(stage, config.kind, "ran", seconds, run_id, headline_metrics(tracker, run_id, config.kind),
                    outputs=published)


def headline_metrics(tracker, run_id: str, kind: str) -> dict[str, float]:
    metrics = tracker.get_run(run_id).data.metrics
    chosen = {}
    for pattern in HEADLINE_METRICS.get(kind, []):
        if pattern.endswith("*"):
            matches = [k for k in metrics if k.startswith(pattern[:-1]) and k not in chosen]
            if matches:  # the widest k
                widest = max(matches, key=lambda k: int(k.rsplit("_", 1)[-1]) if k.rsplit("_", 1)[-1].isdigit() else 0)
                chosen[widest] = metrics[widest]
        elif pattern in metrics:
            chosen[pattern] = metrics[pattern]
    return chosen


# ------------------------------------------------------------------ the Prefect flow


def _is_transient(task, task_run, state) -> bool:
    """Retry only what a retry can fix: a tracking server or network hiccup, not a bug."""
    try:
        error = state.result(raise_on_failure=False)
    except Exception:
        return False
    cause = error.__cause__ if isinstance(error, StageFailed) else error
    return isinstance(cause, (ConnectionError, TimeoutError))


@functools.lru_cache(maxsize=1)
def _build_flow():
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    @task(name="stage", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5, retry_condition_fn=_is_transient)
    def stage_task(loaded, stage, upstream_runs, upstream_outputs, experiment_id, parent_run_id, home):
        return execute_stage(loaded, stage, upstream_runs, upstream_outputs, Tracker(home), experiment_id,
                             parent_run_id, home)

    @flow(name="posttrain-pipeline", log_prints=False, validate_parameters=True)
    def pipeline_flow(pipeline_file: str, overrides: list[str] | None = None, only: str | None = None,
                      from_stage: str | None = None, force: list[str] | None = None, no_cache: bool = False,
                      plan: list[dict] | None = None):
        """Run a posttrain pipeline file: plan from MLflow (unless ``plan`` was made just before by
        the CLI), then each stage as a task in graph order."""
        from prefect.runtime import flow_run

        home = configure_environment()
        loaded = load_pipeline(pipeline_file, overrides or [])
        options = RunOptions(only=only, from_stage=from_stage, force=list(force or []), no_cache=no_cache)
        report = run_pipeline(
            loaded, options, home,
            stage_call=lambda *args: stage_task.with_options(task_run_name=args[1])(*args),
            flow_run_id=str(flow_run.get_id()),
            decisions=[Decision(**d) for d in plan] if plan else None,
        )
        _prefect_summary(report)
        if report.failed:
            failed = next(row for row in report.rows if row.status == "failed")
            raise StageFailed(f"stage {failed.stage!r} failed: {failed.note}", report)
        return report

    return pipeline_flow


def run_pipeline(loaded, options, home, stage_call=None, flow_run_id=None, decisions=None) -> PipelineReport:
    """Plan, record the pipeline run in MLflow, and execute stages in graph order."""
    tracker = Tracker(home)
    spec = loaded.spec
    experiment_id = tracker.experiment_id(spec.name, artifact_root(home))
    decisions = decisions or plan_run(loaded, options, tracker, experiment_id)
    started = time.perf_counter()
    parent = tracker.start_pipeline_run(experiment_id, spec.name, {
        "pipeline_file": str(loaded.path), "overrides": json.dumps(loaded.overrides),
        "options": json.dumps(asdict(options)), "seed": spec.seed,
    })
    tracker.client.log_text(parent, loaded.path.read_text(encoding="utf-8"), "pipeline.yaml")
    tracker.client.log_dict(parent, spec.model_dump(mode="json"), "pipeline.resolved.json")
    if flow_run_id:
        tracker.client.set_tag(parent, "posttrain.prefect_flow_run_id", flow_run_id)

    rows: list[StageRow] = []
    outputs: dict[str, dict] = {}
    run_ids: dict[str, str] = {}
    failed = False
    for decision in decisions:
        kind = spec.stages[decision.stage].kind
        if decision.action == "skip":
            rows.append(StageRow(decision.stage, kind, "skipped", note=decision.reason))
            continue
        if failed:
            rows.append(StageRow(decision.stage, kind, "not run", note="an earlier stage failed"))
            continue
        if decision.action == "cached":
            run = tracker.get_run(decision.cached_run_id)
            outputs[decision.stage] = tracker.outputs_of(run)
            run_ids[decision.stage] = decision.cached_run_id
            rows.append(StageRow(decision.stage, kind, "cached", 0.0, decision.cached_run_id,
                                 headline_metrics(tracker, decision.cached_run_id, kind), decision.reason))
            continue
        upstream = {u: run_ids[u] for u in _upstream(loaded, decision.stage)}
        args = (loaded, decision.stage, upstream, {u: outputs[u] for u in upstream}, experiment_id, parent, home)
        try:
            if stage_call is None:
                row = execute_stage(*args[:4], tracker, *args[4:])
            else:
                row = stage_call(*args)
        except StageFailed as error:
            failed = True
            cause = error.__cause__ or error
            rows.append(StageRow(decision.stage, kind, "failed", run_id=error.run_id,
                                 note=f"{type(cause).__name__}: {cause}"[:300]))
            continue
        except KeyboardInterrupt:
            tracker.client.set_tag(parent, TAG_STAGE_RUNS, json.dumps(run_ids))
            tracker.finish(parent, "KILLED")
            raise
        row.note = decision.reason
        rows.append(row)
        run_ids[decision.stage] = row.run_id
        outputs[decision.stage] = row.outputs

    tracker.client.set_tag(parent, TAG_STAGE_RUNS, json.dumps(run_ids))
    report = PipelineReport(spec.name, experiment_id, parent, rows, time.perf_counter() - started)
    tracker.client.log_text(parent, summary_markdown(report), "summary.md")
    tracker.finish(parent, "FAILED" if failed else "FINISHED")
    return report


def _upstream(loaded, stage):
    from flows.graph import upstream_of

    return upstream_of(loaded.spec)[stage]


# ------------------------------------------------------------------ summaries


def mlflow_run_url(experiment_id: str, run_id: str) -> str:
    uri = os.environ.get("POSTTRAIN_MLFLOW_UI_URL") or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith("http"):
        uri = "http://127.0.0.1:5000"  # where `mlflow ui` serves the local store (README)
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def _format_metrics(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.3g}" for k, v in metrics.items())


def summary_markdown(report: PipelineReport) -> str:
    lines = [
        f"### posttrain pipeline `{report.pipeline}`",
        "",
        f"Pipeline run: [{report.parent_run_id}]({mlflow_run_url(report.experiment_id, report.parent_run_id)})",
        "",
        "| stage | kind | status | seconds | key metrics | MLflow run |",
        "|---|---|---|---|---|---|",
    ]
    for row in report.rows:
        link = f"[{row.run_id[:8]}]({mlflow_run_url(report.experiment_id, row.run_id)})" if row.run_id else ""
        lines.append(f"| {row.stage} | {row.kind} | {row.status} | {row.seconds:.1f} | "
                     f"{_format_metrics(row.metrics)} | {link} |")
    return "\n".join(lines)


def _prefect_summary(report: PipelineReport) -> None:
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(markdown=summary_markdown(report), key="posttrain-summary",
                             description=f"posttrain pipeline {report.pipeline}")


def print_plan(decisions: list[Decision], console) -> None:
    for d in decisions:
        symbol = {"run": "run   ", "cached": "cached", "skip": "skip  "}[d.action]
        extra = f" ({d.cached_run_id})" if d.cached_run_id else ""
        console.print(f"  {symbol} {d.stage}: {d.reason}{extra}")


def print_summary(report: PipelineReport, console) -> None:
    from rich.table import Table

    table = Table(title=f"posttrain · {report.pipeline} · {report.seconds:.1f} s")
    for column in ("stage", "kind", "status", "seconds", "key metrics", "MLflow run"):
        table.add_column(column)
    for row in report.rows:
        style = {"failed": "red", "cached": "cyan", "ran": "green"}.get(row.status)
        table.add_row(row.stage, row.kind, row.status, f"{row.seconds:.1f}",
                      _format_metrics(row.metrics) or row.note[:160], row.run_id or "", style=style)
    console.print(table)
    console.print(f"pipeline run {report.parent_run_id} in experiment {report.experiment_id}")


def run_from_cli(loaded: LoadedPipeline, options: RunOptions, console) -> PipelineReport:
    """What ``posttrain run`` does after validation: plan, then flow (or no flow if all cached)."""
    home = configure_environment()
    tracker = Tracker(home)
    experiment_id = tracker.experiment_id(loaded.spec.name, artifact_root(home))
    decisions = plan_run(loaded, options, tracker, experiment_id)
    console.print(f"plan for {loaded.spec.name}:")
    print_plan(decisions, console)
    if not any(d.action == "run" for d in decisions):
        console.print("every selected stage is cached; nothing to launch")
        return run_pipeline(loaded, options, home, decisions=decisions)
    pipeline_flow = _build_flow()
    state = pipeline_flow(str(loaded.path), loaded.overrides, options.only, options.from_stage, options.force,
                          options.no_cache, plan=[asdict(d) for d in decisions], return_state=True)
    result = state.result(raise_on_failure=False)
    if isinstance(result, StageFailed) and result.report is not None:
        return result.report
    if isinstance(result, BaseException):
        raise result
    return result
