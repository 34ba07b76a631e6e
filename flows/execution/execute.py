"""``execute(job) -> StageRow``: lock, cache check, run, publish — the one way a stage runs.

In-process runs, work-pool workers (``flows/execution/deployment.py``) and the torchrun ranks of a
multi-process stage (``flows/execution/rank.py``, through ``run_stage_function``) all start from a
``StageJob``. No Prefect here: the Prefect task around ``execute`` lives in
``flows/execution/deployment.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from flows.servers import startup
from flows.recording.data_inputs import stage_datasets
from flows.execution.distributed import run_distributed
from flows.planning.graph import reference_output, stage_references
from flows.planning.job import StageJob
from flows.recording.locks import stage_lock
from flows.recording.model_registry import record_stage_model
from flows.recording.journal import Recorder
from flows.recording.store import TrackingUnavailable, is_unavailable
from flows.spec.loading import BASE, LoadedPipeline
from flows.recording.tags import TAG_ERROR, TAG_FINGERPRINT, TAG_KIND, TAG_SEED, TAG_UPSTREAM
from flows.terminal import stage_output
from flows.recording.tracking import MlflowStageContext, Tracker
from stages.context import SCORER_PREFIX, StageInputs, StageTimeLimit
from stages.data.sources import MixtureData, materialize, mixture_report_path
from stages.models.loading import resolve_base_checkpoint
from stages.registry import STAGE_KINDS, stage_runner
from stages.rewards.spec import JUDGE_FN

TIME_LIMIT_GRACE = 30.0


class StageFailed(Exception):
    """A stage raised at run time (exit status 1); carries the pipeline report when there is one."""

    def __init__(self, message: str, report=None, run_id: str | None = None, log_path: str | None = None):
        super().__init__(message)
        self.report = report  # a flows.pipeline.PipelineReport
        self.run_id = run_id
        self.log_path = log_path  # the stage's log file: its captured output and the traceback


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
    log: str = ""  # the stage's log file (captured output; the traceback if it failed)
    alerts: list[str] = field(default_factory=list)  # what the stage said it is not learning, and why
    resumed: dict | None = None  # {step, run, checkpoint}: where it resumed, when an earlier run stopped it


# ------------------------------------------------------------------ what a stage reads


def resolve_inputs(loaded: LoadedPipeline, stage: str, upstream_outputs: dict[str, dict], home: Path) -> StageInputs:
    """Local paths for everything a stage reads: checkpoints, datasets, reward specs."""
    spec = loaded.spec
    config = spec.stages[stage]
    checkpoints, scorers = {}, {}
    for input_name, target in stage_references(spec, stage).items():  # reward models' stages included
        if target == BASE:
            path = resolve_base_checkpoint(spec.model, spec.seed, home / "cache" / "models", loaded.base_dir)
        else:  # a checkpoint; for an iterate round, the failure set of round r-1's collect step
            path = upstream_outputs[target][reference_output(input_name)]
        if input_name.startswith(SCORER_PREFIX):
            scorers[input_name[len(SCORER_PREFIX):]] = Path(path)
        else:
            checkpoints[input_name] = Path(path)
    datasets = {name: materialize(spec.data[name], loaded.base_dir, home / "cache" / "data", spec.data)
                for name in config.dataset_names()}
    rewards = loaded.rewards_for(config.reward_names())
    scorers.update(judge_model_inputs(rewards, spec.seed, home, loaded.base_dir))
    return StageInputs(
        trust_remote_code=bool(getattr(spec.model, "trust_remote_code", False)),
        datasets=datasets, **checkpoints, scorer_checkpoints=scorers, rewards=rewards,
        # replies by (judge, rubric, prompt, completion)
        judge_cache=home / "cache" / "judge" if any(r.fn == JUDGE_FN for r in rewards.values()) else None,
        reward_checks={n: spec.reward_checks[n] for n in config.reward_names() if n in spec.reward_checks},
        base_dir=loaded.base_dir)


def judge_model_inputs(rewards: dict, seed: int, home: Path, base_dir: Path) -> dict[str, Path]:
    """The checkpoint of each judge with a model of its own (``model:``: GGUF converted once, hub snapshot, path)."""
    return {name: resolve_base_checkpoint(r.model, seed, home / "cache" / "models", base_dir)
            for name, r in rewards.items() if r.fn == JUDGE_FN and r.model is not None}


def log_mixtures(job: StageJob, inputs: StageInputs, recorder: Recorder) -> None:
    """For each mixture the stage reads: its recipe and realised per-source counts, as params
    (``data.<name>.mixture.<source>.weight`` / ``.count``) and as ``data_mixture_<name>.json``."""
    spec = job.loaded.spec
    for name, path in inputs.datasets.items():
        if not isinstance(spec.data[name], MixtureData):
            continue
        report_path = mixture_report_path(path)
        report = json.loads(report_path.read_text(encoding="utf-8"))
        params = {}
        for source, probability in report["recipe"].items():
            params[f"data.{name}.mixture.{source}.weight"] = round(probability, 6)
            params[f"data.{name}.mixture.{source}.count"] = report["counts"][source]
        recorder.params(params)
        recorder.text(json.dumps(report, indent=2, sort_keys=True), f"data_mixture_{name}.json")


def run_stage_function(job: StageJob, inputs: StageInputs, ctx) -> dict:
    """The stage kind's ``run(config, inputs, ctx)``: what this process and every rank computes; returns
    what it returned (its outputs and ``metrics``)."""
    run = stage_runner(job.kind)
    startup.end(import_stage_libraries=True)  # a rank's start-up ends here (flows/servers/startup.py)
    return run(job.config, inputs, ctx) or {}


# ------------------------------------------------------------------ lock, cache check, run, publish


def execute(job: StageJob, tracker: Tracker, console=None) -> StageRow:
    """Run one stage in a fresh child run, unless another process just produced the same result.

    The stage lock serialises executions with one fingerprint across processes; once it is
    held, a FINISHED run with this fingerprint (another ``posttrain run`` finished it while
    this one waited) is reused unless the job may not reuse one (the stage was forced).
    """

    def waiting(holder: str) -> None:
        print(f"stage {job.stage}: {holder} is running it with the same fingerprint; waiting for it",
              file=sys.stderr, flush=True)

    try:
        with stage_lock(tracker.home, job.experiment_id, job.stage, job.fingerprint, waiting):
            reused = reuse_finished(job, tracker, "finished meanwhile by another posttrain run")
            return reused or _run(job, tracker, console)
    except (StageFailed, KeyboardInterrupt, TrackingUnavailable):
        raise
    except Exception as error:
        if is_unavailable(error):
            raise TrackingUnavailable(f"stage {job.stage!r} could not start: the MLflow store is unreachable "
                                      f"({str(error).splitlines()[0][:200]})") from error
        raise


def reuse_finished(job: StageJob, tracker: Tracker, note: str) -> StageRow | None:
    """A FINISHED run with the job's fingerprint as a cached row (another execution finished it while this one
    waited), unless the job may not reuse one (the stage was forced)."""
    hit = tracker.find_cached(job.experiment_id, job.stage, job.fingerprint) if job.may_reuse else None
    if hit is None:
        return None
    return StageRow(job.stage, job.kind, "cached", 0.0, hit.info.run_id, headline_metrics(hit.data.metrics, job.kind),
                    note, tracker.outputs_of(hit))


def _flat_params(prefix: str, value, out: dict) -> dict:
    if isinstance(value, dict):
        for key, item in value.items():
            _flat_params(f"{prefix}.{key}" if prefix else str(key), item, out)
    else:
        out[prefix] = value
    return out


def _start_run(job: StageJob, tracker: Tracker) -> Recorder:
    run_id = tracker.start_stage_run(
        job.experiment_id, job.parent_run_id, job.stage,
        {TAG_FINGERPRINT: job.fingerprint, TAG_UPSTREAM: json.dumps(job.upstream_runs), TAG_KIND: job.kind,
         **job.extra_tags, **(job.round.tags() if job.round else {})},
    )
    recorder = Recorder(tracker.client, run_id, tracker.home)
    recorder.params(_flat_params("", job.config.model_dump(mode="json"), {}))
    return recorder


def _run(job: StageJob, tracker: Tracker, console) -> StageRow:
    """Run one stage; publish its outputs only if it finished; keep its trainer checkpoints if it did not."""
    recorder = _start_run(job, tracker)
    work_dir = tracker.home / "work" / recorder.run_id
    # Keyed by fingerprint, not run id: the next execution of the same stage resumes from it.
    resume_dir = tracker.home / "resume" / job.experiment_id / f"{job.stage}-{job.fingerprint}"
    log_path = tracker.home / "logs" / job.pipeline.name / f"{job.stage}-{recorder.run_id}.log"
    started = time.perf_counter()
    try:
        with stage_output(job.stage, log_path):  # the terminal's stage line; other output to the log
            ctx = MlflowStageContext(tracker, recorder.run_id, work_dir, job.seed, console, resume_dir=resume_dir,
                                     recorder=recorder)
            metrics = _run_stage(job, tracker, recorder, ctx)
    except KeyboardInterrupt:
        recorder.tags({TAG_ERROR: "interrupted (Ctrl-C); trainer checkpoints so far are kept in "
                                  f"{resume_dir} and the next run of this stage resumes from them"})
        recorder.terminate("KILLED")
        raise
    except BaseException as error:
        _record_failure(recorder, error, log_path)
        raise StageFailed(f"stage {job.stage!r} failed: {type(error).__name__}: {error}",
                          run_id=recorder.run_id, log_path=str(log_path)) from error
    if log_path.exists():
        recorder.artifacts(str(log_path), "logs")
    published = tracker.publish_outputs(recorder, job.pipeline.name, job.stage, ctx.staged)
    record_stage_model(recorder, job.pipeline.name, job.stage, job.config, job.upstream_runs, published)
    row = StageRow(job.stage, job.kind, "ran", time.perf_counter() - started, recorder.run_id,
                   headline_metrics(metrics, job.kind), outputs=published, alerts=ctx.alerts, resumed=ctx.resumed)
    shutil.rmtree(work_dir, ignore_errors=True)
    shutil.rmtree(resume_dir, ignore_errors=True)
    return _report_row(row, recorder)


def _record_failure(recorder: Recorder, error: BaseException, log_path: Path) -> None:
    """Why the stage failed: on its run (tag, error.txt, its log) and at the end of its log file."""
    text = traceback.format_exc()
    try:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a", encoding="utf-8") as log:
            log.write(text)
    except OSError:
        pass
    try:  # if recording itself breaks, the stage's error still wins
        recorder.tags({TAG_ERROR: f"{type(error).__name__}: {error}"[:5000]})
        recorder.text(text, "error.txt")
        if log_path.exists():
            recorder.artifacts(str(log_path), "logs")
        recorder.terminate("FAILED")
    except Exception:
        pass


def _run_stage(job: StageJob, tracker: Tracker, recorder: Recorder, ctx: MlflowStageContext) -> dict[str, float]:
    """Resolve the inputs, then run the stage here or on ``world_size`` processes, within its time limit;
    returns the metrics it reported (``MlflowStageContext.result_metrics``)."""
    in_process = job.resources.world_size() == 1
    startup.end(import_stage_libraries=in_process)  # the stage's work starts: collection back on (flows/servers/startup.py)
    inputs = resolve_inputs(job.loaded, job.stage, job.upstream_outputs, tracker.home)
    log_mixtures(job, inputs, recorder)
    if job.round is not None:  # iterate: round r's mix of failures, where this step trains on them
        inputs = job.round.training_inputs(job.loaded, inputs, job.upstream_runs, tracker, recorder, tracker.home)
    recorder.params({f"input.{k}": v for k, v in inputs.paths().items()}
                    | {"input.trust_remote_code": inputs.trust_remote_code})
    recorder.datasets(stage_datasets(job.loaded, inputs))
    recorder.tags({TAG_SEED: str(job.seed)})
    with time_limit(job.stage, job.time_limit_seconds, ctx):
        if not in_process:  # N training processes (flows/execution/distributed.py)
            metrics = run_distributed(job, ctx, inputs)
        else:
            metrics = ctx.result_metrics(run_stage_function(job, inputs, ctx))
    ctx.flush()
    return metrics


def _report_row(row: StageRow, recorder: Recorder) -> StageRow:
    """The row, saying what waits to be recorded if the store went away meanwhile (and did not come back)."""
    if recorder.offline and not recorder.retry(float(os.environ.get("POSTTRAIN_TRACKING_RETRY_SECONDS", "60"))):
        on_disk = ", ".join(row.outputs.values())
        row.unrecorded = (f"stage {row.stage} finished and its outputs are on disk ({on_disk}), "
                          f"but the MLflow store became unreachable ({recorder.unavailable}); not recorded: "
                          f"{recorder.summary()}. They wait in {recorder.journal_path}; `posttrain sync` "
                          "(or any later `posttrain run`) records them once the store is back")
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


def headline_metrics(metrics: dict[str, float], kind: str) -> dict[str, float]:
    """The metrics of a stage run worth a column in the summary (its kind's ``headline_metrics``)."""
    chosen = {}
    for pattern in STAGE_KINDS[kind].headline_metrics if kind in STAGE_KINDS else ():
        if pattern.endswith("*"):
            matches = [k for k in metrics if k.startswith(pattern[:-1]) and k not in chosen]
            if matches:  # the widest k
                widest = max(matches, key=lambda k: int(k.rsplit("_", 1)[-1]) if k.rsplit("_", 1)[-1].isdigit() else 0)
                chosen[widest] = metrics[widest]
        elif pattern in metrics:
            chosen[pattern] = metrics[pattern]
    return chosen
