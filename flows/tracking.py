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
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flows import __version__

TAG_KIND = "posttrain.kind"
TAG_STAGE = "posttrain.stage"
TAG_FINGERPRINT = "posttrain.fingerprint"
TAG_UPSTREAM = "posttrain.upstream"
TAG_VERSION = "posttrain.version"
TAG_OUTPUTS = "posttrain.outputs"
TAG_PIPELINE = "posttrain.pipeline"
TAG_ROLE = "posttrain.role"  # "pipeline" or "stage"
TAG_STAGE_RUNS = "posttrain.stage_runs"
TAG_CACHED_FROM = "posttrain.cached_from"

_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")


def metric_name(name: str) -> str:
    """An MLflow-safe metric name: ``pass@1`` becomes ``pass_at_1``."""
    return _UNSAFE.sub("_", name.replace("@", "_at_"))


class Tracker:
    """Thin layer over ``MlflowClient`` for the runs posttrain creates and looks up."""

    def __init__(self, home: Path):
        from mlflow.tracking import MlflowClient

        self.home = home
        self.client = MlflowClient()

    def experiment_id(self, name: str, artifact_location: str | None) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=artifact_location)
        except MlflowException:  # created concurrently by another posttrain process
            return self.client.get_experiment_by_name(name).experiment_id

    def start_pipeline_run(self, experiment_id: str, pipeline_name: str, params: dict[str, Any]) -> str:
        run = self.client.create_run(
            experiment_id,
            run_name=f"{pipeline_name} {time.strftime('%Y-%m-%d %H:%M:%S')}",
            tags={TAG_PIPELINE: pipeline_name, TAG_ROLE: "pipeline", TAG_VERSION: __version__},
        )
        self.log_params(run.info.run_id, params)
        return run.info.run_id

    def start_stage_run(self, experiment_id: str, parent_run_id: str, stage: str, tags: dict[str, str]) -> str:
        run = self.client.create_run(
            experiment_id,
            run_name=stage,
            tags={"mlflow.parentRunId": parent_run_id, TAG_STAGE: stage, TAG_ROLE: "stage",
                  TAG_VERSION: __version__, **tags},
        )
        return run.info.run_id

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(str(k), str(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[start : start + 100])

    def finish(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status=status)

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

    def publish_outputs(self, run_id: str, experiment_name: str, stage: str, staged: dict[str, str]) -> dict[str, str]:
        """Move staged outputs into place, log them as artifacts, and record where they are.

        Called only after a stage returned successfully; the run is marked FINISHED after
        this, so a run killed before or during publication is never a cache hit.
        """
        final_root = self.home / "outputs" / experiment_name / stage / run_id
        final_root.mkdir(parents=True, exist_ok=True)
        published = {}
        for name, staged_path in staged.items():
            source = Path(staged_path)
            target = final_root / source.name
            os.replace(source, target)
            if target.is_dir():
                self.client.log_artifacts(run_id, str(target), artifact_path=f"outputs/{target.name}")
            else:
                self.client.log_artifact(run_id, str(target), artifact_path="outputs")
            published[name] = str(target)
        self.client.set_tag(run_id, TAG_OUTPUTS, json.dumps(published))
        return published


class MlflowStageContext:
    """The ``stages.context.StageContext`` handed to a stage, bound to its MLflow run."""

    def __init__(self, tracker: Tracker, run_id: str, work_dir: Path, seed: int, console=None):
        self.tracker = tracker
        self.client = tracker.client
        self.run_id = run_id
        self.work_dir = work_dir
        self.seed = seed
        self.console = console
        self.staged: dict[str, str] = {}
        self._pending = []  # queued metric writes (per-step logging must not wait on the store)
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
        self.tracker.log_params(self.run_id, params)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(metric_name(k), float(v), now, step or 0) for k, v in metrics.items()]
        for start in range(0, len(items), 500):
            self._pending.append(self.client.log_batch(self.run_id, metrics=items[start : start + 500],
                                                       synchronous=False))

    def metric_history(self, name: str):
        """Every logged value of a metric, after the queued writes landed."""
        self.flush()
        return self.client.get_metric_history(self.run_id, name)

    def flush(self) -> None:
        """Wait until every queued metric is in the store (before the run is published)."""
        pending, self._pending = self._pending, []
        for operation in pending:
            if operation is not None:
                operation.wait()

    def set_tags(self, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, value)

    def log_table(self, rows: list[dict[str, Any]], name: str) -> None:
        if not rows:
            return
        columns = {key: [row.get(key) for row in rows] for key in rows[0]}
        self.client.log_table(self.run_id, data=columns, artifact_file=name)

    def log_figure(self, figure: Any, name: str) -> None:
        self.client.log_figure(self.run_id, figure, name)

    @contextmanager
    def progress(self, description: str, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=self.console, transient=True) as bar:
            task = bar.add_task(description, total=total)

            class _Advance:
                def advance(self, amount: int = 1) -> None:
                    bar.advance(task, amount)

            yield _Advance()
