"""The stage graph, derived from references between stages (never declared twice)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flows.planning.iterate import downstream, failure_references, step_name
from stages.rewards.registry import reward_input_key

if TYPE_CHECKING:
    from flows.spec.schema import Pipeline

BASE = "base"  # the reserved name of the pipeline's own model in stage references


def stage_references(pipeline: Pipeline, stage: str) -> dict[str, str]:
    """Every stage a stage reads a checkpoint from, by input name: its own reference fields,
    plus the reward_model stage of each reward it scores with (``rewards.<reward>``), plus,
    for round r of an ``iterate:`` pipeline's training stage, the eval step whose failure set
    it trains on (``failures``: that one is read for its failures.jsonl, not a checkpoint)."""
    config = pipeline.stages[stage]
    refs = dict(config.references())
    for reward in config.reward_names():
        spec = pipeline.rewards.get(reward)
        if spec is not None and spec.stage:
            refs[reward_input_key(reward)] = spec.stage
    refs.update(failure_references(pipeline, stage))
    return refs


def upstream_of(pipeline: Pipeline) -> dict[str, list[str]]:
    """stage -> the stages it reads outputs from (``base`` is not a stage)."""
    return {
        name: [t for t in dict.fromkeys(stage_references(pipeline, name).values()) if t != BASE]
        for name in pipeline.stages
    }


def topological_order(pipeline: Pipeline) -> list[str]:
    """Stages in dependency order; ties keep declaration order. The spec has no cycles."""
    edges = upstream_of(pipeline)
    order, done = [], set()

    def visit(name):
        if name in done:
            return
        for upstream in edges[name]:
            visit(upstream)
        done.add(name)
        order.append(name)

    for name in pipeline.stages:
        visit(name)
    return order


def ancestors(pipeline: Pipeline, stage: str) -> set[str]:
    edges, found, todo = upstream_of(pipeline), set(), [stage]
    while todo:
        for upstream in edges[todo.pop()]:
            if upstream not in found:
                found.add(upstream)
                todo.append(upstream)
    return found


def descendants(pipeline: Pipeline, stage: str) -> set[str]:
    return downstream(upstream_of(pipeline), stage)


def render_graph(pipeline: Pipeline) -> str:
    """One line per stage in run order: ``name (kind) <- upstream, ...``."""
    lines = []
    for name in topological_order(pipeline):
        config = pipeline.stages[name]
        sources = [f"{field}={target}" for field, target in stage_references(pipeline, name).items()]
        sources += [f"data={d}({pipeline.data[d].role})" for d in config.dataset_names()]
        lines.append(f"  {name} ({config.kind}) <- {', '.join(sources)}")
    return "\n".join(lines)


# ------------------------------------------------------------------ unrolling the rounds


def expand_rounds(pipeline):
    """The pipeline with round 2..R's steps added after round 1's stages (their references renamed)."""
    spec = getattr(pipeline, "iterate", None)
    if spec is None or spec.rounds == 1:
        return pipeline
    repeated = [name for name in pipeline.stages
                if name == spec.train or name in descendants(pipeline, spec.train)]
    stages = dict(pipeline.stages)
    for round_ in range(2, spec.rounds + 1):
        for name in repeated:
            config = pipeline.stages[name]
            renamed = {field: step_name(target, round_) for field, target in config.references().items()
                       if target in repeated}
            assert all(hasattr(config, field) for field in renamed), (name, renamed)  # references() names fields
            stages[step_name(name, round_)] = config.model_copy(update=renamed)
    return pipeline.model_copy(update={"stages": stages})
