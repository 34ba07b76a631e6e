"""Fingerprints and the run plan: which stages are reused from MLflow and which run.

A stage's fingerprint hashes its canonical config, the run ids of the upstream stages
whose outputs it reads (so rerunning anything upstream makes it stale), the content keys
of its datasets and base model, its reward specs, the pipeline seed and the posttrain
version. The plan is decided before anything is launched.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from flows import __version__
from flows.planning.graph import (
    ancestors,
    descendants,
    round_of,
    stage_references,
    topological_order,
    upstream_of,
)
from flows.spec.loading import BASE, LoadedPipeline, did_you_mean
from stages.context import EXECUTION_FIELDS
from stages.data.sources import data_key
from stages.models.loading import GGUFModelSpec, HubModelSpec, PathModelSpec, base_model_key


class PlanError(Exception):
    """The requested run cannot start (e.g. ``--only`` without cached upstream outputs)."""


@dataclass
class RunOptions:
    only: str | None = None
    from_stage: str | None = None
    force: list[str] = field(default_factory=list)
    no_cache: bool = False

    def check(self, loaded: LoadedPipeline) -> None:
        names = list(loaded.spec.stages)
        for flag, stage in (("--only", self.only), ("--from", self.from_stage), *(("--force", s) for s in self.force)):
            if stage is not None and not stage.strip():
                raise PlanError(f"{flag} needs a stage name (got {stage!r}); stages: {', '.join(names)}")
            if stage is not None and stage not in names:
                raise PlanError(f"{flag} {stage}: no such stage{did_you_mean(stage, names)}; stages: "
                                f"{', '.join(names)}")
        if self.only and self.from_stage:
            raise PlanError("--only and --from cannot be combined")


class Action(str, Enum):
    """What the plan does with a stage (a ``str``, so a plan travels as JSON to the Prefect flow)."""

    RUN = "run"
    CACHED = "cached"
    SKIP = "skip"


@dataclass
class Decision:
    stage: str
    action: Action
    reason: str  # for people (the plan and the summary print it); never compared
    cached_run_id: str | None = None
    forced: bool = False  # --force, --from, --only or --no-cache: no cached run may stand in for it

    def __post_init__(self):
        self.action = Action(self.action)  # a plan read back from JSON holds plain strings

    @property
    def may_reuse(self) -> bool:
        """Whether a run another process finished meanwhile, with the same fingerprint, may stand in."""
        return not self.forced


def base_model_identity(loaded: LoadedPipeline) -> str:
    spec = loaded.spec.model
    if isinstance(spec, PathModelSpec):
        path = Path(spec.path) if Path(spec.path).is_absolute() else loaded.base_dir / spec.path
        digest = hashlib.sha256(str(path.resolve()).encode())
        for item in sorted(path.glob("*")):
            if item.is_file():
                stat = item.stat()
                digest.update(f"{item.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        return "path:" + digest.hexdigest()[:16]
    if isinstance(spec, GGUFModelSpec):  # the file's bytes, wherever it was installed
        from stages.models.pretrained import file_sha256, locate_gguf

        return "gguf:" + file_sha256(locate_gguf(spec.gguf, loaded.base_dir))[:16]
    if isinstance(spec, HubModelSpec):  # the snapshot's commit, not a moving branch name
        from stages.models.pretrained import hub_checkpoint

        return f"hub:{spec.hub}@{hub_checkpoint(spec.hub, spec.revision).name}"
    return "init:" + base_model_key(spec, loaded.spec.seed)


def fingerprint(loaded: LoadedPipeline, stage: str, upstream_runs: dict[str, str]) -> str:
    """``upstream_runs``: stage name -> the run id whose outputs this execution reads."""
    spec = loaded.spec
    config = spec.stages[stage]
    references = {
        field_name: (base_model_identity(loaded) if target == BASE else upstream_runs[target])
        for field_name, target in stage_references(spec, stage).items()
    }
    payload = {
        "stage": stage,
        "config": config.model_dump(mode="json", exclude=set(EXECUTION_FIELDS)),
        "seed": spec.seed,
        "upstream": references,
        "data": {name: data_key(spec.data[name], loaded.base_dir, spec.data) for name in config.dataset_names()},
        "rewards": {name: r.identity() for name, r in loaded.rewards_for(config.reward_names()).items()},
        "version": __version__,
    }
    if hasattr(config, "file_identity"):  # files a stage reads beside its datasets (a benchmark's task folder)
        payload["files"] = config.file_identity(loaded.base_dir)
    if (round_ := round_of(spec, stage)) is not None:  # iterate: the mix of round r's data
        payload.update(round_.fingerprint())
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def plan_run(loaded: LoadedPipeline, options: RunOptions, tracker, experiment_id: str) -> list[Decision]:
    """Decide, for every stage in graph order, whether to reuse a cached run or run it."""
    options.check(loaded)
    pipeline = loaded.spec
    order = topological_order(pipeline)
    edges = upstream_of(pipeline)

    selected = set(order)
    if options.only:
        selected = {options.only} | ancestors(pipeline, options.only)
    forced: set[str] = set()
    if options.no_cache:
        forced = set(order)
    if options.from_stage:
        forced |= {options.from_stage} | descendants(pipeline, options.from_stage)
    forced |= set(options.force)
    if options.only:
        forced.add(options.only)

    decisions: dict[str, Decision] = {}
    for stage in order:
        if stage not in selected:
            decisions[stage] = Decision(stage, Action.SKIP, f"not selected (--only {options.only})")
            continue
        rerunning = [u for u in edges[stage] if decisions[u].action is Action.RUN]
        if stage in forced:
            decisions[stage] = Decision(stage, Action.RUN, "forced", forced=True)
        elif rerunning:
            decisions[stage] = Decision(stage, Action.RUN, f"upstream {', '.join(rerunning)} reruns")
        else:
            upstream_runs = {u: decisions[u].cached_run_id for u in edges[stage]}
            fp = fingerprint(loaded, stage, upstream_runs)
            hit = tracker.find_cached(experiment_id, stage, fp)
            if hit is None:
                decisions[stage] = Decision(stage, Action.RUN, "no finished run with this fingerprint")
            else:
                decisions[stage] = Decision(stage, Action.CACHED, "same fingerprint", hit.info.run_id)

    if options.only:
        missing = [s for s in order if s in selected and s != options.only and decisions[s].action is Action.RUN]
        if missing:
            raise PlanError(
                f"--only {options.only} needs the cached outputs of {', '.join(missing)}, and there are none "
                f"that match the current spec; run the pipeline first (or use --from {missing[0]})"
            )
    return [decisions[s] for s in order]
