"""Running a pipeline: plan -> jobs -> loop -> report.

The plan (which stages are cache hits, ``flows/planning/lineage.py``) is made before anything
launches; the planner turns each stage that runs into a ``StageJob`` (``flows/planning/job.py``);
the loop executes them in graph order (``flows/execution/execute.py``), in this process or through
the Prefect task that ``flows/execution/deployment.py`` passes as ``stage_call``; the report is a
table in MLflow, in Prefect and on the terminal. No Prefect here.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from flows.recording.data_inputs import pipeline_datasets
from flows.execution.execute import StageFailed, StageRow, execute, headline_metrics
from flows.planning.graph import step_round, upstream_of
from flows.recording.home import artifact_root
from flows.planning.job import bind_upstream, stage_jobs
from flows.planning.lineage import Action, Decision, PlanError, RunOptions, plan_run
from flows.recording.journal import Recorder, broken_journals, replay_pending
from flows.spec.loading import LoadedPipeline
from flows.recording.store import TrackingUnavailable, check_reachable
from flows.recording.tags import TAG_PREFECT_FLOW_RUN, TAG_STAGE_RUNS
from flows.recording.tracking import Tracker


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


# ------------------------------------------------------------------ plan -> jobs -> loop -> report


def run_pipeline(loaded: LoadedPipeline, options: RunOptions, home: Path, stage_call=None, flow_run_id=None,
                 decisions: list[Decision] | None = None, run_tags: dict[str, str] | None = None,
                 stage_tags: dict[str, dict[str, str]] | None = None) -> PipelineReport:
    """Plan, record the pipeline run in MLflow, execute each stage's job in graph order, report.

    ``stage_call(job) -> StageRow`` runs one job (default: ``execute`` in this process). ``run_tags`` go on
    the pipeline run and ``stage_tags[stage]`` on the stage runs it starts (a sweep's variant and seed)."""
    tracker = Tracker(home)
    experiment_id = tracker.experiment_id(loaded.spec.name, artifact_root(home))
    decisions = decisions or plan_run(loaded, options, tracker, experiment_id)
    started = time.perf_counter()
    recorder = _start_pipeline_run(loaded, options, tracker, experiment_id, home, flow_run_id)
    if run_tags:
        recorder.tags(run_tags)
    jobs = {stage: replace(job, extra_tags={**job.extra_tags, **(stage_tags or {}).get(stage, {})})
            for stage, job in stage_jobs(loaded, decisions, experiment_id, recorder.run_id).items()}
    loop = _StageLoop(loaded, tracker, recorder, stage_call or (lambda job: execute(job, tracker)))
    for decision in decisions:
        loop.step(decision, jobs.get(decision.stage))
    report = PipelineReport(loaded.spec.name, experiment_id, recorder.run_id, loop.rows,
                            time.perf_counter() - started, [row.unrecorded for row in loop.rows if row.unrecorded])
    recorder.tags({TAG_STAGE_RUNS: json.dumps(loop.run_ids)})
    recorder.datasets(pipeline_datasets(tracker.client, loop.run_ids.values(), recorder.offline))
    recorder.text(summary_markdown(report), "summary.md")
    recorder.terminate("FAILED" if loop.failed else "FINISHED")
    if recorder.offline:
        report.unrecorded.append(f"the pipeline run's own record ({recorder.summary()}) waits in "
                                 f"{recorder.journal_path}")
    return report


def _start_pipeline_run(loaded, options, tracker, experiment_id, home, flow_run_id) -> Recorder:
    parent = tracker.start_pipeline_run(experiment_id, loaded.spec.name, {
        "pipeline_file": str(loaded.path), "overrides": json.dumps(loaded.overrides),
        "options": json.dumps(asdict(options)), "seed": loaded.spec.seed,
    })
    recorder = Recorder(tracker.client, parent, home)
    recorder.text(loaded.path.read_text(encoding="utf-8"), "pipeline.yaml")
    recorder.text(json.dumps(loaded.spec.model_dump(mode="json"), indent=2), "pipeline.resolved.json")
    if flow_run_id:
        recorder.tags({TAG_PREFECT_FLOW_RUN: flow_run_id})
    return recorder


class _StageLoop:
    """The stages in graph order: skipped, not run after a failure, cached, or executed."""

    def __init__(self, loaded, tracker, recorder, stage_call):
        self.loaded, self.tracker, self.recorder, self.stage_call = loaded, tracker, recorder, stage_call
        self.upstream = upstream_of(loaded.spec)
        self.rows: list[StageRow] = []
        self.outputs: dict[str, dict] = {}
        self.run_ids: dict[str, str] = {}
        self.failed = False

    def step(self, decision: Decision, job) -> None:
        kind = self.loaded.spec.stages[decision.stage].kind
        if decision.action is Action.SKIP:
            self.rows.append(StageRow(decision.stage, kind, "skipped", note=decision.reason))
        elif self.failed:
            self.rows.append(StageRow(decision.stage, kind, "not run", note="an earlier stage failed"))
        elif decision.action is Action.CACHED:
            run = self.tracker.get_run(decision.cached_run_id)
            self._done(StageRow(decision.stage, kind, "cached", 0.0, decision.cached_run_id,
                                headline_metrics(run.data.metrics, kind), decision.reason),
                       self.tracker.outputs_of(run))
        else:
            self._execute(bind_upstream(job, self.run_ids, self.outputs, self.upstream[decision.stage]), decision)

    def _execute(self, job, decision: Decision) -> None:
        try:
            row = self.stage_call(job)
        except (StageFailed, TrackingUnavailable) as error:
            self.failed = True
            cause = error.__cause__ if isinstance(error, StageFailed) and error.__cause__ else error
            self.rows.append(StageRow(job.stage, job.kind, "failed", run_id=getattr(error, "run_id", None),
                                      note=f"{type(cause).__name__}: {cause}"[:300],
                                      log=getattr(error, "log_path", None) or ""))
            return
        except KeyboardInterrupt:
            self.recorder.tags({TAG_STAGE_RUNS: json.dumps(self.run_ids)})
            self.recorder.terminate("KILLED")
            raise
        row.note = row.note or decision.reason
        self._done(row, row.outputs)

    def _done(self, row: StageRow, outputs: dict) -> None:
        self.rows.append(row)
        self.run_ids[row.stage] = row.run_id
        self.outputs[row.stage] = outputs


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
    alerts = [f"- **alert** `{row.stage}`: {alert}" for row in report.rows for alert in row.alerts]
    lines += ["", *alerts] if alerts else []
    lines += _rounds_markdown(report.rows)  # iterate: each round's evaluation side by side
    return "\n".join(lines)


def print_plan(decisions: list[Decision], console) -> None:
    for d in decisions:
        symbol = {Action.RUN: "run   ", Action.CACHED: "cached", Action.SKIP: "skip  "}[d.action]
        extra = f" ({d.cached_run_id})" if d.cached_run_id else ""
        console.print(f"  {symbol} {d.stage}: {d.reason}{extra}")


def print_summary(report: PipelineReport, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"posttrain · {report.pipeline} · {report.seconds:.1f} s")
    for column in ("stage", "kind", "status", "seconds", "key metrics", "MLflow run"):
        table.add_column(column)
    for row in report.rows:
        style = {"failed": "red", "cached": "cyan", "ran": "green"}.get(row.status)
        table.add_row(row.stage, row.kind, row.status, f"{row.seconds:.1f}",
                      _format_metrics(row.metrics) or row.note[:160], row.run_id or "", style=style)
    console.print(table)
    for row in report.rows:  # stages that continued where an earlier run stopped (stages/training/resume.py)
        if row.resumed:
            stopped = f" where run {row.resumed['run']} stopped" if row.resumed.get("run") else ""
            console.print(f"resumed {row.stage}: from step {row.resumed['step']}{stopped}", highlight=False)
    for row in report.rows:  # stages that ran without learning, and the likely cause (stages/training/alerts.py)
        for alert in row.alerts:
            console.print(f"[bold yellow]alert[/bold yellow] {row.stage}: {escape(alert)}", highlight=False)
    _print_rounds(report.rows, console)  # iterate: each round's evaluation side by side
    console.print(f"pipeline run {report.parent_run_id} in experiment {report.experiment_id}")
    for message in report.unrecorded:
        console.print(f"[bold yellow]not recorded in MLflow:[/bold yellow] {message}", highlight=False)


def print_failure(report: PipelineReport, console, show_traceback: bool = False) -> None:
    """A failed run in a few lines, the last one the failed stage's log: no table, no traceback
    (``show_traceback``: the stage's traceback first, from the end of its log)."""
    failed = next(row for row in report.rows if row.status == "failed")
    if show_traceback and failed.log and Path(failed.log).exists():
        text = Path(failed.log).read_text(encoding="utf-8", errors="replace")
        start = text.rfind("Traceback (most recent call last)")
        console.print(text[start:] if start >= 0 else text, highlight=False, markup=False, end="")
    error = (failed.note.splitlines() or [""])[0][:300]
    console.print(f"[bold red]stage {failed.stage} failed:[/bold red] {error}", highlight=False)
    not_run = [row.stage for row in report.rows if row.status == "not run"]
    done = [f"{row.stage} {row.status}" for row in report.rows if row.status in ("ran", "cached")]
    console.print(f"  pipeline run {report.parent_run_id}: " + "; ".join(
        filter(None, [", ".join(done), f"not run: {', '.join(not_run)}" if not_run else ""])), highlight=False)
    for message in report.unrecorded:
        console.print(f"  [bold yellow]not recorded in MLflow:[/bold yellow] {message}", highlight=False)
    console.print(f"  log: {failed.log or 'none (the stage did not start)'}", highlight=False, markup=False)


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


# ------------------------------------------------------------------ each round's evaluation side by side


def _rounds_table(rows: list[StageRow]) -> tuple[int, list[tuple[str, str, list[float | None]]]]:
    """(rounds, [(eval stage, metric, value per round)]) for eval stages run in more than one round of an
    ``iterate:`` pipeline (a step's round: flows/planning/graph.py ``step_round``)."""
    by_stage: dict[str, dict[int, dict]] = {}
    for row in rows:
        if row.kind == "eval":
            stage, round_ = step_round(row.stage)
            by_stage.setdefault(stage, {})[round_] = row.metrics
    rounds = max((r for per_round in by_stage.values() for r in per_round), default=1)
    table = []
    for stage, per_round in by_stage.items():
        if len(per_round) < 2:
            continue  # shared by all rounds (upstream of iterate.train)
        metrics = list(dict.fromkeys(k for m in per_round.values() for k in m if k.startswith("pass_at_")))
        for metric in metrics:
            table.append((stage, metric, [per_round.get(r, {}).get(metric) for r in range(1, rounds + 1)]))
    return rounds, table


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _rounds_markdown(rows: list[StageRow]) -> list[str]:
    rounds, table = _rounds_table(rows)
    if not table:
        return []
    lines = ["", "#### Evaluation by round", "",
             "| eval stage | metric | " + " | ".join(f"round {r}" for r in range(1, rounds + 1)) + " |",
             "|---|---|" + "---|" * rounds]
    lines += [f"| {stage} | {metric} | " + " | ".join(_cell(v) for v in values) + " |"
              for stage, metric, values in table]
    return lines


def _print_rounds(rows: list[StageRow], console) -> None:
    from rich.table import Table

    rounds, table = _rounds_table(rows)
    if not table:
        return
    view = Table(title="evaluation by round")
    for column in ("eval stage", "metric", *(f"round {r}" for r in range(1, rounds + 1))):
        view.add_column(column)
    for stage, metric, values in table:
        view.add_row(stage, metric, *(_cell(v) for v in values))
    console.print(view)
