"""MLflow as the source of truth: experiments, pipeline and stage runs, published outputs.

One experiment per pipeline name, one parent run per pipeline run, one child run per stage
execution (``parent_run_id`` passed explicitly: MLflow's active-run stack is per thread,
so everything here goes through ``MlflowClient`` with explicit run ids).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flows import __version__
from flows.recording.home import local_store_path, uses_local_mlflow
from flows.recording.journal import Recorder
from flows.recording.tags import (
    MODEL_TRAINING_KIND,
    TAG_ALERT,
    TAG_ERROR,
    TAG_EXPERIMENT_KIND,
    TAG_FINGERPRINT,
    TAG_HOST,
    TAG_OUTPUTS,
    TAG_PID,
    TAG_PIPELINE,
    TAG_PROCESS_START,
    TAG_RESUMED,
    TAG_ROLE,
    TAG_STAGE,
    TAG_VERSION,
)


_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")


def metric_name(name: str) -> str:
    """An MLflow-safe metric name: ``pass@1`` becomes ``pass_at_1``."""
    return _UNSAFE.sub("_", name.replace("@", "_at_"))


class Tracker:
    """Thin layer over ``MlflowClient`` for the runs posttrain creates and looks up."""

    def __init__(self, home: Path):
        from mlflow.tracking import MlflowClient

        self.home = home
        if uses_local_mlflow():  # the client creates (migrates) a new SQLite store: one process at a time
            from flows.servers.db_templates import copy_template, save_template
            from flows.recording.locks import file_lock

            database = local_store_path()
            with file_lock(home / "locks" / "mlflow-store.lock"):
                new_store = database is not None and not database.exists()
                if new_store:  # a copy of an earlier new store, not a second run of MLflow's migrations
                    copy_template("mlflow", database)
                self.client = MlflowClient()
                self.client.search_experiments(max_results=1)
                if new_store:
                    save_template("mlflow", database)
        else:
            self.client = MlflowClient()

    def experiment_id(self, name: str, artifact_location: str | None) -> str:
        """The pipeline's experiment, created (marked as model training) on first use.

        An experiment made before posttrain marked them gets the mark too; one whose kind
        someone set otherwise keeps it.
        """
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            if TAG_EXPERIMENT_KIND not in found.tags:
                self.client.set_experiment_tag(found.experiment_id, TAG_EXPERIMENT_KIND, MODEL_TRAINING_KIND)
            return found.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=artifact_location,
                                                 tags={TAG_EXPERIMENT_KIND: MODEL_TRAINING_KIND})
        except MlflowException:  # created concurrently by another posttrain process
            return self.client.get_experiment_by_name(name).experiment_id

    def start_pipeline_run(self, experiment_id: str, pipeline_name: str, params: dict[str, Any]) -> str:
        run = self.client.create_run(
            experiment_id,
            run_name=f"{pipeline_name} {time.strftime('%Y-%m-%d %H:%M:%S')}",
            tags={TAG_PIPELINE: pipeline_name, TAG_ROLE: "pipeline", TAG_VERSION: __version__, **process_tags()},
        )
        self.log_params(run.info.run_id, params)
        return run.info.run_id

    def start_stage_run(self, experiment_id: str, parent_run_id: str, stage: str, tags: dict[str, str]) -> str:
        run = self.client.create_run(
            experiment_id,
            run_name=stage,
            tags={"mlflow.parentRunId": parent_run_id, TAG_STAGE: stage, TAG_ROLE: "stage",
                  TAG_VERSION: __version__, **process_tags(), **tags},
        )
        return run.info.run_id

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(str(k), str(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[start : start + 100])

    def find_cached(self, experiment_id: str, stage: str, fingerprint: str):
        """The latest FINISHED run of this stage with this fingerprint and published outputs."""
        runs = self.client.search_runs(
            [experiment_id],
            filter_string=(
                f"tags.`{TAG_FINGERPRINT}` = '{fingerprint}' and tags.`{TAG_STAGE}` = '{stage}' "
                "and attributes.status = 'FINISHED'"
            ),
            order_by=["attributes.start_time DESC"],
            max_results=5,
        )
        return next((run for run in runs if TAG_OUTPUTS in run.data.tags), None)

    def get_run(self, run_id: str):
        return self.client.get_run(run_id)

    def outputs_of(self, run) -> dict[str, str]:
        """A finished stage's outputs as local paths, downloading artifacts if not on this disk."""
        outputs = json.loads(run.data.tags[TAG_OUTPUTS])
        resolved = {}
        for name, path in outputs.items():
            if Path(path).exists():
                resolved[name] = path
                continue
            target = self.home / "downloads" / run.info.run_id
            target.mkdir(parents=True, exist_ok=True)
            resolved[name] = self.client.download_artifacts(run.info.run_id, f"outputs/{name}", str(target))
        return resolved

    def publish_outputs(self, recorder: Recorder, experiment_name: str, stage: str,
                        staged: dict[str, str]) -> dict[str, str]:
        """Move staged outputs into place, log them as artifacts, record where they are, finish.

        Called only after a stage returned successfully. The outputs are moved on this disk
        first (that cannot be lost to a tracking outage); the run is marked FINISHED last,
        after its outputs tag, so a run killed before or during publication is never a
        cache hit. With the store unreachable, all of it waits in the recorder's journal.
        """
        run_id = recorder.run_id
        final_root = self.home / "outputs" / experiment_name / stage / run_id
        final_root.mkdir(parents=True, exist_ok=True)
        published = {}
        for name, staged_path in staged.items():
            source = Path(staged_path)
            target = final_root / source.name
            os.replace(source, target)
            published[name] = str(target)
        for target in published.values():
            recorder.artifacts(target, f"outputs/{Path(target).name}" if Path(target).is_dir() else "outputs")
        recorder.tags({TAG_OUTPUTS: json.dumps(published)})
        recorder.terminate("FINISHED")
        return published

    # ------------------------------------------------------------ runs whose process died

    def reap_dead_runs(self, experiment_id: str) -> list[str]:
        """Mark FAILED every RUNNING run of this experiment whose process on this host is gone.

        A run records its host, pid and the pid's start time; a pid that no longer exists,
        or now belongs to a process started at another time, ran the run and died (kill -9,
        out of memory, a lost machine). Runs of other hosts are left to their own host;
        runs with a local journal are still being recorded, not dead.
        """
        from flows.recording.journal import pending_runs

        waiting = set(pending_runs(self.home))
        running = self.client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'",
                                          max_results=1000)
        reaped = []
        for run in running:
            tags = run.data.tags
            if run.info.run_id in waiting or tags.get(TAG_HOST) != socket.gethostname() or TAG_PID not in tags:
                continue
            if process_alive(int(tags[TAG_PID]), tags.get(TAG_PROCESS_START)):
                continue
            self.client.set_tag(run.info.run_id, TAG_ERROR,
                                f"the process that ran this (pid {tags[TAG_PID]} on {tags[TAG_HOST]}) died "
                                "before it finished; marked FAILED by a later posttrain run")
            self.client.set_terminated(run.info.run_id, status="FAILED")
            reaped.append(run.info.run_id)
        return reaped


