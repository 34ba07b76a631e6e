"""Running a pipeline: one Prefect flow per pipeline run, one task per stage, in graph order.

The plan (which stages are cache hits) is made before anything launches. When every
selected stage is a cache hit there is nothing to launch, so no flow is started: the
pipeline run is still recorded in MLflow and summarised, which keeps a fully cached rerun
close to the cost of a few MLflow queries instead of Prefect's ~10 s server start-up.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flows.graph import stage_references
from flows.home import artifact_root, configure_environment, posttrain_home, uses_local_mlflow
from flows.iterate import (
    FAILURES_INPUT,
    failure_set_inputs,
    print_rounds,
    round_tags,
    rounds_markdown,
)
from flows.lineage import Action, Decision, PlanError, RunOptions, fingerprint, plan_run
from flows.locks import stage_lock
from flows.models import record_stage_model
from flows.recording import (
    Recorder,
    TrackingUnavailable,
    broken_journals,
    check_reachable,
    is_unavailable,
    replay_pending,
)
from flows.spec import BASE, LoadedPipeline, load_pipeline
from flows.tags import (
    TAG_ERROR,
    TAG_FINGERPRINT,
    TAG_KIND,
    TAG_PREFECT_FLOW_RUN,
    TAG_SEED,
    TAG_STAGE_RUNS,
    TAG_UPSTREAM,
)
from flows.tracking import MlflowStageContext, Tracker
from stages.context import StageTimeLimit
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
    unrecorded: str = ""  # what could not be written to MLflow (the store was unreachable), in words


@dataclass
class PipelineReport:
    pipeline: str
    experiment_id: str
    parent_run_id: str
    rows: list[StageRow]
    seconds: float

    unrecorded: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return any(row.status == "failed" for row in self.rows)


# ------------------------------------------------------------------ stage execution (no Prefect here)


def resolve_inputs(loaded: LoadedPipeline, stage: str, upstream_outputs: dict[str, dict], home: Path) -> dict:
    """Local paths for everything a stage reads: checkpoints, datasets, reward specs."""
    spec = loaded.spec
    config = spec.stages[stage]
    # The pipeline's trust in its model's own code (off unless it says so) travels to every stage.
    inputs: dict = {"base_dir": str(loaded.base_dir),
                    "trust_remote_code": bool(getattr(spec.model, "trust_remote_code", False))}
    for field_name, target in stage_references(spec, stage).items():  # reward models' stages included
        if target == BASE:
            path = resolve_base_checkpoint(spec.model, spec.seed, home / "cache" / "models", loaded.base_dir)
        elif field_name == FAILURES_INPUT:  # iterate: the failure set of round r-1's collect step
            path = upstream_outputs[target]["failures"]
        else:
            path = upstream_outputs[target]["checkpoint"]
        inputs[field_name] = str(path)
    for i, name in enumerate(config.dataset_names()):
        path = materialize(spec.data[name], loaded.base_dir, home / "cache" / "data", spec.data)
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
                  console=None, may_reuse: bool = True, extra_tags: dict[str, str] | None = None) -> StageRow:
    """Run one stage in a fresh child run, unless another process just produced the same result.

    The stage lock serialises executions with one fingerprint across processes; once it is
    held, a FINISHED run with this fingerprint (another ``posttrain run`` finished it while
    this one waited) is reused unless the stage was forced.
    """
    config = loaded.spec.stages[stage]
    fp = fingerprint(loaded, stage, upstream_runs)

    def waiting(holder: str) -> None:
        print(f"stage {stage}: {holder} is running it with the same fingerprint; waiting for it",
              file=sys.stderr, flush=True)

    try:
        with stage_lock(home, experiment_id, stage, fp, waiting):
            if may_reuse:
                hit = tracker.find_cached(experiment_id, stage, fp)
                if hit is not None:
                    return StageRow(stage, config.kind, "cached", 0.0, hit.info.run_id,
                                    headline_metrics(tracker, hit.info.run_id, config.kind),
                                    "finished meanwhile by another posttrain run", tracker.outputs_of(hit))
            return _run_stage(loaded, stage, fp, upstream_runs, upstream_outputs, tracker, experiment_id,
                              parent_run_id, home, console, extra_tags or {})
    except (StageFailed, KeyboardInterrupt, TrackingUnavailable):
        raise
    except Exception as error:
        if is_unavailable(error):
            raise TrackingUnavailable(f"stage {stage!r} could not start: the MLflow store is unreachable "
                                      f"({str(error).splitlines()[0][:200]})") from error
        raise


def _run_stage(loaded, stage, fp, upstream_runs, upstream_outputs, tracker, experiment_id, parent_run_id, home,
               console, extra_tags: dict[str, str]) -> StageRow:
    """Run one stage; publish its outputs only if it finished; keep its trainer checkpoints if it did not."""
    config = loaded.spec.stages[stage]
    run_id = tracker.start_stage_run(
        experiment_id, parent_run_id, stage,
        {TAG_FINGERPRINT: fp, TAG_UPSTREAM: json.dumps(upstream_runs), TAG_KIND: config.kind, **extra_tags,
         **round_tags(loaded.spec, stage)},
    )
    recorder = Recorder(tracker.client, run_id, home)
    recorder.params(_flat_params("", config.model_dump(mode="json"), {}))
    work_dir = home / "work" / run_id
    # Keyed by fingerprint, not run id: the next execution of the same stage resumes from it.
    resume_dir = home / "resume" / experiment_id / f"{stage}-{fp}"
    started = time.perf_counter()
    try:
        inputs = resolve_inputs(loaded, stage, upstream_outputs, home)
        inputs = failure_set_inputs(loaded, stage, inputs, upstream_runs, tracker, recorder, home)  # iterate
        recorder.params({f"input.{k}": v for k, v in inputs.items() if k not in ("rewards", "reward_checks")})
        seed = loaded.spec.seed_for(stage)
        recorder.tags({TAG_SEED: str(seed)})
        ctx = MlflowStageContext(tracker, run_id, work_dir, seed, console, resume_dir=resume_dir, recorder=recorder)
        limit = getattr(config, "time_limit_minutes", None)
        resources = loaded.spec.resources_for(stage)
        with time_limit(stage, limit * 60 if limit else None, ctx):
            if resources.world_size() > 1:  # N training processes (flows/distributed.py)
                from flows.distributed import run_distributed

                run_distributed(loaded, stage, upstream_outputs, ctx, resources)
            else:
                stage_runner(config.kind)(config, inputs, ctx)
        ctx.flush()
    except KeyboardInterrupt:
        recorder.tags({TAG_ERROR: "interrupted (Ctrl-C); trainer checkpoints so far are kept in "
                                          f"{resume_dir} and the next run of this stage resumes from them"})
        recorder.terminate("KILLED")
        raise
    except BaseException as error:
        try:  # record why; if recording itself breaks, the stage's error still wins
            recorder.tags({TAG_ERROR: f"{type(error).__name__}: {error}"[:5000]})
            recorder.text(traceback.format_exc(), "error.txt")
            recorder.terminate("FAILED")
        except Exception:
            pass
        raise StageFailed(f"stage {stage!r} failed: {type(error).__name__}: {error}", run_id=run_id) from error
    published = tracker.publish_outputs(recorder, loaded.spec.name, stage, ctx.staged)
    record_stage_model(recorder, loaded.spec.name, stage, config, upstream_runs, published)  # flows/models.py
    seconds = time.perf_counter() - started
    shutil.rmtree(work_dir, ignore_errors=True)
    shutil.rmtree(resume_dir, ignore_errors=True)
    row = StageRow(stage, config.kind, "ran", seconds, run_id, outputs=published)
    if recorder.offline and not recorder.retry(float(os.environ.get("POSTTRAIN_TRACKING_RETRY_SECONDS", "60"))):
        row.unrecorded = (f"stage {stage} finished and its outputs are on disk ({', '.join(published.values())}), "
                          f"but the MLflow store became unreachable ({recorder.unavailable}); not recorded: "
                          f"{recorder.summary()}. They wait in {recorder.journal_path}; `posttrain sync` "
                          "(or any later `posttrain run`) records them once the store is back")
        row.metrics = {}
        return row
    row.metrics = headline_metrics(tracker, run_id, config.kind)
    return row


@contextlib.contextmanager
def time_limit(stage: str, seconds: float | None, ctx):
    """The stage's deadline: stages that can stop cleanly watch ``ctx.deadline``; at most
    ``TIME_LIMIT_GRACE`` seconds later, SIGALRM stops whatever still runs (main thread only:
    elsewhere the clean stop is the only one)."""
    if not seconds:
        yield
        return
    ctx.deadline = time.monotonic() + seconds
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    grace = max(float(os.environ.get("POSTTRAIN_TIME_LIMIT_GRACE_SECONDS", TIME_LIMIT_GRACE)), 0.1 * seconds)

    def stop(signum, frame):
        raise StageTimeLimit(f"stage {stage!r} ran {grace:.0f} s past its time limit of {seconds / 60:g} min "
                             "and was stopped")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds + grace)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


TIME_LIMIT_GRACE = 30.0


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
    def stage_task(loaded, stage, upstream_runs, upstream_outputs, experiment_id, parent_run_id, home, may_reuse):
        if loaded.spec.resources_for(stage).pool:  # a worker of that pool runs it (flows/pools.py)
            from flows.pools import run_stage_on_pool

            return run_stage_on_pool(loaded, stage, upstream_runs, experiment_id, parent_run_id, home, may_reuse)
        return execute_stage(loaded, stage, upstream_runs, upstream_outputs, Tracker(home), experiment_id,
                             parent_run_id, home, may_reuse=may_reuse)

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
    recorder = Recorder(tracker.client, parent, home)
    recorder.text(loaded.path.read_text(encoding="utf-8"), "pipeline.yaml")
    recorder.text(json.dumps(spec.model_dump(mode="json"), indent=2), "pipeline.resolved.json")
    if flow_run_id:
        recorder.tags({TAG_PREFECT_FLOW_RUN: flow_run_id})

    rows: list[StageRow] = []
    outputs: dict[str, dict] = {}
    run_ids: dict[str, str] = {}
    failed = False
    for decision in decisions:
        kind = spec.stages[decision.stage].kind
        if decision.action is Action.SKIP:
            rows.append(StageRow(decision.stage, kind, "skipped", note=decision.reason))
            continue
        if failed:
            rows.append(StageRow(decision.stage, kind, "not run", note="an earlier stage failed"))
            continue
        if decision.action is Action.CACHED:
            run = tracker.get_run(decision.cached_run_id)
            outputs[decision.stage] = tracker.outputs_of(run)
            run_ids[decision.stage] = decision.cached_run_id
            rows.append(StageRow(decision.stage, kind, "cached", 0.0, decision.cached_run_id,
                                 headline_metrics(tracker, decision.cached_run_id, kind), decision.reason))
            continue
        upstream = {u: run_ids[u] for u in _upstream(loaded, decision.stage)}
        may_reuse = decision.may_reuse
        args = (loaded, decision.stage, upstream, {u: outputs[u] for u in upstream}, experiment_id, parent, home,
                may_reuse)
        try:
            if stage_call is None:
                row = execute_stage(*args[:4], tracker, *args[4:7], may_reuse=may_reuse)
            else:
                row = stage_call(*args)
        except (StageFailed, TrackingUnavailable) as error:
            failed = True
            cause = error.__cause__ if isinstance(error, StageFailed) and error.__cause__ else error
            rows.append(StageRow(decision.stage, kind, "failed", run_id=getattr(error, "run_id", None),
                                 note=f"{type(cause).__name__}: {cause}"[:300]))
            continue
        except KeyboardInterrupt:
            recorder.tags({TAG_STAGE_RUNS: json.dumps(run_ids)})
            recorder.terminate("KILLED")
            raise
        row.note = row.note or decision.reason
        rows.append(row)
        run_ids[decision.stage] = row.run_id
        outputs[decision.stage] = row.outputs

    report = PipelineReport(spec.name, experiment_id, parent, rows, time.perf_counter() - started,
                            [row.unrecorded for row in rows if row.unrecorded])
    recorder.tags({TAG_STAGE_RUNS: json.dumps(run_ids)})
    recorder.text(summary_markdown(report), "summary.md")
    recorder.terminate("FAILED" if failed else "FINISHED")
    if recorder.offline:
        report.unrecorded.append(f"the pipeline run's own record ({recorder.summary()}) waits in "
                                 f"{recorder.journal_path}")
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
    lines += rounds_markdown(report.rows)  # iterate: each round's evaluation side by side
    return "\n".join(lines)


def _prefect_summary(report: PipelineReport) -> None:
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(markdown=summary_markdown(report), key="posttrain-summary",
                             description=f"posttrain pipeline {report.pipeline}")


def print_plan(decisions: list[Decision], console) -> None:
    for d in decisions:
        symbol = {Action.RUN: "run   ", Action.CACHED: "cached", Action.SKIP: "skip  "}[d.action]
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
    print_rounds(report.rows, console)  # iterate: each round's evaluation side by side
    console.print(f"pipeline run {report.parent_run_id} in experiment {report.experiment_id}")
    for message in report.unrecorded:
        console.print(f"[bold yellow]not recorded in MLflow:[/bold yellow] {message}", highlight=False)


def prepare_store(home: Path, console) -> Tracker:
    """Before planning: the store answers, what an earlier outage left unrecorded is sent."""
    try:
        check_reachable()
    except TrackingUnavailable as error:
        raise PlanError(f"{error}; start it, or unset MLFLOW_TRACKING_URI to use the local store") from None
    tracker = Tracker(home)
    done, left = replay_pending(tracker.client, home)
    if done:
        console.print(f"recorded {len(done)} run(s) that an earlier tracking outage left waiting: {', '.join(done)}")
    if left:
        console.print(f"[yellow]{len(left)} run(s) still wait to be recorded: {', '.join(left)}[/yellow]")
    for problem in broken_journals(home):
        console.print(f"[yellow]{problem}[/yellow]", highlight=False, markup=False)
    return tracker


def _check_pools(loaded: LoadedPipeline, decisions: list[Decision]) -> None:
    """Stages that will run on a work pool need a real Prefect server and that pool."""
    pools = {d.stage: loaded.spec.resources_for(d.stage).pool for d in decisions if d.action is Action.RUN}
    pools = {stage: pool for stage, pool in pools.items() if pool}
    if not pools:
        return
    if not os.environ.get("PREFECT_API_URL"):
        stage, pool = next(iter(pools.items()))
        raise PlanError(f"stage {stage!r} runs on work pool {pool!r}, which needs a Prefect server with workers: "
                        "set PREFECT_API_URL (see README, Scaling out)")
    from flows.pools import DeployError, require_pool

    for pool in set(pools.values()):
        try:
            require_pool(pool)
        except DeployError as error:
            raise PlanError(str(error)) from None


class _EmptyStore:
    """A tracking store with no runs, for planning before the real one exists."""

    def find_cached(self, experiment_id, stage, fingerprint):
        return None


def run_from_cli(loaded: LoadedPipeline, options: RunOptions, console) -> PipelineReport:
    """What ``posttrain run`` does after validation: plan, then flow (or no flow if all cached)."""
    from flows.prefect_server import prefect_api

    home = posttrain_home()
    if uses_local_mlflow() and not (home / "mlflow.db").exists():
        # Nothing is cached in a store that does not exist yet: a plan that cannot start (--only
        # without upstream outputs) is refused before the home or the store is created.
        plan_run(loaded, options, _EmptyStore(), None)
    else:
        try:
            check_reachable()
        except TrackingUnavailable as error:
            raise PlanError(f"{error}; start it, or unset MLFLOW_TRACKING_URI to use the local store") from None
    home = configure_environment()
    tracker = prepare_store(home, console)
    experiment_id = tracker.experiment_id(loaded.spec.name, artifact_root(home))
    for run_id in tracker.reap_dead_runs(experiment_id):
        console.print(f"[yellow]run {run_id} was left RUNNING by a process that died; marked FAILED[/yellow]")
    decisions = plan_run(loaded, options, tracker, experiment_id)
    _check_pools(loaded, decisions)
    console.print(f"plan for {loaded.spec.name}:")
    print_plan(decisions, console)
    if not any(d.action is Action.RUN for d in decisions):
        console.print("every selected stage is cached; nothing to launch")
        return run_pipeline(loaded, options, home, decisions=decisions)
    with prefect_api(home):
        pipeline_flow = _build_flow()
        state = pipeline_flow(str(loaded.path), loaded.overrides, options.only, options.from_stage, options.force,
                              options.no_cache, plan=[asdict(d) for d in decisions], return_state=True)
        result = state.result(raise_on_failure=False)
    if isinstance(result, StageFailed) and result.report is not None:
        return result.report
    if isinstance(result, BaseException):
        raise result
    return result
