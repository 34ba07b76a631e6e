"""``StageJob``: everything one stage execution needs, as one frozen, serialisable record.

The planner builds one job per stage that runs (``stage_jobs``), before anything launches:
the validated pipeline it belongs to, the stage's config, its resolved seed, resources and
time limit, where its run is recorded, and whether a cached run may stand in for it. When
the stages it reads from have run, the loop binds their run ids and outputs and the
fingerprint those make (``bind_upstream``). ``flows.execute.execute(job)`` runs it; a work
pool's worker receives it as JSON (``to_json`` / ``from_json``) and so does every torchrun
rank: nobody reads the pipeline YAML again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from flows.planning.graph import round_of
from flows.planning.lineage import Action, Decision, fingerprint
from flows.spec.loading import LoadedPipeline, Pipeline
from stages.context import Resources

if TYPE_CHECKING:
    from flows.planning.iterate import RoundStep


@dataclass(frozen=True)
class StageJob:
    pipeline: Pipeline  # validated, rounds unrolled; the stage's config is pipeline.stages[stage]
    pipeline_file: Path  # where the pipeline was read from: recorded, and relative paths resolve beside it
    overrides: tuple[str, ...]
    stage: str
    seed: int  # the stage's own seed, else the pipeline's (Pipeline.seed_for)
    resources: Resources
    time_limit_seconds: float | None
    experiment_id: str
    parent_run_id: str
    may_reuse: bool = True  # whether a run another process finished meanwhile may stand in for it
    upstream_runs: dict[str, str] = field(default_factory=dict)  # upstream stage -> the run it reads
    upstream_outputs: dict[str, dict] | None = None  # their outputs as local paths; None: read from MLflow
    fingerprint: str = ""
    extra_tags: dict[str, str] = field(default_factory=dict)  # set on the stage run (work pool, flow run)

    @property
    def config(self):
        return self.pipeline.stages[self.stage]

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def round(self) -> RoundStep | None:
        """The round this execution belongs to where the pipeline iterates (flows/planning/iterate.py), else None."""
        return round_of(self.pipeline, self.stage)

    @property
    def loaded(self) -> LoadedPipeline:
        """The pipeline as the loader returned it (the file is not read again)."""
        return LoadedPipeline(spec=self.pipeline, path=self.pipeline_file, overrides=list(self.overrides))

    def to_json(self) -> dict:
        return {
            "pipeline": self.pipeline.model_dump(mode="json", exclude_unset=True),
            "pipeline_file": str(self.pipeline_file), "overrides": list(self.overrides), "stage": self.stage,
            "seed": self.seed, "resources": self.resources.model_dump(mode="json", exclude_unset=True),
            "time_limit_seconds": self.time_limit_seconds, "experiment_id": self.experiment_id,
            "parent_run_id": self.parent_run_id, "may_reuse": self.may_reuse,
            "upstream_runs": dict(self.upstream_runs), "upstream_outputs": self.upstream_outputs,
            "fingerprint": self.fingerprint, "extra_tags": dict(self.extra_tags),
        }

    @classmethod
    def from_json(cls, data: dict) -> StageJob:
        return cls(**{**data, "pipeline": Pipeline.model_validate(data["pipeline"]),
                      "pipeline_file": Path(data["pipeline_file"]), "overrides": tuple(data["overrides"]),
                      "resources": Resources.model_validate(data["resources"])})


def stage_job(loaded: LoadedPipeline, decision: Decision, experiment_id: str, parent_run_id: str) -> StageJob:
    spec, stage = loaded.spec, decision.stage
    limit = getattr(spec.stages[stage], "time_limit_minutes", None)
    return StageJob(pipeline=spec, pipeline_file=loaded.path, overrides=tuple(loaded.overrides), stage=stage,
                    seed=spec.seed_for(stage), resources=spec.resources_for(stage),
                    time_limit_seconds=limit * 60 if limit else None, experiment_id=experiment_id,
                    parent_run_id=parent_run_id, may_reuse=decision.may_reuse)


def stage_jobs(loaded: LoadedPipeline, decisions: list[Decision], experiment_id: str,
               parent_run_id: str) -> dict[str, StageJob]:
    """One job for every stage the plan runs."""
    return {d.stage: stage_job(loaded, d, experiment_id, parent_run_id) for d in decisions if d.action is Action.RUN}


def bind_upstream(job: StageJob, run_ids: dict[str, str], outputs: dict[str, dict],
                  upstream: list[str]) -> StageJob:
    """The job with the runs (and outputs) of the stages it reads, and the fingerprint they make."""
    upstream_runs = {u: run_ids[u] for u in upstream}
    return replace(job, upstream_runs=upstream_runs, upstream_outputs={u: outputs[u] for u in upstream},
                   fingerprint=fingerprint(job.loaded, job.stage, upstream_runs))