def process_start_time(pid: int) -> str | None:
    try:
        import psutil

        return f"{psutil.Process(pid).create_time():.2f}"
    except Exception:
        return None


def process_alive(pid: int, started: str | None) -> bool:
    now = process_start_time(pid)
    return now is not None and (started is None or now == started)


def process_tags() -> dict[str, str]:
    """Who runs this run: what ``reap_dead_runs`` checks later."""
    return {TAG_HOST: socket.gethostname(), TAG_PID: str(os.getpid()),
            TAG_PROCESS_START: process_start_time(os.getpid()) or ""}


class MlflowStageContext:
    """The ``stages.context.StageContext`` handed to a stage, bound to its MLflow run.

    Every write goes through a ``flows.recording.Recorder``: if the tracking server goes
    away mid-stage, training carries on and the writes wait in a local journal.
    """

    def __init__(self, tracker: Tracker, run_id: str, work_dir: Path, seed: int, console=None,
                 resume_dir: Path | None = None, recorder: Recorder | None = None):
        self.tracker = tracker
        self.client = tracker.client
        self.run_id = run_id
        self.work_dir = work_dir
        self.resume_dir = resume_dir or work_dir / "resume"
        self.deadline: float | None = None  # set by the orchestrator from the stage's time limit
        self.seed = seed
        self.console = console
        self.staged: dict[str, str] = {}
        self.alerts: list[str] = []  # what the stage said it is not learning, and why (stages/training/alerts.py)
        self.resumed: dict | None = None  # where the stage resumed from (stages/training/resume.py), if it did
        self.latest: dict[str, tuple[int, float]] = {}  # metric -> (step, value), as MLflow shows a run's metrics
        self.recorder = recorder or Recorder(tracker.client, run_id, tracker.home)
        self._staging = work_dir / "staging"
        work_dir.mkdir(parents=True, exist_ok=True)

    def output_dir(self, name: str) -> Path:
        path = self._staging / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        self.staged[name] = str(path)
        return path

    def output_file(self, name: str) -> Path:
        self._staging.mkdir(parents=True, exist_ok=True)
        path = self._staging / name
        self.staged[Path(name).stem] = str(path)
        return path

    def log_params(self, params: dict[str, Any]) -> None:
        self.recorder.params(params)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        named = {metric_name(k): v for k, v in metrics.items()}
        self.recorder.metrics(named, step or 0)
        for name, value in named.items():  # MLflow's latest value: the highest step's, then the last logged
            if name not in self.latest or (step or 0) >= self.latest[name][0]:
                self.latest[name] = (step or 0, float(value))
        if (line := _terminal_line()) is not None:
            line.metrics_logged(metrics)

    def result_metrics(self, returned: dict | None) -> dict[str, float]:
        """What the stage reported: every metric's latest logged value, then its ``run()``'s returned
        ``metrics`` (what a rerun must reproduce) over them."""
        metrics = {name: value for name, (_, value) in self.latest.items()}
        returned_metrics = (returned or {}).get("metrics", {})
        return metrics | {metric_name(k): float(v) for k, v in returned_metrics.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def metric_history(self, name: str):
        """Every logged value of a metric, after the buffered writes landed."""
        self.flush()
        return self.client.get_metric_history(self.run_id, name)

    def flush(self) -> None:
        """Send buffered metrics (before the run is published)."""
        self.recorder.flush_metrics()

    def recorded_run(self):
        """The run as the store holds it, after the buffered writes landed (metrics are sent in
        batches: a read that skips this sees only those whose batch happened to go out)."""
        self.flush()
        return self.client.get_run(self.run_id)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.recorder.tags(tags)
        if TAG_RESUMED in tags:  # the summary says where the stage resumed
            self.resumed = json.loads(tags[TAG_RESUMED])
        if TAG_ALERT in tags:  # every alert so far, one per line: the summary lists them, the terminal warns
            self.alerts = tags[TAG_ALERT].splitlines()
            if (line := _terminal_line()) is not None:
                line.alert(self.alerts[-1])

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        if not rows:
            return
        columns = {key: [row.get(key) for row in rows] for key in rows[0]}
        self.recorder.table(columns, name)

    def log_figure(self, figure: Any, name: str) -> None:
        self.recorder.figure(figure, name)

    @contextmanager
    def progress(self, description: str, total: int):
        if (line := _terminal_line()) is not None:  # this stage's line on `posttrain run`'s terminal
            line.begin(description, total)
            yield line
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=self.console, transient=True) as bar:
            task = bar.add_task(description, total=total)

            class _Advance:
                def advance(self, amount: int = 1) -> None:
                    bar.advance(task, amount)

            yield _Advance()


def _terminal_line():
    """The running stage's line on the terminal of this process's ``posttrain run``, if any."""
    from flows.terminal import active

    terminal = active()
    return terminal.line if terminal is not None else None
